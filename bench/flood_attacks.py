"""The attacks of bench/flood.py, one per process: `python bench/flood_attacks.py SPEC` runs one until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import json
import math
import os
import signal
import ssl
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ps_scale import adam_like, model_shapes  # noqa: E402

from geofed_hpc import codec  # noqa: E402
from geofed_hpc.config import CodecConfig  # noqa: E402
from geofed_hpc.rpc import messages as m  # noqa: E402
from geofed_hpc.rpc import serde  # noqa: E402
from geofed_hpc.rpc.guard import bearer  # noqa: E402
from geofed_hpc.rpc.stream import digest  # noqa: E402

SERVICE = "/geofed.v1.ParameterServer"
CALL_TIMEOUT = timedelta(minutes=5)  # no attacker call outlives this (the PS ends the stalled ones far sooner)
CONNECT_TIMEOUT = timedelta(seconds=10)
RAMP_TIMEOUT = timedelta(seconds=30)  # "ready" is printed after this at the latest, whatever is in place
GARBAGE = ["", "junk", "gfs_0000000000000000_" + "A" * 32, "gft_0_x", "x" * 600]
RELAY_BYTES = 1 << 18
BURN_PERIOD = timedelta(milliseconds=10)
# gRPC's server refuses new streams (RST_STREAM REFUSED_STREAM) on a connection that holds about 28 stalled ones:
# the attacker spreads its calls over connections, as any client holding many streams would.
STREAMS_PER_CONNECTION = 16


class Attack:
    """What every attack shares: the spec, the stop event, the channels (through the relays), and the tally."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.stop = asyncio.Event()
        self.stats: Counter[str] = Counter()
        self.held = self.most_held = 0
        self.targets: list[tuple[str, int]] = []  # (host, port) to dial, one per source address
        self.channels: list[grpc.aio.Channel] = []
        self._ready: asyncio.Task[None] | None = None
        self.details: dict[str, str] = {}  # the first answer's details per status code
        self.lifetimes: list[float] = []  # seconds each connection the server closed had lived

    # ---------------------------------------------------------------- plumbing
    def running(self) -> bool:
        return not self.stop.is_set() and time.monotonic() < self.spec["until"]

    async def pause(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)

    async def relays(self) -> None:
        """A TCP relay per source address (the PS sees the attacker as that host); none for the PS's own host."""
        host, port = self.spec["host"], self.spec["port"]
        for source in self.spec["sources"]:
            if source == host:
                self.targets.append((host, port))
                continue
            server = await asyncio.start_server(functools.partial(relay, host=host, port=port, src=source), "127.0.0.1")
            self.targets.append(("127.0.0.1", server.sockets[0].getsockname()[1]))

    def open_channels(self, calls: int) -> None:
        """Enough channels (each its own connection, per source) for `calls` at once, STREAMS_PER_CONNECTION each."""
        creds = grpc.ssl_channel_credentials(Path(self.spec["ca_file"]).read_bytes())
        per_target = max(1, -(-calls // (STREAMS_PER_CONNECTION * len(self.targets))))
        for (host, port), i in itertools.product(self.targets, range(per_target)):
            options = [
                ("grpc.max_send_message_length", -1),
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.ssl_target_name_override", self.spec["host"]),
                ("bench.flood.channel", i),  # a connection of its own (gRPC shares one between equal channels)
            ]
            self.channels.append(grpc.aio.secure_channel(f"{host}:{port}", creds, options=options))

    def method(self, name: str, kind: str, i: int = 0, raw: bool = False, reply: type | None = None) -> Any:
        """A callable for geofed.v1 method `name` (kind: unary_unary, stream_unary, unary_stream) on channel i;
        `raw`: requests are bytes already serialised; replies are read only when their type is given."""
        channel = self.channels[i % len(self.channels)]
        request = (lambda b: b) if raw else serde.serializer(_REQUEST[name])
        answer = serde.deserializer(reply) if reply is not None else _ignore
        return getattr(channel, kind)(f"{SERVICE}/{name}", request_serializer=request, response_deserializer=answer)

    async def tally(self, call: Awaitable[Any] | Any) -> str:
        """Await a call (or read a response stream to its end) and count how it ended."""
        self.stats["opened"] += 1
        self.held += 1
        self.most_held = max(self.most_held, self.held)
        try:
            if hasattr(call, "__aiter__"):
                async for _ in call:
                    pass
            else:
                await call
            code = "OK"
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
            self.details.setdefault(code, str(exc.details())[:200])
        except (OSError, asyncio.TimeoutError):
            code = "connection_error"
        finally:
            self.held -= 1
        self.stats[code] += 1
        return code

    async def enroll(self, site: str) -> str:
        join = self.method("Join", "unary_unary", reply=m.JoinReply)
        reply = await join(m.JoinRequest(site, self.spec["token"]), timeout=30, metadata=bearer(self.spec["token"]))
        return str(reply.session_id)

    async def version(self, session: str) -> int:
        heartbeat = self.method("Heartbeat", "unary_unary", reply=m.HeartbeatReply)
        reply = await heartbeat(m.HeartbeatRequest(session), timeout=30, metadata=bearer(session))
        return int(reply.version)

    async def keep(self, n: int, one: Callable[[int], Awaitable[Any]]) -> list[asyncio.Task[Any]]:
        """n tasks, each calling one(i) again and again while the attack runs."""

        async def loop(i: int) -> None:
            while self.running():
                await one(i)

        return [asyncio.create_task(loop(i)) for i in range(n)]

    def ready_when(self, cond: Callable[[], bool]) -> None:
        """Print the ready line once `cond()` holds (or after RAMP_TIMEOUT), in the background."""

        async def wait() -> None:
            deadline = time.monotonic() + RAMP_TIMEOUT.total_seconds()
            while not cond() and time.monotonic() < deadline and self.running():
                await asyncio.sleep(0.05)
            print(json.dumps({"ready": dict(self.stats) | {"held": self.held}}), flush=True)

        self._ready = asyncio.create_task(wait())

    async def idle(self) -> AsyncIterator[Any]:
        """A request stream that sends nothing until the attack stops."""
        await self.stop.wait()
        return
        yield  # an async generator


async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, port: int, src: str) -> None:
    """Carry one connection to host:port from address `src`."""
    try:
        up_r, up_w = await asyncio.open_connection(host, port, local_addr=(src, 0))
    except OSError:
        writer.close()
        return

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(RELAY_BYTES):
                w.write(data)
                await w.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))


