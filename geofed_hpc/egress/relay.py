"""`geofed-hpc relay`: a byte forwarder to one parameter server, for sites whose compute nodes reach only a node that
has both networks (a login node, a data-transfer node, a service VM).

It carries TCP bytes and nothing else: TLS stays end to end between site and PS (the relay holds no key and sees only
ciphertext), and every connection goes to the one PS it was started for, so it is never an open proxy. Connections
are bounded in number and closed when idle; each is logged in one line when it ends. Stopping or restarting it at any
moment loses no push: a site's push that was cut is retried, and the PS applies a push id once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from geofed_hpc.log import logger

CHUNK = 256 * 1024
DEFAULT_PORT = 50051


@dataclass
class Relay:
    """Forward connections accepted on `listen` (host, port) to `target` (host, port). At most `max_connections`
    at once (more are closed at once, logged); a connection with no byte either way for `idle` is closed."""

    target: tuple[str, int]
    listen: tuple[str, int]
    max_connections: int = 256
    idle: timedelta = timedelta(minutes=10)
    connect_timeout: timedelta = timedelta(seconds=20)
    active: int = 0
    served: int = 0
    _server: asyncio.Server | None = field(default=None, repr=False)
    _open: set[asyncio.Task] = field(default_factory=set, repr=False)

    @property
    def to(self) -> str:
        return _hostport(*self.target)

    async def start(self) -> int:
        """Listen; return the port (the one chosen when `listen` asked for port 0)."""
        self._server = await asyncio.start_server(self._serve, self.listen[0], self.listen[1], reuse_address=True)
        return int(self._server.sockets[0].getsockname()[1])

    async def serve_forever(self, stop: asyncio.Event) -> None:
        assert self._server is not None, "start() first"
        async with self._server:
            await stop.wait()
            self._server.close()
            for task in list(self._open):  # each closes both its sockets and logs its line
                task.cancel()
            await asyncio.gather(*self._open, return_exceptions=True)
        logger.info("relay stopped after %d connections", self.served)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _peer(writer)
        if self.active >= self.max_connections:
            logger.warning("relay: %s refused: %d connections already (--max-connections)", peer, self.active)
            writer.close()
            return
        self.active += 1
        self.served += 1
        started, moved, why = time.monotonic(), [0, 0], "closed"
        task = asyncio.current_task()
        if task is not None:
            self._open.add(task)
        try:
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(*self.target), self.connect_timeout.total_seconds()
                )
            except (OSError, asyncio.TimeoutError) as exc:
                why = f"the parameter server {self.to} does not answer ({_reason(exc)})"
                return
            last = [time.monotonic()]
            pumps = [
                asyncio.create_task(self._pump(reader, up_writer, moved, 0, last)),
                asyncio.create_task(self._pump(up_reader, writer, moved, 1, last)),
            ]
            watch = asyncio.create_task(self._watch_idle(last))
            try:
                done, _ = await asyncio.wait([*pumps, watch], return_when=asyncio.FIRST_COMPLETED)
                why = "idle" if watch in done else "closed"
            except asyncio.CancelledError:
                why = "closed: the relay stopped"
            for part in [*pumps, watch]:
                part.cancel()
            await asyncio.gather(*pumps, watch, return_exceptions=True)
            _close(up_writer)
        finally:
            self._open.discard(task)  # type: ignore[arg-type]
            self.active -= 1
            _close(writer)
            logger.info(
                "relay: %s -> %s %s after %.1fs, %d bytes up, %d down",
                peer, self.to, why, time.monotonic() - started, moved[0], moved[1],
            )  # fmt: skip

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, moved: list[int], way: int, last: list[float]
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while chunk := await source.read(CHUNK):
                sink.write(chunk)
                await sink.drain()
                moved[way] += len(chunk)
                last[0] = time.monotonic()
            if sink.can_write_eof():
                sink.write_eof()  # half-close: the other way may still be sending
                await asyncio.sleep(0)
        if way == 0:  # the site closed its side: wait for the PS to finish its answer, then the pair ends
            await asyncio.sleep(self.idle.total_seconds())

    async def _watch_idle(self, last: list[float]) -> None:
        while (left := last[0] + self.idle.total_seconds() - time.monotonic()) > 0:
            await asyncio.sleep(left)


def run_relay(
    relay: Relay, announce: Callable[[int], str] | None = None, gone: Callable[[], None] = lambda: None
) -> int:
    """Serve until SIGINT or SIGTERM. `announce(port)` (once listening) says where, printed first; `gone` runs
    when it stops."""

    def where(port: int) -> str:
        return (
            f"relay on {_hostport(relay.listen[0], port)} -> parameter server {relay.to} (TLS end to end; at most "
            f"{relay.max_connections} connections, idle ones closed after {relay.idle.total_seconds():g}s); "
            "Ctrl-C stops"
        )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        port = await relay.start()
        print((announce or where)(port), flush=True)
        try:
            await relay.serve_forever(stop)
        finally:
            gone()

    asyncio.run(main())
    return 0


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _peer(writer: asyncio.StreamWriter) -> str:
    info = writer.get_extra_info("peername")
    return _hostport(str(info[0]), int(info[1])) if info else "?"


def _reason(exc: BaseException) -> str:
    return "timed out" if isinstance(exc, asyncio.TimeoutError) else getattr(exc, "strerror", None) or str(exc)


def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.close()


RELAY_FILE = "relay.json"  # <run_dir>/relay.json: where the relay job of site.relay=job listens


def relay_job(target: str, run_dir: str, max_connections: int = 256, idle_s: float = 600.0) -> int:
    """The relay as a Slurm job (site.relay=job): listen on every address of this node on a free port, write where
    into <run_dir>/relay.json (atomically; the sites read it), serve until the job is cancelled or ends."""
    import json
    import os
    import socket
    from pathlib import Path

    from geofed_hpc.ckpt.atomic import atomic_write_bytes
    from geofed_hpc.config.fields import split_host_port

    relay = Relay(split_host_port(target), ("0.0.0.0", 0), max_connections, timedelta(seconds=idle_s))
    path = Path(run_dir) / RELAY_FILE
    here = ""

    def announce(port: int) -> str:
        nonlocal here
        here = _hostport(socket.gethostname(), port)
        record = {"listen": here, "to": relay.to, "job": os.environ.get("SLURM_JOB_ID", "")}
        atomic_write_bytes(path, json.dumps(record).encode())
        return f"relay on {here} -> parameter server {relay.to} (written to {path})"

    def gone() -> None:  # the sites wait for the next relay, unless another one wrote the file since
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text()).get("listen") == here:
                path.unlink()

    return run_relay(relay, announce, gone)
