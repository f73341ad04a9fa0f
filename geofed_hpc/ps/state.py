"""The PS's global state: model, version, outer optimizer, rounds, downlink, snapshots; no RPC here."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from geofed_hpc import codec
from geofed_hpc.config import CodecConfig, PSConfig
from geofed_hpc.errors import CheckpointError, GeofedError
from geofed_hpc.faults import fault
from geofed_hpc.log import logger
from geofed_hpc.paradigms.exchange import Exchange
from geofed_hpc.ps.aggregate import OuterOptimizer, Params, add_update
from geofed_hpc.ps.downlink import Downlink
from geofed_hpc.ps.journal import RoundJournal
from geofed_hpc.ps.persist import PSState, Snapshots, load_init
from geofed_hpc.ps.rounds import Rounds
from geofed_hpc.ps.sessions import SessionTable
from geofed_hpc.ps.staging import Staging
from geofed_hpc.ps.tokens import TokenVerifier, tokens_path
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.stream import digest

PERSISTED_PUSH_IDS = 2_000
CHAIN_CACHE = 4  # update chains kept ready per version (sites at different versions ask for different ones)
APPLIED_KEPT = 256  # recent global updates kept for `ps up`'s progress lines


@dataclass
class Contribution:
    """One delta admitted to the open round."""

    site: str
    staleness: int
    tokens: int
    nbytes: int


@dataclass
class AppliedVersion:
    """One global update: which sites' deltas made it, how stale, how many tokens and bytes."""

    version: int
    time: float
    sites: list[str]
    staleness: int  # the largest among its deltas
    tokens: int
    nbytes: int
    active: int
    why: str