def _ignore(_: bytes) -> None:
    """Replies are counted, never read."""


_REQUEST = {
    "Join": m.JoinRequest,
    "Heartbeat": m.HeartbeatRequest,
    "StreamModel": m.ModelRequest,
    "PushDelta": m.Chunk,
    "Status": m.StatusRequest,
}


# ------------------------------------------------------------------------------------------------ the attacks
async def idle_connections(a: Attack) -> None:
    """spec["connections"] TCP connections that finish the TLS handshake (ALPN h2, the CA verified) and then send
    nothing, held while the attack runs; one the server closes is opened again."""
    ctx = ssl.create_default_context(cafile=a.spec["ca_file"])
    ctx.set_alpn_protocols(["h2"])
    sources = itertools.cycle(a.spec["sources"])
    opening = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        source = next(sources)
        async with opening:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(
                        a.spec["host"], a.spec["port"], ssl=ctx, local_addr=(source, 0), server_hostname=a.spec["host"]
                    ),
                    CONNECT_TIMEOUT.total_seconds(),
                )
            except (OSError, asyncio.TimeoutError, TimeoutError, ssl.SSLError):
                a.stats["connection_error"] += 1
                await a.pause(0.5)
                return
        opened = time.monotonic()
        alpn = writer.get_extra_info("ssl_object").selected_alpn_protocol()
        a.stats[f"alpn_{alpn}"] += 1
        a.stats["opened"] += 1
        a.held += 1
        a.most_held = max(a.most_held, a.held)
        try:
            while a.running():  # read what the server sends (its SETTINGS, pings, a GOAWAY) until it closes
                data = await _read_or_stop(a, reader)
                if not data:
                    break
                a.stats["bytes_from_server"] += len(data)
            if a.running():
                a.stats["closed_by_server"] += 1
                a.lifetimes.append(time.monotonic() - opened)
        finally:
            a.held -= 1
            writer.close()

    tasks = await a.keep(a.spec["connections"], one)
    a.ready_when(lambda: a.held >= a.spec["connections"])
    await asyncio.gather(*tasks)


