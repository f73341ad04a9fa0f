"""Real gRPC over loopback: the protocol end to end, 16 concurrent sites, health, keepalive, graceful stop."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.client.replica import apply_updates
from geofed_hpc.config import CodecConfig, RunConfig
from geofed_hpc.errors import GeofedError, StaleError, UnavailableError
from geofed_hpc.ps.app import ParameterServer
from geofed_hpc.ps.servicer import ParameterServerLogic
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc import serde
from geofed_hpc.rpc.channel import client_options
from geofed_hpc.rpc.client import PSClient
from geofed_hpc.rpc.guard import Principal, bearer
from geofed_hpc.rpc.server import start_server
from geofed_hpc.rpc.stream import digest, to_chunks
from geofed_hpc.testing.partition import Partition
from tests.conftest import ps_config, small_params
from tests.site_procs import wait_for

REPO = Path(__file__).resolve().parents[1]
FP32 = CodecConfig(name="fp32")
INT8 = CodecConfig(name="int8", block_size=64)
PING_FRAME = 9 + 8  # an HTTP/2 frame header and the PING's 8 bytes


def init_header(session: str) -> m.PushHeader:
    return m.PushHeader(session, 0, 0, 0, "fp32", 0, b"", "", init=True)


def test_round_trip_join_pull_push_new_version(live_ps) -> None:
    with PSClient(ps_config(), live_ps.address) as client:
        client.connect(timedelta(seconds=5))
        a = client.join(m.JoinRequest("site-a"))
        b = client.join(m.JoinRequest("site-b"))
        assert not a.initialized and a.version == 0 and a.settings.aggregation == "sync"
        params = small_params()
        assert client.push_delta(init_header(a.session_id), codec.encode(params, FP32)).accepted
        header, payload = client.pull_model(b.session_id)
        assert header.kind == "full" and header.version == 0 and header.total_bytes == len(payload) > 4096
        replica = codec.decode(payload)
        for k in params:
            np.testing.assert_array_equal(replica[k], params[k])
        delta = {k: np.full_like(v, 0.01) for k, v in params.items()}
        enc = codec.encode(delta, INT8)
        for sid in (a.session_id, b.session_id):
            r = client.push_delta(m.PushHeader(sid, 0, 5, 320, "int8", 0, b"", "", train_loss=3.0), enc)
            assert r.accepted
        header, payload = client.pull_model(b.session_id, 1, timedelta(seconds=5), have_version=0)
        assert header.kind == "updates" and header.version == 1 and header.base_version == 0
        replica = apply_updates(replica, header, payload)
        assert all(replica[k].tobytes() == live_ps.logic.core.model.params[k].tobytes() for k in params)
        np.testing.assert_allclose(replica["ln.bias"], 0.01, atol=1e-6)
        status = client.status()
        assert status.version == 1 and status.num_params == sum(v.size for v in params.values())
        assert sorted(s.site for s in status.sites) == ["site-a", "site-b"]
        assert all(s.pushes == 1 and s.tokens == 320 and s.state == "active" for s in status.sites)


def test_errors_cross_the_wire_as_the_same_family(live_ps) -> None:
    with PSClient(ps_config(), live_ps.address) as client:
        a = client.join(m.JoinRequest("site-a"))
        with pytest.raises(StaleError, match="not initialized"):
            client.pull_model(a.session_id)


@pytest.mark.parametrize("live_ps", [{"aggregation": "async"}], indirect=True)
def test_retransmitted_push_applies_once(live_ps) -> None:
    with PSClient(ps_config(), live_ps.address) as client:
        a = client.join(m.JoinRequest("site-a"))
        params = small_params()
        client.push_delta(init_header(a.session_id), codec.encode(params, FP32))
        enc = codec.encode({k: np.ones_like(v) for k, v in params.items()}, FP32)
        header = m.PushHeader(a.session_id, 0, 1, 1, "fp32", 0, b"", "fixed-id")
        assert not client.push_delta(header, enc).duplicate
        again = client.push_delta(header, enc)
        assert again.duplicate and again.version == 1


@pytest.mark.parametrize("live_ps", [{"round_timeout": "10m"}], indirect=True)  # one round of all 16, however slow
def test_sixteen_concurrent_sites_over_grpc(live_ps) -> None:
    """16 threads, each its own channel: join, pull, push an int8 delta, long-poll the next version as updates."""
    n = 16
    params = small_params()
    with PSClient(ps_config(), live_ps.address) as client:
        seeder = client.join(m.JoinRequest("seeder"))
        client.push_delta(init_header(seeder.session_id), codec.encode(params, FP32))
        client.heartbeat(m.HeartbeatRequest(seeder.session_id, leaving=True))  # not part of the round
    rngs = [np.random.default_rng(i) for i in range(n)]
    deltas = [{k: (rng.normal(size=v.shape) * 1e-2).astype(np.float32) for k, v in params.items()} for rng in rngs]
    joined = threading.Barrier(n)
    results: list[tuple[m.ModelHeader, dict] | BaseException] = [RuntimeError("not run")] * n

    def site(i: int) -> None:
        try:
            with PSClient(ps_config(), live_ps.address) as c:
                session = c.join(m.JoinRequest(f"site-{i:02d}")).session_id
                joined.wait(timeout=60)  # everyone is active before anyone pushes: one round of 16
                header, payload = c.pull_model(session)
                replica = codec.decode(payload)
                push = m.PushHeader(session, header.version, 4, 256, "int8", 0, b"", "")
                reply = c.push_delta(push, codec.encode(deltas[i], INT8))
                assert reply.accepted, reply.reason
                header, payload = c.pull_model(session, 1, timedelta(seconds=60), have_version=0)
                results[i] = (header, apply_updates(replica, header, payload))
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=site, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    logic = live_ps.logic
    assert logic.version == 1
    expected = {k: params[k] + np.mean([d[k] for d in deltas], axis=0) for k in params}
    for header, replica in results:  # type: ignore[misc]
        assert header.kind == "updates" and header.version == 1
        for k in params:
            assert replica[k].tobytes() == logic.core.model.params[k].tobytes()  # bit-identical to the PS
            np.testing.assert_allclose(replica[k], expected[k], atol=2e-4)
    status = logic.status(m.StatusRequest())
    assert sum(s.pushes for s in status.sites) == n and status.pushes_in_flight == 0


def test_health_service_reports_serving_then_not_serving() -> None:
    server = ParameterServer(replace(RunConfig(), ps=ps_config()))
    try:
        with PSClient(ps_config(), server.address) as client:
            assert client.health() == "SERVING"
            assert client.health("") == "SERVING"
            with grpc.insecure_channel(server.address) as channel:
                check = serde.health_check(channel)
                with pytest.raises(grpc.RpcError) as info:
                    check("no.such.Service", 5.0)
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop()
    with PSClient(ps_config(connect_timeout="1s"), server.address) as client:
        with pytest.raises(UnavailableError):
            client.health()


def serving(client: PSClient) -> bool:
    try:
        return client.health() == "SERVING"
    except GeofedError:  # a stopping server refuses new calls
        return False


def test_graceful_stop_finishes_a_push_in_flight_and_snapshots_it(tmp_path: Path) -> None:
    server = ParameterServer(replace(RunConfig(), ps=ps_config(aggregation="async", state_dir=str(tmp_path))))
    address = server.address
    with PSClient(ps_config(), address) as client:
        a = client.join(m.JoinRequest("site-a")).session_id
        params = small_params()
        client.push_delta(init_header(a), codec.encode(params, FP32))
        payload = codec.encode(small_params(seed=9), FP32)  # incompressible: many chunks
        header = m.PushHeader(a, 0, 1, 1, "fp32", len(payload), digest(payload), "in-flight")
        chunks = list(to_chunks(header, payload, 1024))
        assert len(chunks) > 1
        first_sent, release = threading.Event(), threading.Event()

        def slow() -> Iterator[m.Chunk]:
            yield chunks[0]
            first_sent.set()
            release.wait(timeout=60)
            yield from chunks[1:]

        future = client._calls["PushDelta"].future(slow(), timeout=60, metadata=bearer(a))
        assert first_sent.wait(timeout=30)
        stopper = threading.Thread(target=server.stop, kwargs={"grace": timedelta(seconds=30)})
        stopper.start()
        wait_for(lambda: not serving(client), 120, "the stopping PS to report NOT_SERVING")
        release.set()
        reply = future.result(timeout=60)
        stopper.join(timeout=60)
    assert reply.accepted and reply.version == 1
    assert server.logic.version == 1 and server.logic.snapshot_version == 1
    restarted = ParameterServerLogic(ps_config(aggregation="async", state_dir=str(tmp_path)), m.RunSettings())
    assert restarted.version == 1 and restarted.model_hash() == server.logic.model_hash()
    restarted.finish()


def test_keepalive_pings_on_an_idle_channel_never_earn_a_goaway(live_ps) -> None:
    """A client pinging every 200 ms (far below the server's 10 s minimum) is still never sent away."""
    cfg = ps_config()
    host, port = live_ps.address.rsplit(":", 1)
    link = Partition((host, int(port)))  # a forwarder that counts the bytes the client sends
    try:
        with grpc.insecure_channel(link.address, options=client_options(cfg, keepalive_ms=200)) as channel:
            status = channel.unary_unary(
                "/geofed.v1.ParameterServer/Status",
                request_serializer=serde.serializer(m.StatusRequest),
                response_deserializer=serde.deserializer(m.StatusReply),
            )
            assert status(m.StatusRequest(), timeout=5).version == 0
            before = link.sent()
            # idle until 5 keepalive pings went out (a default server strikes out at 3), however long that takes
            wait_for(lambda: link.sent() - before >= 5 * PING_FRAME, 120, "5 keepalive pings")
            assert status(m.StatusRequest(), timeout=5).version == 0
            assert channel._channel.check_connectivity_state(False) == 2  # READY, the same connection
    finally:
        link.close()


def test_unreachable_ps_names_address_and_what_to_check() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with PSClient(ps_config(), f"127.0.0.1:{port}") as client:
        with pytest.raises(UnavailableError, match=rf"127\.0\.0\.1:{port}.*ps up"):
            client.connect(timedelta(seconds=1))


def test_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        logic = ParameterServerLogic(ps_config(), m.RunSettings())
        with pytest.raises(UnavailableError, match=rf"127\.0\.0\.1:{port}.*in use"):
            start_server(logic, logic.gate, ps_config(port=port))
        logic.finish()


def test_serde_methods_match_the_proto_service() -> None:
    assert [meth.name for meth in serde.METHODS] == serde.service_descriptor_methods()
    chunk = m.Chunk(data=b"xyz", push=m.PushHeader("s", 1, 2, 3, "int8", 3, b"h", "id", train_loss=1.5))
    assert serde.deserializer(m.Chunk)(serde.serializer(m.Chunk)(chunk)) == chunk
    model = m.Chunk(data=b"", model=m.ModelHeader(4, "int8", 9, b"h", "updates", 2, [4, 5]))
    assert serde.deserializer(m.Chunk)(serde.serializer(m.Chunk)(model)) == model
    reply = m.StatusReply(3, True, "sync", sites=[m.SiteStatus("a", "b", pushes=2, state="idle", last_push_s=-1.0)])
    assert serde.deserializer(m.StatusReply)(serde.serializer(m.StatusReply)(reply)) == reply


def test_generated_stubs_have_no_drift(tmp_path: Path) -> None:
    """The committed *_pb2 files equal what `make proto` generates from geofed.proto."""
    out = tmp_path / "gen"
    (out / "geofed_hpc" / "rpc").mkdir(parents=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Igeofed_hpc/rpc=geofed_hpc/rpc",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            "geofed_hpc/rpc/geofed.proto",
        ],
        cwd=REPO,
        check=True,
    )
    for name in ("geofed_pb2.py", "geofed_pb2.pyi", "geofed_pb2_grpc.py"):
        committed = (REPO / "geofed_hpc" / "rpc" / name).read_text()
        assert (out / "geofed_hpc" / "rpc" / name).read_text() == committed, f"{name} drifted: run `make proto`"


