"""A running parameter server: the logic behind a real gRPC port, with a round ticker."""

from __future__ import annotations

import signal
import threading
from datetime import timedelta

from geofed_hpc.config import RunConfig
from geofed_hpc.log import logger
from geofed_hpc.ps.servicer import ParameterServerLogic
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.server import start_server

TICK = timedelta(milliseconds=500)


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
    """Start with `start()`, stop with `stop()`; `port` is the bound port (ps.port=0 picks one)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.logic = ParameterServerLogic(cfg.ps, run_settings(cfg))
        self._server, self.port = start_server(self.logic, cfg.ps)
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="ps-ticker", daemon=True)
        self._ticker.start()

    @property
    def address(self) -> str:
        host = self.cfg.ps.host if self.cfg.ps.host not in ("0.0.0.0", "::", "[::]") else "127.0.0.1"
        return f"{host}:{self.port}"

    def _tick_loop(self) -> None:
        while not self._stop.wait(TICK.total_seconds()):
            self.logic.tick()

    def stop(self, grace: timedelta = timedelta(seconds=2)) -> None:
        self._stop.set()
        self._server.stop(grace.total_seconds()).wait()
        logger.info("parameter server stopped at version %d", self.logic.version)

    def wait_for_signal(self) -> None:
        """Block until SIGINT or SIGTERM, then stop cleanly."""
        done = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
        while not done.wait(1.0):
            pass
        self.stop()