async def _read_or_stop(a: Attack, reader: asyncio.StreamReader) -> bytes:
    read, stop = asyncio.create_task(reader.read(65536)), asyncio.create_task(a.stop.wait())
    done, pending = await asyncio.wait({read, stop}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    if read in done:
        try:
            return read.result()
        except OSError:
            return b""
    return b"." if not a.stop.is_set() else b""


async def stalled_pushes(a: Attack) -> None:
    """spec["sessions"] sessions (evil-0, evil-1, ...), each with max_uploads_per_session PushDelta streams that send
    a valid header for a spec["stall_bytes"] payload and the first 64 KiB of a real int8 delta, then nothing; each
    is opened again as soon as the PS ends it."""
    per = a.spec["uploads_per_session"]
    a.open_channels(a.spec["sessions"] * per)
    sessions = [await a.enroll(f"evil-{i}") for i in range(a.spec["sessions"])]
    version = [await a.version(sessions[0])]
    shapes = model_shapes(a.spec["params"])
    start = codec.encode(adam_like(shapes, seed=666), CodecConfig(name="int8"))[: 64 << 10]

    async def refresh() -> None:  # a header names the current version, or the PS refuses it as stale at once
        while a.running():
            with contextlib.suppress(grpc.aio.AioRpcError):
                version[0] = await a.version(sessions[0])
            await a.pause(0.5)

    async def stalled(session: str) -> AsyncIterator[m.Chunk]:
        header = m.PushHeader(
            session, version[0], 1, 1, "int8", a.spec["stall_bytes"], os.urandom(32), uuid.uuid4().hex
        )
        yield m.Chunk(data=start, push=header)
        await a.stop.wait()

    async def one(i: int) -> None:
        session = sessions[i // per]
        push = a.method("PushDelta", "stream_unary", i)
        code = await a.tally(push(stalled(session), timeout=CALL_TIMEOUT.total_seconds(), metadata=bearer(session)))
        if code in ("RESOURCE_EXHAUSTED", "UNAVAILABLE"):  # at a limit, or a stream refused: knock again soon
            await a.pause(0.05)

    tasks = [asyncio.create_task(refresh())]
    tasks += await a.keep(len(sessions) * per, one)
    a.ready_when(lambda: a.stats["opened"] >= len(sessions) * per)
    await asyncio.gather(*tasks)


async def unauthenticated_streams(a: Attack) -> None:
    """spec["streams"] calls kept in flight, none with a valid credential: PushDelta streams that send nothing and
    StreamModel calls, each opened again as soon as it ends."""
    a.open_channels(a.spec["streams"])
    push_calls = [a.method("PushDelta", "stream_unary", i) for i in range(len(a.channels))]
    pull_calls = [a.method("StreamModel", "unary_stream", i) for i in range(len(a.channels))]

    async def one(i: int) -> None:
        credential = GARBAGE[i % len(GARBAGE)]
        metadata = (("authorization", credential),) if len(credential) > 512 else bearer(credential)
        timeout = CALL_TIMEOUT.total_seconds()
        if i % 2:
            call = push_calls[i % len(push_calls)](a.idle(), timeout=timeout, metadata=metadata)
        else:
            request = m.ModelRequest(credential or "gfs_x", 1 << 40, 3600.0)
            call = pull_calls[i % len(pull_calls)](request, timeout=timeout, metadata=metadata)
        await a.tally(call)

    tasks = await a.keep(a.spec["streams"], one)
    a.ready_when(lambda: a.stats["opened"] >= a.spec["streams"])
    await asyncio.gather(*tasks)


async def long_polls(a: Attack) -> None:
    """One session keeps spec["polls"] StreamModel long-polls in flight (a version far ahead, a long wait), each
    opened again as soon as it is refused or ends."""
    a.open_channels(a.spec["polls"])
    session = await a.enroll("evil-0")
    pulls = [a.method("StreamModel", "unary_stream", i) for i in range(len(a.channels))]
    request = m.ModelRequest(session, 1 << 40, 3600.0)

    async def one(i: int) -> None:
        call = pulls[i % len(pulls)](request, timeout=CALL_TIMEOUT.total_seconds(), metadata=bearer(session))
        await a.tally(call)

    tasks = await a.keep(a.spec["polls"], one)
    a.ready_when(lambda: a.stats["opened"] >= a.spec["polls"])
    await asyncio.gather(*tasks)


async def oversized_fields(a: Attack) -> None:
    """spec["in_flight"] calls at once, again and again: Joins with a 16 MiB site name or a 16 MiB paradigm, and
    pushes whose push id is 4 MiB (each message serialised once, sent as bytes)."""
    a.open_channels(a.spec["in_flight"])
    token, session = a.spec["token"], await a.enroll("evil-0")
    big = 16 << 20
    payload = np.zeros(16, np.float32).tobytes()
    header = m.PushHeader(session, 0, 1, 1, "fp32", len(payload), digest(payload), "p" * (4 << 20))
    requests = [
        ("Join", serde.serializer(m.JoinRequest)(m.JoinRequest("s" * big, token)), token),
        ("Join", serde.serializer(m.JoinRequest)(m.JoinRequest("evil-1", token, paradigm="y" * big)), token),
        ("PushDelta", serde.serializer(m.Chunk)(m.Chunk(data=payload, push=header)), session),
    ]
    joins = [a.method("Join", "unary_unary", i, raw=True) for i in range(len(a.channels))]
    pushes = [a.method("PushDelta", "stream_unary", i, raw=True) for i in range(len(a.channels))]
    sent = itertools.count()

    async def one(i: int) -> None:
        name, raw, credential = requests[next(sent) % len(requests)]
        timeout, auth = CALL_TIMEOUT.total_seconds(), bearer(credential)
        if name == "Join":
            call = joins[i % len(joins)](raw, timeout=timeout, metadata=auth)
        else:
            call = pushes[i % len(pushes)](_once(raw), timeout=timeout, metadata=auth)
        await a.tally(call)

    tasks = await a.keep(a.spec["in_flight"], one)
    a.ready_when(lambda: a.stats["opened"] >= a.spec["in_flight"])
    await asyncio.gather(*tasks)


async def _once(raw: bytes) -> AsyncIterator[bytes]:
    yield raw


async def cpu_burn(a: Attack) -> None:
    """No call at all: spec["cores"] of CPU burnt (sha256 of a buffer, which leaves the GIL, in duty cycles of
    BURN_PERIOD over ceil(cores) threads): the attacker's CPU load alone, the control for an attack's."""
    threads = max(1, math.ceil(a.spec["cores"]))
    duty, period = a.spec["cores"] / threads, BURN_PERIOD.total_seconds()
    buf = os.urandom(1 << 16)

    def burn() -> None:
        while a.running():
            start = time.perf_counter()
            while time.perf_counter() - start < duty * period:
                hashlib.sha256(buf).digest()
            time.sleep(max(0.0, period - (time.perf_counter() - start)))

    loop = asyncio.get_running_loop()
    work = [loop.run_in_executor(None, burn) for _ in range(threads)]
    a.ready_when(lambda: True)
    await a.stop.wait()
    await asyncio.gather(*work)


ATTACKS: dict[str, Callable[[Attack], Coroutine[Any, Any, None]]] = {
    "cpu_burn": cpu_burn,
    "idle_connections": idle_connections,
    "stalled_pushes": stalled_pushes,
    "unauthenticated_streams": unauthenticated_streams,
    "long_polls": long_polls,
    "oversized_fields": oversized_fields,
}


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    a = Attack(spec)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, a.stop.set)
    await a.relays()
    work = asyncio.create_task(ATTACKS[spec["attack"]](a))
    until = asyncio.create_task(asyncio.sleep(max(0.0, spec["until"] - time.monotonic())))
    await asyncio.wait({work, until, asyncio.create_task(a.stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    a.stop.set()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(work, 5)
    if work.done() and not work.cancelled() and work.exception() is not None:
        a.stats["attack_failed"] += 1
        a.stats[f"error: {type(work.exception()).__name__}: {str(work.exception())[:200]}"] += 1
    cpu = os.times()
    out = dict(a.stats) | {"most_held": a.most_held, "cpu_s": round(cpu.user + cpu.system, 2), "details": a.details}
    if a.lifetimes:
        out["closed_by_server_after_s"] = [round(min(a.lifetimes), 1), round(max(a.lifetimes), 1)]
    return out


def main() -> None:
    """SPEC (argv[1]) is JSON: attack (a name of ATTACKS), host and port of the PS, ca_file, token (the attacker's
    enrollment token, site "evil"), sources (the loopback addresses it calls from: a relay in this process binds
    each), until (a time.monotonic() it stops at in any case), and the attack's sizes. Prints one JSON line
    {"ready": ...} once its load is in place, and one {"stats": ...} line when it stops (SIGTERM): calls opened, how
    they ended (status codes, the first answer's details for each), the most held at once, its CPU seconds. Every
    loop is bounded by SIGTERM and `until`; every call goes to the PS's loopback address."""
    spec = json.loads(sys.argv[1])
    stats = asyncio.run(run(spec))
    print(json.dumps({"stats": stats}), flush=True)
    os._exit(0)  # no wait for gRPC's threads on calls the attack left open


if __name__ == "__main__":
    main()
