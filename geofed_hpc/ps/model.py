"""The global model and its version: params, the outer optimizer, the downlink, and what pulls are served."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from geofed_hpc import codec
from geofed_hpc.codec.inputs import TensorSource
from geofed_hpc.codec.sparse import DenseView
from geofed_hpc.config import CodecConfig, PSConfig
from geofed_hpc.errors import ProtocolError
from geofed_hpc.log import logger
from geofed_hpc.paradigms.exchange import Exchange
from geofed_hpc.ps.aggregate import Delta, OuterOptimizer, Params, add_update, piece_of
from geofed_hpc.ps.downlink import Downlink, Pending
from geofed_hpc.ps.persist import PSState
from geofed_hpc.ps.pulls import ModelFile, Payload, chunks_of, sha256_of, write_model
from geofed_hpc.rpc import messages as m

CHAIN_CACHE = 4  # update chains kept ready per version (sites at different versions ask for different ones)


class NonFiniteUpdate(ProtocolError):
    """A round's update holds NaN or Inf, or adding it would: it is refused and the model stays finite."""


@dataclass
class Proposal:
    """One global update, computed but not made: the downlink's encoding of it (`payload`, from `version`), the
    aggregated delta it was computed from (read again, piece by piece, when it is made: the outer optimizer's new
    state and the downlink's new residual are never held beside the old ones) and, for a paradigm whose updates
    expand (zeroth order), what it adds to each model tensor."""

    version: int
    payload: bytes | Pending
    delta: Mapping[str, np.ndarray | TensorSource]
    expanded: Params | None = None