class GlobalState:
    """Everything the PS holds, and the transitions between versions; callers hold `_cond` around each method
    whose docstring says so. ParameterServerLogic (servicer.py) adds the RPCs on top."""

    def __init__(
        self,
        cfg: PSConfig,
        settings: m.RunSettings,
        clock: Callable[[], float] = time.monotonic,
        exchange: Exchange | None = None,
    ) -> None:
        self.cfg = cfg
        self.settings = settings
        # the paradigm's view of the model: what a delta carries and how an update lands on the global model
        self.exchange = exchange or Exchange()
        settings.paradigm = self.exchange.describe()
        settings.aggregation = cfg.aggregation
        self._clock = clock
        self._started = clock()
        self._cond = threading.Condition()
        # Memory is bounded by these limits, not by the number of sites: streams being read, streams being sent,
        # and the threads that decode verified pushes (never the gRPC handler threads: each thread's malloc arena
        # keeps about the largest thing it once decoded).
        self._receiving = threading.BoundedSemaphore(cfg.max_concurrent_pushes)
        self._sending = threading.BoundedSemaphore(cfg.max_concurrent_downloads)
        self._decoders = ThreadPoolExecutor(cfg.decode_threads, thread_name_prefix="ps-decode")
        self.params: Params | None = None
        self._shapes: dict[str, tuple[int, ...]] = {}  # the global model's
        self._spec: dict[str, tuple[tuple[int, ...], str]] = {}  # what a delta carries
        self.version = 0
        tokens = TokenVerifier(tokens_path(cfg.state_dir) if cfg.state_dir else None, cfg.enroll_token)
        idle_after = 3 * cfg.round_timeout.total_seconds()
        self.sessions = SessionTable(tokens, clock, idle_after, cfg.max_sessions, cfg.max_sessions_per_site)
        self._push_ids: OrderedDict[str, m.PushReply] = OrderedDict()
        self._inflight: set[str] = set()
        self._closing = False
        state = Path(cfg.state_dir).expanduser() if cfg.state_dir else None
        self.staging = Staging(cfg.staging_dir or (state / "staging" if state else None))
        self.rounds = Rounds(cfg, self.staging, clock)
        self.outer = OuterOptimizer(cfg.outer_optimizer, cfg.global_lr, cfg.momentum)
        run_codec = settings.codec if settings.codec != "adaptive" else "int8"  # adaptive varies per push
        down = CodecConfig(name=cfg.downlink_codec or run_codec, block_size=settings.block_size)
        self.downlink = Downlink(down, cfg.downlink_history, state / "updates" if state else None)
        self._snapshots = Snapshots(state) if state else None
        self.journal = RoundJournal(state / "round") if state else None  # the open round's deltas (journal.py)
        self.snapshot_version = -1
        self._model_cache: tuple[int, bytes, bytes] | None = None
        self._chain_cache: OrderedDict[int, tuple[bytes, bytes, list[int]]] = OrderedDict()
        # observability (metrics/ is fed by ps/app.py through these; none of it is persisted)
        self.pushes_total = 0
        self.bytes_received_total = 0
        self.val_losses: dict[str, tuple[int, float]] = {}  # site -> (version it evaluated, validation loss)
        self.on_site_metrics: Callable[[str, dict[str, float]], None] | None = None
        self.applied: deque[AppliedVersion] = deque(maxlen=APPLIED_KEPT)
        self._contributions: list[Contribution] = []  # of the open round
        if self._snapshots is not None:
            self._restore()
        if cfg.init_from:
            self._init_from(Path(cfg.init_from))

    # ---------------------------------------------------------------- state
    @property
    def initialized(self) -> bool:
        return self.params is not None

    def _adopt(self, params: Params, version: int) -> None:
        """Take `params` as the model at `version` (hold the lock)."""
        self.params = params
        self._shapes = {k: tuple(v.shape) for k, v in params.items()}
        self._spec = {k: (s, "float32") for k, s in self.exchange.wire_spec(self._shapes).items()}
        self.version = version
        self.rounds.clear()
        self._contributions = []
        self.rounds.spec = {k: s for k, (s, _) in self._spec.items()}
        self._new_version_caches()

    def _seed(self, params: Params, version: int, source: str) -> None:
        """Adopt `params` as a fresh global model at `version`, with no history (hold the lock)."""
        self._adopt(params, version)
        self.outer.load_state({})
        self.downlink.reset()
        if self.journal is not None:
            self.journal.clear()  # a new model: no open round from before it
        if version > 0 and source.startswith("site"):
            logger.warning("global model re-seeded at version %d by %s (the PS had no state)", version, source)
        else:
            logger.info("global model initialized at version %d by %s: %d tensors", version, source, len(params))
        self._snapshot()
        self._cond.notify_all()

    def _restore(self) -> None:
        assert self._snapshots is not None
        loaded = self._snapshots.load()
        if loaded is None:
            return
        state, path = loaded
        theirs = state.settings.get("paradigm", "identity")
        if theirs != self.settings.paradigm:
            raise CheckpointError(
                f"the snapshot {path} holds a global model of paradigm {theirs}, this PS runs "
                f"{self.settings.paradigm}: start it with the snapshot's paradigm, or use another ps.state_dir"
            )
        self._adopt(state.params, state.version)
        previous = state.settings.get("outer_optimizer")
        if previous == self.cfg.outer_optimizer:
            self.outer.load_state(state.momentum)
        elif state.momentum:
            logger.warning("snapshot used outer optimizer %s; its momentum is dropped", previous)
        self.downlink.residual = state.residual
        self.sessions.load_json(state.sessions)
        for push_id, accepted, version, reason, staleness in state.push_ids:
            self._push_ids[push_id] = m.PushReply(accepted, version, reason, staleness)
        dropped = self.downlink.truncate(state.version)
        self.snapshot_version = state.version
        logger.info(
            "restored global model version %d (%d tensors, %d sessions) from %s%s",
            state.version,
            len(state.params),
            len(state.sessions),
            path,
            f"; dropped {dropped} downlink updates newer than it" if dropped else "",
        )

    def _init_from(self, path: Path) -> None:
        if self.initialized:
            logger.warning("ps.init_from=%s ignored: the state directory already holds version %d", path, self.version)
            return
        params, version = load_init(path)
        with self._cond:
            self._seed(params, version, f"file {path}")

    def _snapshot(self) -> None:
        """Write the whole PS state atomically (hold the lock); a failure is logged, never fatal."""
        if self._snapshots is None or self.params is None:
            return
        pushes = [[k, r.accepted, r.version, r.reason, r.staleness] for k, r in self._push_ids.items()]
        state = PSState(
            self.version,
            self.params,
            self.outer.state(),
            self.downlink.residual,
            self.sessions.to_json(),
            pushes[-PERSISTED_PUSH_IDS:],
            {
                "aggregation": self.cfg.aggregation,
                "outer_optimizer": self.cfg.outer_optimizer,
                "paradigm": self.settings.paradigm,
            },
        )
        try:
            path = self._snapshots.save(state)
        except (OSError, CheckpointError) as exc:
            logger.error("snapshot of version %d failed (the previous one stays loadable): %s", self.version, exc)
            return
        self.snapshot_version = self.version
        logger.debug("snapshot of version %d written to %s", self.version, path)
        fault("ps.snapshot", str(self.version))

    def _forget_journaled_rounds(self) -> None:
        """No round is open now: once a snapshot holds the current version, the journaled rounds are in it
        (until then they stay, and a restart from the older snapshot replays the ones of its version)."""
        if self.journal is not None and self.snapshot_version == self.version and not self.rounds.count:
            self.journal.clear()

    def _new_version_caches(self) -> None:
        self._model_cache = None
        self._chain_cache.clear()

    # ---------------------------------------------------------------- rounds
    def _maybe_close(self) -> None:
        if self.initialized and self.rounds.ready(self.sessions.active()):
            self._close_round("ready")

    def _close_round(self, why: str) -> None:
        """Aggregate the open round, step the outer optimizer, publish and apply the update (hold the lock)."""
        assert self.params is not None
        parts, self._contributions = self._contributions, []
        try:
            delta, count = self.rounds.close()
            update = self.outer.step(delta)
            applied = self.downlink.publish(self.version, update)
        except (GeofedError, ValueError) as exc:
            logger.error("round at version %d discarded: %s", self.version, exc)
            self._forget_journaled_rounds()
            return
        fault("ps.aggregate", str(self.version))
        add_update(self.params, self.exchange.expand(applied, self.version, self._shapes))
        self.version += 1
        self._new_version_caches()
        self.applied.append(
            AppliedVersion(
                self.version,
                time.time(),
                [c.site for c in parts],
                max((c.staleness for c in parts), default=0),
                sum(c.tokens for c in parts),
                sum(c.nbytes for c in parts),
                len(self.sessions.active()),
                why,
            )
        )
        if self.version % self.cfg.snapshot_every == 0:
            self._snapshot()
        self._forget_journaled_rounds()
        self._cond.notify_all()
        logger.info("update from %d deltas (%s) -> version %d", count, why, self.version)

    def tick(self) -> None:
        """Close a round whose deadline passed; called periodically by the server loop."""
        with self._cond:
            self._maybe_close()

    def begin_shutdown(self) -> None:
        """Stop long-polls from waiting (they answer with what they have); pushes in flight go on."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def finish(self, wait: float = 10.0) -> None:
        """After the server stopped: wait for pushes still applying, apply the open round, snapshot, clean up."""
        deadline = time.monotonic() + wait
        with self._cond:
            self._closing = True
            while self._inflight and time.monotonic() < deadline:
                self._cond.wait(0.2)
            if self.initialized and self.rounds.count:
                self._close_round("shutdown: applying the open round early")
            self._snapshot()
            self._forget_journaled_rounds()
            self.rounds.clear()
        self._decoders.shutdown(wait=True)
        self.staging.close()

    def _model_payload(self, request: m.ModelRequest) -> tuple[m.ModelHeader, bytes]:
        """The updates since the site's version when they are kept and smaller than the model; else the model."""
        assert self.params is not None
        since, now = request.have_version, self.version
        if request.want_updates and 0 <= since <= now:
            cached = self._chain_cache.get(since)
            if cached is None:
                full = sum(4 * int(v.size) for v in self.params.values())
                segments = self.downlink.chain(since, now, full)
                if segments is not None:
                    payload = b"".join(segments)
                    cached = self._chain_cache[since] = (payload, digest(payload), [len(s) for s in segments])
                    while len(self._chain_cache) > CHAIN_CACHE:  # each is at most a model's worth of bytes
                        self._chain_cache.popitem(last=False)
            if cached is not None:
                payload, sha, sizes = cached
                header = m.ModelHeader(now, self.downlink.cfg.name, len(payload), sha, "updates", since, sizes)
                return header, payload
        if request.want_updates and since > now:
            logger.warning("a site holds version %d, newer than the global %d: sending the full model", since, now)
        if self._model_cache is None or self._model_cache[0] != now:
            payload = codec.encode(self.params, CodecConfig(name="fp32"))
            self._model_cache = (now, payload, digest(payload))
        _, payload, sha = self._model_cache
        return m.ModelHeader(now, "fp32", len(payload), sha, "full", now), payload

    def applied_since(self, version: int) -> list[dict]:
        """The kept global updates after `version`, oldest first, as plain dicts."""
        with self._cond:
            return [asdict(a) for a in self.applied if a.version > version]

    def global_val_loss(self) -> tuple[int, float]:
        """The newest version any site evaluated, and the mean validation loss the sites reported for it
        ((-1, nan): none yet)."""
        with self._cond:
            if not self.val_losses:
                return -1, float("nan")
            newest = max(v for v, _ in self.val_losses.values())
            losses = [loss for v, loss in self.val_losses.values() if v == newest]
            return newest, sum(losses) / len(losses)

    def ps_metrics(self) -> dict[str, float | int]:
        """The ps/* metric values now (the global validation loss once a site reported it for this version)."""
        with self._cond:
            values: dict[str, float | int] = {
                "ps/version": self.version,
                "ps/active_sites": len(self.sessions.active()),
                "ps/pushes_total": self.pushes_total,
                "ps/bytes_received_total": self.bytes_received_total,
            }
            version, val = self.global_val_loss()
        if version == values["ps/version"]:  # a loss of an older version is not the global model's
            values["ps/global_val_loss"] = val
        return values

    def _site_metrics(self, site: str, metrics: dict[str, float]) -> None:
        """Hand one site's values to the observer (Prometheus); an observer never fails an RPC."""
        if self.on_site_metrics is None:
            return
        try:
            self.on_site_metrics(site, metrics)
        except Exception:  # noqa: BLE001
            logger.debug("site metrics observer failed", exc_info=True)

    def model_hash(self) -> str:
        """sha256 over the global model's names and bytes (tests compare it before and after bad input)."""
        h = hashlib.sha256()
        with self._cond:
            for k in sorted(self.params or {}):
                h.update(k.encode())
                h.update(np.ascontiguousarray(self.params[k]).tobytes())  # type: ignore[index]
        return h.hexdigest()
