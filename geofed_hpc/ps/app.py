"""A running parameter server: the logic behind a real gRPC port, a round ticker, graceful shutdown."""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from geofed_hpc.config import RunConfig
from geofed_hpc.config.run import shareable
from geofed_hpc.config.train import SPLIT_PARADIGMS
from geofed_hpc.log import logger
from geofed_hpc.metrics.prometheus import PrometheusExporter
from geofed_hpc.metrics.recorder import Recorder
from geofed_hpc.paradigms import exchange_for
from geofed_hpc.ps.remote import local_state
from geofed_hpc.ps.servicer import ParameterServerLogic
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.server import start_server

if TYPE_CHECKING:
    from geofed_hpc.ps.group.member import PeerGroup
    from geofed_hpc.ps.split.service import SplitService

TICK = timedelta(milliseconds=500)
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # glibc malloc.h


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas (as MALLOC_ARENA_MAX does): a PS has a thread per site stream, and each arena
    would keep the chunk buffers its threads once freed, so memory would grow with the number of sites."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        done = bool(libc is not None and libc.mallopt(_M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        done = False
    logger.debug("malloc arenas %s", f"capped at {arenas}" if done else "left as they are (not glibc)")
    return done


def run_settings(cfg: RunConfig) -> m.RunSettings:
    """What the PS imposes on every site that joins."""
    return m.RunSettings(
        codec=cfg.codec.name,
        sync_interval_s=cfg.train.sync_interval.total_seconds(),
        max_local_steps=cfg.train.max_local_steps,
        paradigm=cfg.paradigm.describe(),
        aggregation=cfg.ps.aggregation,
        block_size=cfg.codec.block_size,
        paradigm_seed=cfg.paradigm.seed,
    )


def attach_split_part(cfg: RunConfig, logic: ParameterServerLogic) -> SplitService | None:
    """fsl_sage / split: start the server part beside the PS and route the split RPCs to it (None: another
    paradigm; torch is loaded only here)."""
    if cfg.paradigm.name not in SPLIT_PARADIGMS:
        return None
    from geofed_hpc.ps.split.service import SplitService

    logic.split_part = SplitService(cfg, logic.core.session_site, logic.core.global_tensors)
    return logic.split_part