class _Step:
    """The update's pieces, computed from the aggregated delta, the outer optimizer's state and the downlink's
    residual as they are before the update is made (so the same values come out each time a piece is read)."""

    def __init__(self, model: GlobalModel, delta: Mapping[str, np.ndarray | TensorSource]) -> None:
        self.delta = delta
        self.outer = model.outer
        self.buffers = dict(model.outer.buffers)  # before the update: read, then overwritten piece by piece
        self.residual = dict(model.downlink.residual)
        self.version = model.version

    def update(self, name: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(the update's piece, the new momentum's piece or None); NonFiniteUpdate on an overflow."""
        v = self.delta[name]
        d = piece_of(v, start, stop)
        if not isinstance(v, TensorSource):
            d = d.copy()  # consumed below
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below, by name
            u, buf = self.outer.piece(name, d, start, self.buffers.get(name))
        if not np.isfinite(u).all():
            raise NonFiniteUpdate(f"the update of {name} at version {self.version} holds NaN or Inf (overflow)")
        return u, buf

    def target(self, name: str, start: int, stop: int) -> np.ndarray:
        """The update's piece plus the downlink's residual: what the downlink encodes."""
        u, _ = self.update(name, start, stop)
        res = self.residual.get(name)
        if res is not None:
            u += res.reshape(-1)[start:stop]
        return u

    def sources(self) -> dict[str, TensorSource]:
        return {k: TensorSource(tuple(v.shape), self._reader(k)) for k, v in self.delta.items()}

    def _reader(self, name: str) -> Callable[[int, int], np.ndarray]:
        return lambda a, b: self.target(name, a, b)


def downlink_codec(cfg: PSConfig, settings: m.RunSettings, run_codec: CodecConfig | None) -> CodecConfig:
    """The codec of published updates: ps.downlink_codec, else the run's (int8 when sites adapt theirs), with the
    run's codec.* settings (ps.downlink_density for a sparse downlink)."""
    base = run_codec or CodecConfig(block_size=settings.block_size)
    name = cfg.downlink_codec or (settings.codec if settings.codec != "adaptive" else "int8")
    density = cfg.downlink_density or base.density
    return dataclasses.replace(base, name=name, block_size=settings.block_size, density=density)


class GlobalModel:
    """Owns the global model and the transitions between its versions: `params` and `version`, their shapes and the
    wire spec of a delta (through the paradigm's `exchange`), the outer optimizer that turns an aggregated delta
    into an update, the downlink that publishes each update (encoded once, kept for update chains), and the
    encoded model and update chains served to pulls (cached per version).

    Lock: none; not thread-safe. The coordinator's lock guards every call (`spec` may be read without it: it
    changes only when a model is adopted, before any delta can be checked against it).
    """

    def __init__(
        self,
        cfg: PSConfig,
        settings: m.RunSettings,
        exchange: Exchange,
        updates: Path | None,
        run_codec: CodecConfig | None = None,
    ) -> None:
        self.exchange = exchange
        self.params: Params | None = None
        self.version = 0
        self._shapes: dict[str, tuple[int, ...]] = {}  # the global model's
        self._spec: dict[str, tuple[tuple[int, ...], str]] = {}  # what a delta carries
        self.outer = OuterOptimizer(cfg.outer_optimizer, cfg.global_lr, cfg.momentum)
        self.downlink = Downlink(downlink_codec(cfg, settings, run_codec), cfg.downlink_history, updates)
        self._model_cache: ModelFile | None = None  # the encoded model of a version, in an unlinked file
        self.spill: Callable[[], Path] | None = None  # where it is written (a fresh path; None: kept in memory)
        self._digest: tuple[int, bytes] | None = None  # the model's identity at a version (codec.model_digest)
        self._chain_cache: OrderedDict[int, tuple[Payload, bytes, list[int]]] = OrderedDict()

    @property
    def initialized(self) -> bool:
        return self.params is not None

    @property
    def spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """What a delta carries: name -> (shape, dtype), as codec.decode expects it."""
        return self._spec

    def delta_shapes(self) -> dict[str, tuple[int, ...]]:
        """What a delta carries: name -> shape, in wire order."""
        return {k: s for k, (s, _) in self._spec.items()}

    @property
    def size(self) -> int:
        """How many values the global model holds (0 before it is initialized)."""
        return sum(int(v.size) for v in self.params.values()) if self.params else 0

    # ---------------------------------------------------------------- versions
    def adopt(self, params: Params, version: int) -> None:
        """Take `params` as the model at `version` (its optimizer state and downlink history stay)."""
        self.params = params
        self._shapes = {k: tuple(v.shape) for k, v in params.items()}
        self._spec = {k: (s, "float32") for k, s in self.exchange.wire_spec(self._shapes).items()}
        self.version = version
        self._new_version()

    def seed(self, params: Params, version: int, source: str) -> None:
        """Adopt `params` (from `source`) as a fresh global model at `version`, with no history (momentum,
        downlink)."""
        self.adopt(params, version)
        self.outer.load_state({})
        self.downlink.reset()
        if version > 0 and source.startswith("site"):
            logger.warning("global model re-seeded at version %d by %s (the PS had no state)", version, source)
        else:
            logger.info("global model initialized at version %d by %s: %d tensors", version, source, len(params))

    def restore(self, state: PSState, path: Path) -> None:
        """Adopt a snapshot's model (read from `path`), its momentum (when it used this outer optimizer) and
        downlink residual (a tensor of either that does not fit what a delta carries now, after a config change, is
        dropped with a warning: it would fail every round); drop kept downlink updates newer than it."""
        self.adopt(state.params, state.version)
        previous = state.settings.get("outer_optimizer")
        if previous == self.outer.kind:
            self.outer.load_state(self._fitting(state.momentum, "momentum", path))
        elif state.momentum:
            logger.warning("snapshot used outer optimizer %s; its momentum is dropped", previous)
        self.downlink.residual = self._fitting(state.residual, "downlink residual", path)
        dropped = self.downlink.truncate(state.version)
        logger.info(
            "restored global model version %d (%d tensors, %d sessions) from %s%s",
            state.version,
            len(state.params),
            len(state.sessions),
            path,
            f"; dropped {dropped} downlink updates newer than it" if dropped else "",
        )

    def _fitting(self, arrays: Params, what: str, path: Path) -> Params:
        spec = self.delta_shapes()
        for k, v in list(arrays.items()):
            if spec.get(k) != tuple(v.shape):
                logger.warning(
                    "snapshot %s: the %s of %r has shape %s, a delta carries %s now: dropped",
                    path,
                    what,
                    k,
                    tuple(v.shape),
                    spec.get(k, "no such tensor"),
                )
                del arrays[k]
        return arrays

    def state(self) -> PSState:
        """What a snapshot holds of the model: version, params, momentum and downlink residual (not copied)."""
        assert self.params is not None
        return PSState(self.version, self.params, self.outer.state(), self.downlink.residual)

    def check(self, delta: Delta) -> None:
        """Refuse a decoded delta that does not fit this model (before folding: it cannot be undone)."""
        self.exchange.check(DenseView(delta), self.version, self._shapes)

    def propose(self, delta: Mapping[str, np.ndarray | TensorSource]) -> Proposal:
        """The update for an aggregated `delta` (arrays or sources read piece by piece; not changed): the outer
        optimizer's step and the downlink's encoding, checked to keep the model finite. Nothing changes until
        `commit`; NonFiniteUpdate refuses it. Memory: the encoded update and a few pieces (64 MiB each); no
        model-sized array is made (but for a paradigm whose updates expand)."""
        assert self.params is not None
        step = _Step(self, delta)
        payload = self.downlink.encode(self.version, step.sources())
        expanded = None
        try:
            if type(self.exchange).expand is not Exchange.expand:
                applied = codec.decode(_chunks(payload))
                expanded = dict(self.exchange.expand(applied, self.version, self._shapes))
                for k, v in expanded.items():
                    self._check_adds(k, v, 0)
            else:
                for piece in codec.StreamDecoder().pieces(_chunks(payload)):
                    self._check_adds(piece.name, piece.values, piece.start, spare=True)
        except BaseException:
            if isinstance(payload, Pending):
                payload.discard()  # refused: its file goes now
            raise
        return Proposal(self.version, payload, delta, expanded)

    def _check_adds(self, name: str, values: np.ndarray, start: int, spare: bool = False) -> None:
        """NonFiniteUpdate unless `values`, added to `name` from flat index `start`, keep it finite (`spare`: the sum
        may be made in `values`, which is not used after)."""
        assert self.params is not None
        if not np.isfinite(values).all():
            raise NonFiniteUpdate(f"the update of {name} at version {self.version} holds NaN or Inf")
        with np.errstate(over="ignore"):
            flat = values.reshape(-1)
            after = np.add(self.params[name].reshape(-1)[start : start + flat.size], flat, out=flat if spare else None)
        if not np.isfinite(after).all():
            raise NonFiniteUpdate(f"the update at version {self.version} would turn {name} to Inf (overflow)")

    def commit(self, proposal: Proposal) -> None:
        """Make a proposed update: keep it on the downlink (the one step that may fail, an OSError: then nothing
        changed), then piece by piece take the optimizer's new state and the downlink's new residual (written over
        the old ones in place) and add the update to the model, which moves to the next version."""
        assert self.params is not None and proposal.version == self.version
        self.downlink.store(proposal.version, proposal.payload)
        step = _Step(self, proposal.delta)
        lossy = self.downlink.lossy
        residual: Params = {}
        momentum = self.outer.kind == "nesterov"
        for piece in codec.StreamDecoder().pieces(_chunks(proposal.payload)):
            name, start, dec = piece.name, piece.start, piece.values
            stop = start + dec.size
            u, buf = step.update(name, start, stop)
            res = step.residual.get(name)
            if res is not None:
                u += res.reshape(-1)[start:stop]
            if lossy:
                np.subtract(u, dec, out=u)
                _write(residual, name, piece.shape, u, start, step.residual)
            if buf is not None:
                self.outer.commit_piece(name, piece.shape, buf, start)
            if proposal.expanded is None:
                self.params[name].reshape(-1)[start:stop] += dec
        for name, v in proposal.delta.items():  # tensors without a value
            shape = tuple(v.shape)
            if lossy and name not in residual:
                residual[name] = np.zeros(shape, np.float32)
            if momentum and name not in self.outer.buffers:
                self.outer.buffers[name] = np.zeros(shape, np.float32)
        if lossy:
            self.downlink.residual = residual
        if proposal.expanded is not None:
            add_update(self.params, proposal.expanded)
        self.version += 1
        self._new_version()

    def _new_version(self) -> None:
        self._model_cache = None
        self._digest = None
        self._chain_cache.clear()

    # ---------------------------------------------------------------- pulls
    def payload(self, request: m.ModelRequest) -> tuple[m.ModelHeader, bytes]:
        """`serve`'s answer with its payload read into memory (for callers in process)."""
        header, payload = self.serve(request)
        return header, b"".join(chunks_of(payload))

    def serve(self, request: m.ModelRequest) -> tuple[m.ModelHeader, Payload]:
        """The updates since the site's version when they are kept and smaller than the model; else the model."""
        assert self.params is not None
        since, now = request.have_version, self.version
        if request.want_updates and 0 <= since <= now:
            cached = self._chain_cache.get(since)
            if cached is None:
                full = sum(4 * int(v.size) for v in self.params.values())
                segments = self.downlink.chain(since, now, full)
                if segments is not None:
                    chain: Payload = list(segments)  # files, read when sent
                    if all(isinstance(s, bytes) for s in segments):  # kept in memory: one is shared, not copied
                        chain = segments[0] if len(segments) == 1 else b"".join(segments)  # type: ignore[arg-type]
                    cached = self._chain_cache[since] = (chain, sha256_of(chain), [len(s) for s in segments])
                    while len(self._chain_cache) > CHAIN_CACHE:  # each is at most a model's worth of bytes
                        self._chain_cache.popitem(last=False)
            if cached is not None:
                chain, sha, sizes = cached
                name = self.downlink.cfg.name
                header = m.ModelHeader(now, name, sum(sizes), sha, "updates", since, sizes, self.digest())
                return header, chain
        if request.want_updates and since > now:
            logger.warning("a site holds version %d, newer than the global %d: sending the full model", since, now)
        if self._model_cache is None or self._model_cache.version != now:
            self._model_cache = write_model(self.params, now, self.spill() if self.spill else None)
        kept = self._model_cache
        header = m.ModelHeader(now, "fp32", kept.size, kept.sha256, "full", now, model_digest=self.digest())
        return header, kept.payload

    def digest(self) -> bytes:
        """The identity of the model at this version (computed once per version)."""
        assert self.params is not None
        if self._digest is None or self._digest[0] != self.version:
            self._digest = (self.version, codec.model_digest(self.params))
        return self._digest[1]

    def cached_chains(self) -> list[int]:
        """The versions whose update chain is encoded and ready, oldest first."""
        return list(self._chain_cache)

    def hash(self) -> str:
        """sha256 over the model's names and bytes."""
        h = hashlib.sha256()
        for k in sorted(self.params or {}):
            h.update(k.encode())
            h.update(np.ascontiguousarray(self.params[k]).tobytes())  # type: ignore[index]
        return h.hexdigest()


def _chunks(payload: bytes | Pending) -> list[bytes] | Iterator[bytes]:
    """A payload's bytes in chunks (a file's read 1 MiB at a time)."""
    return payload.chunks(1 << 20) if isinstance(payload, Pending) else [payload]


def _write(into: Params, name: str, shape: tuple[int, ...], piece: np.ndarray, start: int, old: Params) -> None:
    """into[name][start : start + piece.size] = piece, into `old[name]`'s array when it has the shape (each of its
    pieces is read before it is overwritten), else a new one."""
    a = into.get(name)
    if a is None:
        o = old.get(name)
        a = into[name] = o if o is not None and o.shape == shape else np.empty(shape, np.float32)
    a.reshape(-1)[start : start + piece.size] = piece
