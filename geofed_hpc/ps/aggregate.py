"""Aggregation math, pure: folding deltas, robust rules, staleness, outer optimizers, round closing."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from geofed_hpc.codec.inputs import TensorSource
from geofed_hpc.codec.packed import PackedTensor
from geofed_hpc.codec.sparse import SparseTensor
from geofed_hpc.paradigms.exchange import Params

# A decoded delta: dense arrays, or for a sparse payload its kept indices and values (folded by scatter-add), or for
# a dense payload its pieces' contents (PackedTensor: decoded piece by piece when folded).
Delta = dict[str, np.ndarray | SparseTensor | PackedTensor]
# Tensors that are arrays or read piece by piece (TensorSource: a folded delta kept as it came, a round's mean).
Lazy = dict[str, np.ndarray | TensorSource]


def piece_of(v: np.ndarray | TensorSource, start: int, stop: int) -> np.ndarray:
    """Flat values [start, stop) of an array (a view: not to be written) or a source (a new array)."""
    if isinstance(v, TensorSource):
        return np.asarray(v.read(start, stop), np.float32)
    return v.reshape(-1)[start:stop]


def dense_of(v: np.ndarray | TensorSource) -> np.ndarray:
    """An array as it is, or a source read whole into a new array."""
    if not isinstance(v, TensorSource):
        return v
    out = np.empty(v.shape, np.float32)
    flat = out.reshape(-1)
    step = 1 << 24
    for start in range(0, flat.size, step):
        flat[start : start + step] = v.read(start, min(flat.size, start + step))
    return out


def _kept(v: SparseTensor | PackedTensor, factor: np.float32) -> TensorSource:
    """zeros + factor * v (the first delta folded into an empty sum), read piece by piece from `v` as it came."""
    if isinstance(v, SparseTensor):
        return TensorSource(v.shape, lambda a, b: v.read(a, b, factor))

    def read(a: int, b: int) -> np.ndarray:
        x = v.read(a, b)
        if factor != 1:
            x *= factor
        return x

    return TensorSource(v.shape, read)


def _times(v: np.ndarray | TensorSource, *factors: np.float32) -> TensorSource:
    """v * f0 (a new array per piece), then *= each further factor in place: a round's mean read piece by piece."""

    def read(a: int, b: int) -> np.ndarray:
        if isinstance(v, TensorSource):  # a new array: scaled in place (the same float32 product as v * f0)
            x = piece_of(v, a, b)
            x *= factors[0]
        else:
            x = piece_of(v, a, b) * factors[0]
        for f in factors[1:]:
            x *= f
        return x

    return TensorSource(tuple(v.shape), read)


@dataclass
class WeightedSum:
    """What a round of mean-folded deltas holds before its mean is taken: sum of weight*scale*delta, the summed
    weights, sum of weight*steps and the count. Two of them add term by term (peers that each folded part of a
    round), so the mean of the whole is taken once, at the end."""

    total: Lazy
    weight: float
    weighted_steps: float
    count: int

    def mean(self) -> tuple[Params, float]:
        """(weighted mean in new arrays, FedNova's tau_eff); the sum stays as it is, so a round whose update
        cannot be made (a full disk) is still whole."""
        sources, tau_eff = self.mean_sources()
        return {k: dense_of(v) for k, v in sources.items()}, tau_eff

    def mean_sources(self, times: float | None = None) -> tuple[dict[str, TensorSource], float]:
        """As `mean`, but each tensor read piece by piece when it is used (no copy of the sum is made); `times`:
        then multiplied by it too (FedNova's tau_eff), as `v *= times` on the mean would."""
        if not self.weight > 0:
            raise ValueError("no delta folded yet")
        inv = np.float32(1.0 / self.weight)
        factors = (inv,) if times is None else (inv, np.float32(times))
        return {k: _times(v, *factors) for k, v in self.total.items()}, self.weighted_steps / self.weight