def test_connect_gives_up_within_its_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []  # every wait connect asks for: for the channel to get ready, or between attempts
    cancelled: list[bool] = []
    ready, sleep = grpc.channel_ready_future, time.sleep

    class Ready:
        def __init__(self, channel: grpc.Channel) -> None:
            self.future = ready(channel)

        def result(self, timeout: float) -> None:
            waits.append(timeout)
            self.future.result(timeout=timeout)

        def cancel(self) -> bool:  # connect ends its watch of the channel however it ends
            cancelled.append(True)
            return self.future.cancel()

    def slept(seconds: float) -> None:
        waits.append(seconds)
        sleep(seconds)

    monkeypatch.setattr(grpc, "channel_ready_future", Ready)
    monkeypatch.setattr(time, "sleep", slept)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with PSClient(ps_config(), f"127.0.0.1:{port}") as client:
        with pytest.raises(UnavailableError, match=f"cannot reach the parameter server at 127.0.0.1:{port} after 1s"):
            client.connect(timedelta(seconds=1))
    # no wait reaches past the 1 s timeout, however slow this machine (the first wait alone used to be 2 s)
    assert waits and max(waits) <= 1.0 and sum(waits) <= 1.0 + 1e-6, waits
    assert cancelled == [True]  # no watch left running past the channel (its thread's traceback at exit)


