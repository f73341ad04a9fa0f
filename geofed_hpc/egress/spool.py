"""The spool path (site.egress: spool): a site's calls to its PS as files in SPOOL/out, answers from SPOOL/in."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc

from geofed_hpc.config import PSConfig, RunConfig
from geofed_hpc.egress import spoolfile
from geofed_hpc.egress.paths import Route, register_path
from geofed_hpc.egress.spoolfile import ANSWER, REQUEST, Spool, SpoolCorrupt, SpoolFile
from geofed_hpc.errors import UnavailableError
from geofed_hpc.log import escape, logger
from geofed_hpc.paths import os_reason
from geofed_hpc.rpc import serde
from geofed_hpc.rpc.client import PSClient
from geofed_hpc.rpc.guard import METADATA_KEY, RETRY_PUSHBACK_KEY

HEALTH = "Health"  # not a geofed.v1 method: the relay answers it with grpc.health.v1 at the PS
FIRST_POLL = timedelta(milliseconds=5)  # the first look for an answer; then twice as long each time, to site.spool_poll
CONNECT_TRY = timedelta(seconds=5)  # connect: how long one Health call waits for its answer before asking again
ABANDONED_KEEP = timedelta(hours=1)  # answers to calls given up on are removed when they come, for this long


class SpoolRpcError(grpc.RpcError):
    """How a call through the spool failed, shaped like gRPC's own error (PSClient's retries read it alike)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(details)
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailers


def status_code(name: object) -> grpc.StatusCode:
    """The gRPC status named `name` (from a file: anything unknown is UNKNOWN)."""
    for code in grpc.StatusCode:
        if code.name == name:
            return code
    return grpc.StatusCode.UNKNOWN


class SpoolClient(PSClient):
    """PSClient's calls through the files of `spool`, answers looked for after FIRST_POLL, doubling to `poll`.

    For clusters where nothing may listen on a port: each call is serialized (rpc/serde) into a request file and
    answered by `geofed-hpc relay --spool SPOOL` on a node that sees the same folder and reaches the PS. Everything
    above the calls (retries, deferred pushes, push ids applied once) is PSClient's, unchanged."""

    def __init__(self, cfg: PSConfig, spool: Path | str, poll: timedelta = timedelta(seconds=1)) -> None:
        self.spool = Spool(Path(spool).expanduser().absolute()).prepare("site.spool")
        self.poll = poll
        self._abandoned: dict[str, float] = {}  # answers still to come for calls given up on: id -> when
        super().__init__(cfg, "spool:" + str(self.spool.root).replace(",", "%2C"))

    def _dial(self, index: int) -> None:
        self._index, self.address = index, self.addresses[index]
        self._calls = {meth.name: _SpoolCall(self, meth) for meth in serde.METHODS}

    def close(self) -> None:
        self._tidy()

    def failover(self) -> bool:
        return False

    def _diagnosis(self, timeout: timedelta = timedelta(0)) -> str:
        return ""

    def _connect(self, timeout: timedelta) -> None:
        """Wait until the PS answers a Health call through the relay, within `timeout` (each try waits at most
        CONNECT_TRY for its answer, then asks again: a relay that lost an answer, or comes by cron, is waited out)."""
        deadline = time.monotonic() + timeout.total_seconds()
        why = f"no answer through the spool {self.spool.root} within {timeout.total_seconds():g}s"
        while (left := deadline - time.monotonic()) > 0:
            asked = time.monotonic()
            try:
                self.exchange(HEALTH, [], timedelta(seconds=min(left, CONNECT_TRY.total_seconds())), {"service": ""})
                return
            except SpoolRpcError as exc:
                why = exc.details()
                logger.info("%s; asking again", why)
            time.sleep(max(0.0, min(1.0 - (time.monotonic() - asked), deadline - time.monotonic())))
        raise UnavailableError(why)

    def health(self, service: str = serde.SERVICE) -> str:
        def check() -> str:
            envelope, _ = self.exchange(HEALTH, [], timedelta(seconds=self._quick()), {"service": service})
            return str(envelope.get("status", ""))[:32]

        return self._call("Health", check, timedelta(seconds=4))

    def exchange(
        self, method: str, frames: Any, timeout: timedelta, extra: dict[str, Any] | None = None, metadata: Any = ()
    ) -> tuple[dict[str, Any], Iterator[bytes]]:
        """Write one request, wait for its answer within `timeout`: (the answer's envelope, its frames, read as they
        are iterated; the answer file goes once they all were). SpoolRpcError for a call that failed or timed out."""
        self._tidy()
        ident = spoolfile.new_id()
        request = self.spool.out / f"{ident}{REQUEST}"
        envelope = {
            "id": ident,
            "method": method,
            "deadline": time.time() + timeout.total_seconds(),
            "metadata": [[k, v] for k, v in metadata if k == METADATA_KEY],
            **(extra or {}),
        }
        try:
            spoolfile.write(request, envelope, frames)
        except OSError as exc:
            raise SpoolRpcError(
                grpc.StatusCode.UNAVAILABLE, f"cannot write a request into {self.spool.out}: {os_reason(exc)}"
            ) from None
        answer = self._answer_file(ident, request, timeout)
        try:
            opened = SpoolFile(answer, self.cfg.max_message_bytes)
        except (SpoolCorrupt, OSError) as exc:
            self._quarantine(answer, exc)
            raise SpoolRpcError(grpc.StatusCode.UNAVAILABLE, f"the answer to {method} was unreadable: {exc}") from None
        reply = opened.envelope
        code = status_code(reply.get("code"))
        if code != grpc.StatusCode.OK:
            opened.close()
            spoolfile.unlink(answer)
            trailers = tuple((str(k), str(v)[:32]) for k, v in reply.get("trailers", [])[:4] if k == RETRY_PUSHBACK_KEY)
            raise SpoolRpcError(code, escape(reply.get("details", ""), 1000), trailers)
        if not opened.count:  # nothing to read on: the file goes now
            opened.close()
            spoolfile.unlink(answer)
            return reply, iter(())
        return reply, _consumed(opened, answer)

    def _answer_file(self, ident: str, request: Path, timeout: timedelta) -> Path:
        answer = self.spool.inbox / f"{ident}{ANSWER}"
        deadline = time.monotonic() + timeout.total_seconds()
        wait = FIRST_POLL.total_seconds()
        while not answer.exists():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(wait, left))
            wait = min(wait * 2, self.poll.total_seconds())
        else:
            return answer
        if spoolfile.unlink(request):  # never taken: gone now, so it can never be sent later
            raise SpoolRpcError(
                grpc.StatusCode.UNAVAILABLE,
                f"no relay took the request from {self.spool.out} within {timeout.total_seconds():g}s: is "
                f"`geofed-hpc relay --spool {self.spool.root} --to PS_HOST:PORT` running on a node that sees this "
                "folder and reaches the PS (a login-node tmux, scrontab or cron)?",
            )
        self._abandoned[ident] = time.monotonic()
        raise SpoolRpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the relay took the request from {self.spool.out} but no answer came within {timeout.total_seconds():g}s",
        )

    def _tidy(self) -> None:
        """Remove answers that came for calls given up on; forget those given up on long ago."""
        now = time.monotonic()
        for ident, since in list(self._abandoned.items()):
            gone = spoolfile.unlink(self.spool.inbox / f"{ident}{ANSWER}")
            if gone or now - since > ABANDONED_KEEP.total_seconds():
                del self._abandoned[ident]

    def _quarantine(self, path: Path, why: Exception) -> None:
        try:
            kept = self.spool.set_aside(path)
            logger.warning("spool: %s: set aside as %s, not used", why, kept)
        except OSError as exc:
            logger.warning("spool: %s; and it cannot be set aside: %s", why, os_reason(exc))
            spoolfile.unlink(path)