class MeanAccumulator:
    """Fold weighted deltas into one running sum: memory is one model's worth, whatever the count. A sparse
    tensor is scatter-added at its kept positions (the sum is the only dense copy). The first delta folded is kept
    as it came when it is sparse or packed (a TensorSource reading zeros + factor * it piece by piece): a round of
    one delta (async) never holds a dense copy of it; the sum becomes dense when a second one is folded.

    fold(delta, weight, scale, steps) adds weight*scale*delta; take_sum() hands over the WeightedSum (before the
    mean: what a peer group would reduce), take_mean() its mean and FedNova's effective step count (the weighted
    mean of the folded `steps`); both start afresh. Not thread-safe: its owner (the open round) is called under
    the coordinator's lock.
    """

    def __init__(self) -> None:
        self._sum: Lazy | None = None
        self.weight = 0.0
        self.weighted_steps = 0.0
        self.count = 0

    def fold(
        self,
        delta: Mapping[str, np.ndarray | SparseTensor | PackedTensor],
        weight: float = 1.0,
        scale: float = 1.0,
        steps: int = 0,
        consume: bool = False,
    ) -> None:
        """Add `weight * scale * delta`; with `consume` the caller's arrays may be scaled in place. It never keeps
        them (the PS decodes the next push into the same buffers)."""
        if not weight > 0:
            raise ValueError(f"weight must be positive, got {weight}")
        factor = np.float32(weight * scale)
        if self._sum is None:
            self._sum = {}
            for k, v in delta.items():
                if isinstance(v, (SparseTensor, PackedTensor)):
                    self._sum[k] = _kept(v, factor)
                    continue
                own = np.array(v, dtype=np.float32, copy=True)
                if factor != 1:
                    own *= factor
                self._sum[k] = own
        else:
            if delta.keys() != self._sum.keys():
                raise ValueError("delta names differ from the ones already folded")
            for k, v in delta.items():
                acc = self._sum[k]
                if isinstance(acc, TensorSource):  # the first delta, kept as it came: the sum becomes dense
                    acc = self._sum[k] = dense_of(acc)
                if isinstance(v, (SparseTensor, PackedTensor)):
                    v.add_into(acc, factor)
                elif factor == 1:
                    acc += v
                elif consume and v.dtype == np.float32:
                    v *= factor
                    acc += v
                else:
                    acc += factor * v
        self.weight += weight
        self.weighted_steps += weight * steps
        self.count += 1

    def take_sum(self) -> WeightedSum:
        """Everything folded, before the mean; the sum is handed over, not copied."""
        out = self.peek_sum()
        self.reset()
        return out

    def peek_sum(self, lazy: bool = False) -> WeightedSum:
        """Everything folded, before the mean, without starting afresh (the arrays are shared, not copied); with
        `lazy` a first delta kept as it came stays a TensorSource (else it is read into an array now)."""
        if self._sum is None:
            raise ValueError("no delta folded yet")
        if not lazy:
            self._sum = {k: dense_of(v) for k, v in self._sum.items()}
        return WeightedSum(self._sum, self.weight, self.weighted_steps, self.count)

    def take_mean(self) -> tuple[Params, float]:
        """(weighted mean of everything folded, FedNova's tau_eff); the sum is handed over, not copied."""
        return self.take_sum().mean()

    def reset(self) -> None:
        self._sum, self.weight, self.weighted_steps, self.count = None, 0.0, 0.0, 0


def staleness_discount(staleness: int) -> float:
    """Weight of a delta computed `staleness` versions ago: 1/sqrt(1+tau) (FedAsync's polynomial rule)."""
    if staleness < 0:
        raise ValueError(f"staleness cannot be negative, got {staleness}")
    return 1.0 / math.sqrt(1.0 + staleness)


class RelativeWork:
    """Async `ps.weighting=tokens`: a delta counts its tokens over the mean tokens of the last `window` deltas (its
    own included). Sites that trained more tokens in their interval count more, and the weights average 1, so the
    step stays what `ps.global_lr` and the staleness discount make it. Its window is kept in the PS's snapshots.
    Not thread-safe: its owner (the async strategy) is called under the coordinator's lock."""

    def __init__(self, window: int = 16) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self._recent: deque[float] = deque(maxlen=window)

    def weight(self, tokens: float) -> float:
        if not tokens > 0:
            raise ValueError(f"tokens must be positive, got {tokens}")
        self._recent.append(float(tokens))
        return float(tokens) * len(self._recent) / sum(self._recent)

    def recent(self) -> list[float]:
        """The window's tokens, oldest first (what a snapshot keeps)."""
        return list(self._recent)

    def load(self, recent: list[float]) -> None:
        self._recent.clear()
        self._recent.extend(float(t) for t in recent)


def global_norm(delta: Mapping[str, np.ndarray | SparseTensor | PackedTensor]) -> float:
    """L2 norm over every tensor of `delta` (accumulated in float64)."""
    total = 0.0
    for v in delta.values():
        if isinstance(v, (SparseTensor, PackedTensor)):
            total += v.sq_norm()
            continue
        flat = v.reshape(-1)
        total += float(np.dot(flat, flat)) if flat.size else 0.0
    return math.sqrt(total)


def scale_delta(delta: Mapping[str, np.ndarray | SparseTensor | PackedTensor], factor: float) -> None:
    """delta *= factor, in place (a sparse tensor's kept values and mean row only)."""
    f = np.float32(factor)
    for v in delta.values():
        if isinstance(v, (SparseTensor, PackedTensor)):
            v.scale(f)
        else:
            v *= f


def clip_scale(norm: float, clip_norm: float) -> float:
    """Factor that brings a delta of L2 norm `norm` to at most `clip_norm` (1.0 when off or already inside)."""
    if clip_norm <= 0 or norm <= clip_norm:
        return 1.0
    return clip_norm / norm