class ParameterServer:
    """Start with the constructor, stop with `stop()`; `port` is the bound port (ps.port=0 picks one). Owns the
    gRPC server, the round ticker thread and the metrics outputs; `logic` (ParameterServerLogic) holds the state.
    Lock: none; `stop` acts once, and the ticker only calls `logic.tick` and reads the metrics."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        limit_malloc_arenas()
        exchange = exchange_for(cfg.paradigm, cfg.train.max_local_steps)
        self.logic = ParameterServerLogic(cfg.ps, run_settings(cfg), exchange=exchange, codec=cfg.codec)
        try:
            self.split = attach_split_part(cfg, self.logic)
        except BaseException:
            self.logic.staging.close()
            raise
        self.group: PeerGroup | None = None
        self.exporter: PrometheusExporter | None = None
        self.recorder: Recorder | None = None
        self._logged: tuple[int, float] | None = None
        try:
            if cfg.ps.grouped:  # meets its peers first: a peer that differs or never comes stops this PS here
                from geofed_hpc.ps.group.member import PeerGroup  # torch.distributed, only for a PS in a group
                from geofed_hpc.ps.group.rendezvous import identity
                from geofed_hpc.ps.grouped import GroupedCoordinator

                assert isinstance(self.logic.core, GroupedCoordinator)  # servicer.py picks it for ps.peers
                self.group = PeerGroup(self.logic.core, cfg.ps, identity(cfg), cfg.codec)
            if cfg.ps.metrics_port > 0:
                self.exporter = PrometheusExporter()
                self.exporter.serve(cfg.ps.metrics_host or cfg.ps.host, cfg.ps.metrics_port)
                self.logic.core.observer.on_site_metrics = self.exporter.observe
            self.recorder = self._recorder()
            self._served = start_server(
                self.logic, self.logic.gate, cfg.ps, self.exporter.rpc if self.exporter else None
            )
        except BaseException:
            self._close_metrics()
            self.logic.staging.close()
            raise
        self.port = self._served.port
        self._record()
        self._stop = threading.Event()
        self._stopped = False
        self._ticker = threading.Thread(target=self._tick_loop, name="ps-ticker", daemon=True)
        self._ticker.start()
        if self.group is not None:
            self.group.start()

    @property
    def address(self) -> str:
        host = self.cfg.ps.host if self.cfg.ps.host not in ("0.0.0.0", "::", "[::]") else "127.0.0.1"
        return f"{host}:{self.port}"

    @property
    def metrics_port(self) -> int:
        """The bound Prometheus port (0: no endpoint)."""
        return self.exporter.port if self.exporter else 0

    def _recorder(self) -> Recorder | None:
        """One W&B run (job_type=ps) and a JSONL file in <state_dir or run_dir>/metrics; only for a PS that
        persists or exports metrics (an in-memory PS in a test writes nothing)."""
        ps = self.cfg.ps
        if not ps.state_dir and ps.metrics_port <= 0:
            return None
        root = local_state(ps) or Path(self.cfg.run_dir)
        return Recorder(
            root / "metrics",
            "ps",
            job_type="ps",
            group=self.cfg.federation,
            wandb_mode=self.cfg.wandb_mode,
            config=shareable(self.cfg),
        )

    def _record(self, force: bool = False) -> None:
        """Log the ps/* values when the version or the global validation loss changed (and feed Prometheus)."""
        values = self.logic.ps_metrics()
        if self.split is not None:
            values.update(self.split.metrics())
        if self.exporter is not None:
            self.exporter.observe("ps", values)
        key = (int(values["ps/version"]), float(values.get("ps/global_val_loss", -1.0)))
        if self.recorder is None or (key == self._logged and not force):
            return
        self._logged = key
        self.recorder.log(values)

    def _close_metrics(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
        if self.exporter is not None:
            self.exporter.stop()

    def _tick_loop(self) -> None:
        while not self._stop.wait(TICK.total_seconds()):
            try:
                self.logic.tick()
            except Exception:  # noqa: BLE001 - a failed round is discarded, never fatal to the server
                logger.exception("round ticker failed; the next tick retries")
            try:
                if self.split is not None:
                    self.split.tick(self.logic.version)
            except Exception:  # noqa: BLE001 - a failed snapshot is retried at the next version
                logger.exception("snapshot of the server part failed; the next version retries")
            try:
                self._record()
            except Exception:  # noqa: BLE001 - metrics never stop the server
                logger.exception("recording PS metrics failed; the next tick retries")

    def stop(self, grace: timedelta | None = None) -> None:
        """Refuse new RPCs, finish pushes in flight, apply the open round, write a final snapshot."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.cfg.ps.shutdown_grace if grace is None else grace
        logger.info("parameter server stopping: finishing pushes in flight (up to %gs)", grace.total_seconds())
        self.logic.begin_shutdown()
        self._served.drain(grace)
        self._stop.set()
        self._ticker.join(timeout=5)
        if self.group is not None:
            self.group.stop()
        self.logic.finish()
        if self.split is not None:
            self.split.close()
        try:
            self._record()
        finally:
            self._close_metrics()
        logger.info(
            "parameter server stopped at version %d (snapshot version %d)",
            self.logic.version,
            self.logic.snapshot_version,
        )

    def wait_for_signal(self, every_second: Callable[[], None] | None = None) -> None:
        """Block until SIGINT or SIGTERM (calling `every_second` meanwhile: progress output), then stop
        gracefully (a final snapshot is written)."""
        done = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
        while not done.wait(1.0):
            if every_second is not None:
                every_second()
            if self.group is not None and self.group.failed is not None:
                break
        failed = self.group.failed if self.group is not None else None
        logger.info("PS group failed: stopping" if failed else "signal received")
        self.stop()
        if failed is not None:
            raise failed
