"""Aggregation math, pure: folding deltas, robust rules, staleness, outer optimizers, round closing."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from geofed_hpc.codec.sparse import SparseTensor
from geofed_hpc.paradigms.exchange import Params

# A decoded delta: dense arrays, or for a sparse payload its kept indices and values (folded by scatter-add).
Delta = dict[str, np.ndarray | SparseTensor]


@dataclass
class WeightedSum:
    """What a round of mean-folded deltas holds before its mean is taken: sum of weight*scale*delta, the summed
    weights, sum of weight*steps and the count. Two of them add term by term (peers that each folded part of a
    round), so the mean of the whole is taken once, at the end."""

    total: Params
    weight: float
    weighted_steps: float
    count: int

    def mean(self) -> tuple[Params, float]:
        """(weighted mean in new arrays, FedNova's tau_eff); the sum stays as it is, so a round whose update
        cannot be made (a full disk) is still whole."""
        if not self.weight > 0:
            raise ValueError("no delta folded yet")
        inv = np.float32(1.0 / self.weight)
        return {k: v * inv for k, v in self.total.items()}, self.weighted_steps / self.weight


class MeanAccumulator:
    """Fold weighted deltas into one running sum: memory is one model's worth, whatever the count. A sparse
    tensor is scatter-added at its kept positions (the sum is the only dense copy).

    fold(delta, weight, scale, steps) adds weight*scale*delta; take_sum() hands over the WeightedSum (before the
    mean: what a peer group would reduce), take_mean() its mean and FedNova's effective step count (the weighted
    mean of the folded `steps`); both start afresh. Not thread-safe: its owner (the open round) is called under
    the coordinator's lock.
    """

    def __init__(self) -> None:
        self._sum: Params | None = None
        self.weight = 0.0
        self.weighted_steps = 0.0
        self.count = 0

    def fold(
        self,
        delta: Mapping[str, np.ndarray | SparseTensor],
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
                if isinstance(v, SparseTensor):
                    self._sum[k] = np.zeros(v.shape, np.float32)
                    v.add_into(self._sum[k], factor)
                    continue
                own = np.array(v, dtype=np.float32, copy=True)
                if factor != 1:
                    own *= factor
                self._sum[k] = own
        else:
            if delta.keys() != self._sum.keys():
                raise ValueError("delta names differ from the ones already folded")
            for k, v in delta.items():
                if isinstance(v, SparseTensor):
                    v.add_into(self._sum[k], factor)
                elif factor == 1:
                    self._sum[k] += v
                elif consume and v.dtype == np.float32:
                    v *= factor
                    self._sum[k] += v
                else:
                    self._sum[k] += factor * v
        self.weight += weight
        self.weighted_steps += weight * steps
        self.count += 1

    def take_sum(self) -> WeightedSum:
        """Everything folded, before the mean; the sum is handed over, not copied."""
        out = self.peek_sum()
        self.reset()
        return out

    def peek_sum(self) -> WeightedSum:
        """Everything folded, before the mean, without starting afresh (the arrays are shared, not copied)."""
        if self._sum is None:
            raise ValueError("no delta folded yet")
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


def global_norm(delta: Mapping[str, np.ndarray | SparseTensor]) -> float:
    """L2 norm over every tensor of `delta` (accumulated in float64)."""
    total = 0.0
    for v in delta.values():
        if isinstance(v, SparseTensor):
            total += v.sq_norm()
            continue
        flat = v.reshape(-1)
        total += float(np.dot(flat, flat)) if flat.size else 0.0
    return math.sqrt(total)


def scale_delta(delta: Mapping[str, np.ndarray | SparseTensor], factor: float) -> None:
    """delta *= factor, in place (a sparse tensor's kept values and mean row only)."""
    f = np.float32(factor)
    for v in delta.values():
        if isinstance(v, SparseTensor):
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