class Anyone:
    """An authority that lets every call in (a test of what happens behind the gate)."""

    def authenticate(self, method: str, credential: str) -> Principal:
        return Principal("open")

    def admit(self, caller: Any) -> Any:
        return lambda: None


def test_a_crash_in_a_handler_is_logged_with_its_stack_and_answers_internal(
    warnings_log: pytest.LogCaptureFixture,
) -> None:
    """INTERNAL means a crash, from any exception that is not a refusal of the request, ours included."""
    from geofed_hpc.errors import CheckpointError

    class Crashing:
        def __init__(self, exc: Exception) -> None:
            self.exc = exc

        def status(self, request: m.StatusRequest, caller: Any = None) -> m.StatusReply:
            raise self.exc

        join = stream_model = push_delta = heartbeat = split = fetch_aux = status

    for exc in (RuntimeError("boom"), CheckpointError("snapshot unreadable")):
        warnings_log.clear()
        running = start_server(Crashing(exc), Anyone(), ps_config())  # type: ignore[arg-type]
        try:
            with PSClient(ps_config(), f"127.0.0.1:{running.port}") as client:
                with pytest.raises(GeofedError, match="Status refused by the parameter server") as info:
                    client.status()
        finally:
            running.drain(timedelta(seconds=1))
        assert type(info.value) is GeofedError  # INTERNAL: no member of the family claims it
        logged = {
            id(r): r for r in warnings_log.records if r.levelname == "ERROR" and "Status failed" in r.getMessage()
        }
        records = list(logged.values())  # (a record may reach the capture twice: directly and by propagation)
        assert len(records) == 1 and records[0].exc_info is not None and records[0].exc_info[1] is exc