def _consumed(opened: SpoolFile, path: Path) -> Iterator[bytes]:
    try:
        yield from opened.frames()
    finally:
        opened.close()
        spoolfile.unlink(path)


class _SpoolCall:
    """One RPC through the spool, called as gRPC's multi-callables are: (request or requests, timeout, metadata)."""

    def __init__(self, client: SpoolClient, meth: serde.Method) -> None:
        self.client, self.meth = client, meth
        self.encode = serde.serializer(meth.request)
        self.decode = serde.deserializer(meth.reply)

    def __call__(self, request: Any, timeout: float | None = None, metadata: Any = ()) -> Any:
        client, meth = self.client, self.meth
        wait = timedelta(seconds=timeout) if timeout is not None else client.cfg.rpc_timeout
        requests = request if meth.client_streaming else [request]
        frames = (self.encode(r) for r in requests)
        _, answer = client.exchange(meth.name, frames, wait, metadata=metadata)
        if meth.server_streaming:
            return (self.decode(frame) for frame in answer)
        replies = [self.decode(frame) for frame in answer]
        if len(replies) != 1:
            raise SpoolRpcError(grpc.StatusCode.INTERNAL, f"{meth.name}: {len(replies)} replies in the answer file")
        return replies[0]


def open_spool(cfg: RunConfig, address: str, timeout: timedelta) -> Route:
    """The spool path (site.spool), checked: its folders exist and no other user may write them."""
    if not cfg.site.spool:
        raise UnavailableError("site.spool is empty: give a folder the compute nodes and the relay's node both see")
    folder = Path(cfg.site.spool).expanduser().absolute()
    spool = Spool(folder).prepare("site.spool")
    spool.writable("site.spool")
    poll = cfg.site.spool_poll

    def client(route: Route) -> SpoolClient:
        return SpoolClient(route.ps, folder, poll)

    return Route("spool", str(folder), cfg.ps, detail=f"SPOOL={folder} -> {address}", client=client)


register_path("spool", open_spool)
