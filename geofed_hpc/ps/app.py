"""A running parameter server: the logic behind a real gRPC port, a round ticker, graceful shutdown."""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import threading
from datetime import timedelta

from geofed_hpc.config import RunConfig
from geofed_hpc.log import logger
from geofed_hpc.ps.servicer import ParameterServerLogic
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.server import start_server

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
        paradigm="pretrain",
        aggregation=cfg.ps.aggregation,
        block_size=cfg.codec.block_size,
    )


class ParameterServer:
    """Start with the constructor, stop with `stop()`; `port` is the bound port (ps.port=0 picks one)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        limit_malloc_arenas()
        self.logic = ParameterServerLogic(cfg.ps, run_settings(cfg))
        try:
            self._served = start_server(self.logic, cfg.ps)
        except BaseException:
            self.logic.staging.close()
            raise
        self.port = self._served.port
        self._stop = threading.Event()
        self._stopped = False
        self._ticker = threading.Thread(target=self._tick_loop, name="ps-ticker", daemon=True)
        self._ticker.start()

    @property
    def address(self) -> str:
        host = self.cfg.ps.host if self.cfg.ps.host not in ("0.0.0.0", "::", "[::]") else "127.0.0.1"
        return f"{host}:{self.port}"

    def _tick_loop(self) -> None:
        while not self._stop.wait(TICK.total_seconds()):
            try:
                self.logic.tick()
            except Exception:  # noqa: BLE001 - a failed round is discarded, never fatal to the server
                logger.exception("round ticker failed; the next tick retries")

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
        self.logic.finish()
        logger.info(
            "parameter server stopped at version %d (snapshot version %d)",
            self.logic.version,
            self.logic.snapshot_version,
        )

    def wait_for_signal(self) -> None:
        """Block until SIGINT or SIGTERM, then stop gracefully (a final snapshot is written)."""
        done = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
        while not done.wait(1.0):
            pass
        logger.info("signal received")
        self.stop()