def trimmed_mean(stack: np.ndarray, trim_fraction: float) -> np.ndarray:
    """Coordinate-wise mean of rows after dropping the floor(f*N) largest and smallest values per column."""
    n = stack.shape[0]
    k = min(int(math.floor(trim_fraction * n)), (n - 1) // 2)
    ordered = np.sort(stack, axis=0)
    kept = ordered[k : n - k]
    return kept.mean(axis=0, dtype=np.float64).astype(np.float32)


def coordinate_median(stack: np.ndarray) -> np.ndarray:
    """Coordinate-wise median of rows (mean of the two middle values for an even count)."""
    return np.median(stack, axis=0).astype(np.float32)


ROBUST_RULES = {"trimmed_mean", "median"}


def robust_rule(name: str, stack: np.ndarray, trim_fraction: float) -> np.ndarray:
    """Apply robust rule `name` (trimmed_mean or median) column-wise to an (N, n) float32 stack."""
    if name == "trimmed_mean":
        return trimmed_mean(stack, trim_fraction)
    if name == "median":
        return coordinate_median(stack)
    raise ValueError(f"unknown robust rule {name!r}; expected one of {sorted(ROBUST_RULES)}")


class OuterOptimizer:
    """Turn an aggregated delta into the global update: plain/fednova lr*D, or Nesterov momentum (DiLoCo).

    Deltas point from the base to the local model (the negative outer gradient), so Nesterov reads
    m <- mu*m + D; update = lr * (D + mu*m), torch's SGD(nesterov=True) with the sign flipped.
    Not thread-safe: its owner (the GlobalModel) is called under the coordinator's lock.
    """

    KINDS = ("plain", "nesterov", "fednova")

    def __init__(self, kind: str, lr: float, momentum: float = 0.9) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"unknown outer optimizer {kind!r}; expected one of {', '.join(self.KINDS)}")
        self.kind, self.lr, self.momentum = kind, lr, momentum
        self.buffers: Params = {}

    def step(self, delta: Params) -> Params:
        """The update for `delta` (which is consumed: its arrays are reused for the result); the state moves."""
        update, buffers = self.propose(delta)
        self.commit(buffers)
        return update

    def propose(self, delta: Params) -> tuple[Params, Params | None]:
        """The update for `delta` (consumed) and the state after it (None: stateless), leaving the current state
        as it is until `commit`: a round whose update is not made does not move the momentum."""
        lr = np.float32(self.lr)
        if self.kind != "nesterov":
            for v in delta.values():
                v *= lr
            return delta, None
        mu = np.float32(self.momentum)
        buffers: Params = {}
        for k, d in delta.items():
            old = self.buffers.get(k)
            buf = buffers[k] = d.copy() if old is None else mu * old + d
            d += mu * buf
            d *= lr
        return delta, buffers

    def piece(
        self, name: str, d: np.ndarray, start: int, old: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """`propose` on flat piece [start, start + d.size) of tensor `name` of the aggregated delta (`d`, a new
        array, is consumed) with `old`, the tensor's momentum before the update (None: none yet): (the update's
        piece, the new momentum's piece or None), the same float32 operations as `propose` makes on the whole;
        nothing changes (see `commit_piece`)."""
        lr = np.float32(self.lr)
        if self.kind != "nesterov":
            d *= lr
            return d, None
        mu = np.float32(self.momentum)
        if old is None:
            buf = d.copy()
        else:  # mu * old + d, the product's array reused for the sum
            buf = np.multiply(old.reshape(-1)[start : start + d.size], mu)
            buf += d
        scaled = np.multiply(buf, mu)
        d += scaled
        del scaled
        d *= lr
        return d, buf

    def commit_piece(self, name: str, shape: tuple[int, ...], buf: np.ndarray, start: int) -> None:
        """Take a new momentum's piece `buf` (in the tensor's buffer, in place: each piece of the old one is read
        before it is overwritten; a tensor with none yet gets a new one)."""
        old = self.buffers.get(name)
        if old is None or old.shape != shape:
            old = self.buffers[name] = np.empty(shape, np.float32)
        old.reshape(-1)[start : start + buf.size] = buf

    def commit(self, buffers: Params | None) -> None:
        """Take the state a proposal computed (None: nothing to take)."""
        if buffers is not None:
            self.buffers = buffers

    def state(self) -> Params:
        return self.buffers

    def load_state(self, buffers: Mapping[str, np.ndarray]) -> None:
        self.buffers = {k: np.asarray(v, dtype=np.float32) for k, v in buffers.items()}


def add_update(params: Params, update: Mapping[str, np.ndarray]) -> None:
    """Theta <- Theta + update exactly (float32 adds, the same ones every replica performs)."""
    for k, v in update.items():
        target = params[k]
        if target.shape != v.shape:
            raise ValueError(f"{k}: update shape {v.shape} != parameter shape {target.shape}")
        target += v


def round_complete(pushed: set[str], active: set[str], now: float, deadline: float | None) -> bool:
    """A sync round closes when every active session pushed, or its deadline passed with at least one push."""
    if not pushed:
        return False
    if active <= pushed:
        return True
    return deadline is not None and now >= deadline


def buffer_full(count: int, size: int, now: float, deadline: float | None) -> bool:
    """A buffered update fires after `size` deltas, or when its deadline passed with at least one."""
    if count == 0:
        return False
    return count >= size or (deadline is not None and now >= deadline)
