"""`geofed-hpc relay --spool SPOOL --to PS`: the sites' request files to the PS over gRPC (TLS), answers back."""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import grpc

from geofed_hpc.config import PSConfig
from geofed_hpc.egress import spoolfile
from geofed_hpc.egress.spool import HEALTH
from geofed_hpc.egress.spoolfile import ANSWER, REQUEST, Spool, SpoolCorrupt, SpoolFile
from geofed_hpc.errors import ConfigError
from geofed_hpc.log import escape, logger
from geofed_hpc.paths import os_reason
from geofed_hpc.rpc import serde
from geofed_hpc.rpc.channel import channel_credentials, client_options
from geofed_hpc.rpc.guard import METADATA_KEY, RETRY_PUSHBACK_KEY
from geofed_hpc.rpc.tls import diagnose

METHODS = {meth.name: meth for meth in serde.METHODS}
SWEEP_EVERY = timedelta(minutes=1)
STALE = timedelta(hours=1)  # temp files and answers nobody fetched are removed after this long
MIN_CALL = timedelta(seconds=1)  # a request whose deadline is nearer still gets this long at the PS


@dataclass
class SpoolRelay:
    """Serve `spool` for the PS at `target` (host:port), dialled with `ps` (its CA, ps.tls_name, client certificate),
    looking for requests every `poll`, at most `workers` calls at once. `once`: exit when nothing came for `linger`
    (default: ten looks, at least a second).

    One relay serves a spool at a time (a lock file). It takes a request by renaming it into SPOOL/relay, sends it,
    writes the answer into SPOOL/in atomically, then removes the request. Killed at any moment it loses nothing: what
    it had taken is sent again when it starts (the PS applies a push id once), and a site that got no answer asks
    again. A file that fails its check is set aside in SPOOL/quarantine with one line, never sent."""

    spool: Spool
    target: str
    ps: PSConfig
    poll: timedelta = timedelta(milliseconds=200)
    workers: int = 32
    once: bool = False
    linger: timedelta | None = None
    served: int = 0
    _lock: IO[str] | None = field(default=None, repr=False)
    _channel: Any = field(default=None, repr=False)
    _calls: dict[str, Any] = field(default_factory=dict, repr=False)
    _active: dict[str, Any] = field(default_factory=dict, repr=False)  # request id -> its call in flight
    _told: str = field(default="", repr=False)
    _stopping: threading.Event = field(default_factory=threading.Event, repr=False)

    def start(self) -> bool:
        """Check the spool, take its lock, put back what a relay killed earlier had taken; False when another relay
        holds the lock."""
        self.spool.prepare("--spool")
        self.spool.writable("--spool")
        fd = os.open(self.spool.root / "relay.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        lock = os.fdopen(fd, "r+")  # held for the relay's life
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.seek(0)
            holder = escape(lock.read().strip(), 32)
            lock.close()
            logger.warning("relay: another relay (%s) serves %s already", holder or "pid unknown", self.spool.root)
            return False
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        lock.flush()
        self._lock = lock
        for path in spoolfile.pending(self.spool.taken, REQUEST):  # taken by a relay that died: send them again
            os.replace(path, self.spool.out / path.name)
            logger.info("relay: %s was taken by a relay that stopped; sending it again", path.name)
        options = client_options(self.ps)
        if self.ps.insecure:
            self._channel = grpc.insecure_channel(self.target, options=options)
        else:
            self._channel = grpc.secure_channel(self.target, channel_credentials(self.ps), options=options)
        self._calls = {name: self._callable(meth) for name, meth in METHODS.items()}
        return True

    def _callable(self, meth: serde.Method) -> Any:
        channel = self._channel  # no serializers: the frames are already the wire bytes
        if meth.client_streaming and meth.server_streaming:
            return channel.stream_stream(meth.path)
        if meth.client_streaming:
            return channel.stream_unary(meth.path)
        if meth.server_streaming:
            return channel.unary_stream(meth.path)
        return channel.unary_unary(meth.path)

    def serve(self, stop: threading.Event) -> None:
        """Until `stop` (or, with `once`, until nothing came for `linger`): take requests, send them, answer."""
        busy: dict[str, Future[None]] = {}
        last_work, last_sweep = time.monotonic(), 0.0
        with ThreadPoolExecutor(self.workers, thread_name_prefix="spool") as pool:
            while not stop.is_set():
                for ident in [i for i, f in busy.items() if f.done()]:
                    del busy[ident]
                for path in spoolfile.pending(self.spool.out, REQUEST)[: self.workers - len(busy)]:
                    taken = self.spool.taken / path.name
                    try:
                        os.replace(path, taken)
                    except FileNotFoundError:  # the site gave up on it a moment ago
                        continue
                    except OSError as exc:
                        self._say(f"relay: cannot take requests from {self.spool.out}: {os_reason(exc)}")
                        break
                    busy[path.name] = pool.submit(self._handle, taken)
                if busy:
                    last_work = time.monotonic()
                if time.monotonic() - last_sweep > SWEEP_EVERY.total_seconds():
                    self._sweep()
                    last_sweep = time.monotonic()
                if self.once and not busy and time.monotonic() - last_work >= self.lingers().total_seconds():
                    break
                stop.wait(self.poll.total_seconds())
            self._stopping.set()
            for call in list(self._active.values()):  # stopped: what is in flight is sent again by the next relay
                call.cancel()

    def lingers(self) -> timedelta:
        return self.linger if self.linger is not None else max(timedelta(seconds=1), self.poll * 10)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._lock is not None:
            self._lock.close()

    def _handle(self, path: Path) -> None:
        ident = spoolfile.file_id(path, REQUEST) or "?"
        try:
            self._serve_one(path, ident)
        except Exception as exc:  # noqa: BLE001 (a request that breaks the relay is set aside, not retried forever)
            why = SpoolCorrupt(f"{path.name}: not a request this relay can send ({type(exc).__name__}: {escape(exc)})")
            self._quarantine(path, ident, why)

    def _serve_one(self, path: Path, ident: str) -> None:
        started = time.monotonic()
        try:
            opened = SpoolFile(path, self.ps.max_request_bytes)
        except (SpoolCorrupt, OSError) as exc:
            self._quarantine(path, ident, exc)
            return
        with opened:
            envelope = opened.envelope
            method = envelope.get("method")
            deadline = envelope.get("deadline")
            if (method not in METHODS and method != HEALTH) or envelope.get("id") != ident:
                opened.close()
                self._quarantine(path, ident, SpoolCorrupt(f"{path.name}: not a request this relay knows"))
                return
            if not isinstance(deadline, (int, float)) or deadline < time.time():
                logger.info("relay: %s %s expired before it could be sent (the site asks again)", method, ident)
                spoolfile.unlink(path)
                return
            left = max(deadline - time.time(), MIN_CALL.total_seconds())
            code = self._answer(ident, str(method), envelope, opened, left)
        if code is None:
            logger.info("relay: %s %s cut as the relay stops: the next relay sends it again", method, ident)
            return
        self.served += 1
        spoolfile.unlink(path)
        logger.info(
            "relay: %s %s -> %s %s in %.2fs, %d bytes up",
            method, ident, self.target, code, time.monotonic() - started, opened.size,
        )  # fmt: skip

    def _answer(
        self, ident: str, method: str, envelope: dict[str, Any], opened: SpoolFile, timeout: float
    ) -> str | None:
        """Call the PS with the request's frames and write its answer (a stream's frames go into the file as they
        come); the status name, with a note when the answer could not be written. None: cut as the relay stops."""
        metadata = tuple(
            (METADATA_KEY, str(v)[:1024])
            for k, v in (envelope.get("metadata") or [])[:1]
            if k == METADATA_KEY and isinstance(v, str)
        )
        target = self.spool.inbox / f"{ident}{ANSWER}"
        head: dict[str, Any] = {"id": ident, "code": "OK"}
        try:
            try:
                frames: Any = []
                if method == HEALTH:
                    head["status"] = serde.health_check(self._channel)(str(envelope.get("service", ""))[:128], timeout)
                else:
                    meth, call = METHODS[method], self._calls[method]
                    request = opened.frames() if meth.client_streaming else next(opened.frames(), b"")
                    if meth.server_streaming:
                        frames = self._active[ident] = call(request, timeout=timeout, metadata=metadata)
                    else:
                        future = self._active[ident] = call.future(request, timeout=timeout, metadata=metadata)
                        frames = [future.result()]
                spoolfile.write(target, head, frames)
            except grpc.RpcError as exc:
                code = exc.code() or grpc.StatusCode.UNKNOWN
                if self._stopping.is_set() and code == grpc.StatusCode.CANCELLED:
                    return None
                details = exc.details() or ""
                if code == grpc.StatusCode.UNAVAILABLE:
                    details = self._unreachable(details)
                trailers = [[k, str(v)] for k, v in (exc.trailing_metadata() or ()) if k == RETRY_PUSHBACK_KEY]
                head.update(code=code.name, details=details[:2000], trailers=trailers)
                spoolfile.write(target, head, [])
        except OSError as exc:  # the PS did it or not; the site asks again, and a push id is applied once
            self._say(f"relay: cannot write answers into {self.spool.inbox}: {os_reason(exc)}")
            return f"{head['code']} (answer not written: the site asks again)"
        finally:
            self._active.pop(ident, None)
        self._told = ""
        return str(head["code"])

    def _unreachable(self, details: str) -> str:
        why = diagnose(self.target, self.ps, timedelta(seconds=3))
        line = f"the relay cannot reach the parameter server at {self.target}: {why or details}"
        self._say(f"relay: {line}")
        return line

    def _quarantine(self, path: Path, ident: str, why: Exception) -> None:
        """Set a file that failed its check aside, say so in one line, and tell the site (it asks again)."""
        try:
            kept = self.spool.set_aside(path)
            logger.warning("relay: %s: set aside as %s, not sent", why, kept)
        except OSError as exc:
            logger.warning("relay: %s; and it cannot be set aside (%s): removed", why, os_reason(exc))
            spoolfile.unlink(path)
        if ident != "?":
            head = {"id": ident, "code": "UNAVAILABLE", "details": f"the relay set the request aside: {why}"}
            try:
                spoolfile.write(self.spool.inbox / f"{ident}{ANSWER}", head, [])
            except OSError as exc:
                self._say(f"relay: cannot write answers into {self.spool.inbox}: {os_reason(exc)}")

    def _say(self, line: str) -> None:
        """Log a problem once, not once per request while it lasts."""
        if line != self._told:
            logger.error("%s", line)
            self._told = line

    def _sweep(self) -> None:
        """Remove temp files and answers older than STALE (writers that died, sites that went away)."""
        cutoff = time.time() - STALE.total_seconds()
        for folder in (self.spool.out, self.spool.inbox):
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for entry in entries:
                stale = entry.name.startswith(".") or entry.name.endswith(ANSWER)
                try:
                    if stale and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                        os.unlink(entry.path)
                except OSError:
                    continue


def run_spool_relay(relay: SpoolRelay) -> int:
    """Serve until SIGINT or SIGTERM (or, with --once, until the spool is drained); 0 also when another relay
    already serves the spool (a cron entry that finds one running has nothing to do)."""
    if not relay.start():
        if relay.once:
            return 0
        raise ConfigError(f"--spool: another relay serves {relay.spool.root} already (its pid: relay.lock there)")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    hop = "plaintext" if relay.ps.insecure else "TLS"
    mode = f"until nothing comes for {relay.lingers().total_seconds():g}s" if relay.once else "Ctrl-C stops"
    print(
        f"relay on spool {relay.spool.root} -> parameter server {relay.target} ({hop} to the PS; looking every "
        f"{relay.poll.total_seconds():g}s; at most {relay.workers} calls at once); {mode}",
        flush=True,
    )
    try:
        relay.serve(stop)
    finally:
        relay.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    logger.info("relay stopped after %d requests", relay.served)
    return 0
