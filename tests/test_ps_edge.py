"""A real `ps up` over TLS and mutual TLS, tried as an attacker would: secrets, slots, leaving, strings at the edge."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.config import CodecConfig, PSConfig
from geofed_hpc.ps.sessions import handle_of
from geofed_hpc.ps.statedir import admin_token
from geofed_hpc.ps.tokens import TokenFile, tokens_path
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc import serde
from geofed_hpc.rpc.client import PSClient
from geofed_hpc.rpc.guard import RETRY_PUSHBACK_KEY, bearer
from geofed_hpc.rpc.stream import digest, to_chunks
from tests.conftest import ps_config, small_params
from tests.dist_util import free_port
from tests.site_procs import wait_for
from tests.test_ps_state_files import loose
from tests.test_tls import ps_init

REPO = Path(__file__).resolve().parents[1]
FP32 = CodecConfig(name="fp32")
IDLE = 10.0  # ps.stream_idle_timeout of the PS under test, seconds (what a test does within it fits on a busy machine)
CODE = grpc.StatusCode
# Settings of the PS under test: small limits, so that an attack reaches them with a few calls.
LIMITS = {
    "stream_idle_timeout": f"{IDLE:g}s",
    "stream_min_rate": 65536,
    "max_workers": 24,
    "reserved_workers": 8,  # 16 threads for streams
    "max_streams_per_peer": 64,  # every caller here is 127.0.0.1: the per-peer limit is tested in test_ps_gate.py
    "max_concurrent_pushes": 2,
    "decode_threads": 2,
    "rpc_timeout": "30s",
    "round_timeout": "10m",
}


@dataclass
class EdgePS:
    """`geofed-hpc ps up` as its own process over TLS (`mutual`: mutual TLS), with tokens issued for osc and tacc,
    the model seeded; its output collected line by line."""

    where: Path
    mutual: bool
    port: int = 0
    tokens: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    admin: str = ""

    def command(self, state: Path, port: int) -> list[str]:
        """`geofed-hpc ps up` of this PS, over its state directory `state`, on `port`."""
        pki = self.where / "pki"
        args = [
            "ps",
            "up",
            "ps.host=127.0.0.1",
            f"ps.port={port}",
            f"ps.state_dir={state}",
            "ps.insecure=false",
            f"ps.cert_file={pki / 'server.crt'}",
            f"ps.key_file={pki / 'server.key'}",
            "ps.aggregation=async",
            "codec=fp32",
            *(f"ps.{k}={v}" for k, v in LIMITS.items()),
        ]
        if self.mutual:
            args.append(f"ps.client_ca_file={pki / 'ca.crt'}")
        return [sys.executable, "-m", "geofed_hpc.cli", *args]

    def start(self) -> None:
        pki, state = self.where / "pki", self.where / "state"
        assert ps_init(pki, "ps.tls_sites=[osc,tacc]") == 0
        for site in ("osc", "tacc"):
            self.tokens[site], _ = TokenFile(tokens_path(str(state))).issue(site, timedelta(days=1))
        self.port = free_port()
        self.proc = subprocess.Popen(
            self.command(state, self.port),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._collect, daemon=True).start()
        wait_for(self._up, 60, "`ps up` to listen")
        assert self.proc.poll() is None, "".join(self.lines)
        self.admin = admin_token(state, create=False)
        assert self.admin
        with self.client("osc") as client:
            session = client.join(m.JoinRequest("osc-0", self.tokens["osc"])).session_id
            init = m.PushHeader(session, 0, 0, 0, "fp32", 0, b"", "seed", init=True)
            assert client.push_delta(init, codec.encode(small_params(), FP32)).accepted
            assert legit_push(client, session).version == 1

    def _up(self) -> bool:
        return any(ln.startswith("parameter server on") for ln in self.lines) or self.proc.poll() is not None  # type: ignore[union-attr]

    def _collect(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)

    def config(self, cert: str = "", **overrides: Any) -> PSConfig:
        """A site's view of the PS; `cert`: the site certificate it presents under mutual TLS (default: none, or
        osc's when the PS needs one)."""
        pki = self.where / "pki"
        cert = cert or ("osc" if self.mutual else "")
        files = {"client_cert_file": f"{pki}/sites/{cert}.crt", "client_key_file": f"{pki}/sites/{cert}.key"}
        base = {"insecure": False, "ca_file": str(pki / "ca.crt"), "rpc_timeout": "20s", "retry_budget": "0s"}
        return ps_config(**{**base, **(files if cert else {}), **overrides})

    def client(self, cert: str = "", **overrides: Any) -> PSClient:
        return PSClient(self.config(cert, **overrides), f"127.0.0.1:{self.port}")

    def joined(self, client: PSClient, site: str) -> m.JoinReply:
        family = site.split("-")[0]
        return client.join(m.JoinRequest(site, self.tokens[family]))

    def status(self) -> m.StatusReply:
        with self.client() as client:
            return client.status(self.admin)


@pytest.fixture(scope="module", params=["tls", "mutual_tls"])
def edge(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgePS]:
    ps = EdgePS(tmp_path_factory.mktemp(request.param), mutual=request.param == "mutual_tls")
    try:
        ps.start()
        yield ps
    finally:
        ps.stop()


def code_of(call: Callable[..., Any], *args: Any, **kwargs: Any) -> grpc.StatusCode:
    """The status `call(*args, **kwargs)` ends with (a stream is read to its end)."""
    try:
        result = call(*args, **kwargs)
        if isinstance(result, Iterator):
            list(result)
    except grpc.RpcError as exc:
        return exc.code()
    return CODE.OK


def every_rpc(client: PSClient, credential: str, carried: str | None = None) -> dict[str, grpc.StatusCode]:
    """The status each session RPC gets when its request names `credential` and its call carries `carried` (the
    same by default): a heartbeat, a pull, a push, a split upload, an auxiliary-model fetch."""
    auth = {"timeout": 10, "metadata": bearer(credential if carried is None else carried)}
    calls = client._calls
    payload = codec.encode({k: np.ones_like(v) for k, v in small_params().items()}, FP32)
    push = m.PushHeader(credential, 0, 1, 1, "fp32", len(payload), digest(payload), uuid.uuid4().hex)
    split = m.SplitHeader(credential, "train", 1, [1, 1, 8], "fp32", 0, digest(b""))
    return {
        "Heartbeat": code_of(calls["Heartbeat"], m.HeartbeatRequest(credential), **auth),
        "StreamModel": code_of(calls["StreamModel"], m.ModelRequest(credential), **auth),
        "PushDelta": code_of(calls["PushDelta"], iter(to_chunks(push, payload, 4096)), **auth),
        "Split": code_of(calls["Split"], iter(to_chunks(split, b"", 4096)), **auth),
        "FetchAux": code_of(calls["FetchAux"], m.AuxRequest(credential), **auth),
    }


def raw_status(client: PSClient, credential: str) -> bytes:
    """A Status answer's bytes as they cross the wire."""
    call = client._channel.unary_unary(
        serde.METHODS[4].path, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    return call(b"", timeout=10, metadata=bearer(credential))


# ---------------------------------------------------------------- 1. secrets stay with their owners
def test_status_needs_a_credential_and_carries_no_secret(edge: EdgePS) -> None:
    with edge.client() as client:
        osc = edge.joined(client, "osc-1")
        status = client._calls["Status"]
        assert code_of(status, m.StatusRequest(), timeout=10) == CODE.UNAUTHENTICATED
        assert code_of(status, m.StatusRequest(), timeout=10, metadata=bearer("gft_0_x")) == CODE.UNAUTHENTICATED
        secrets = [osc.session_id, osc.rejoin_token, edge.tokens["osc"], edge.tokens["tacc"], edge.admin]
        secrets.append(osc.session_id.split("_", 2)[2])  # the session's secret alone (it may hold "_" itself)
        for credential in (edge.tokens["tacc"], osc.session_id, edge.admin):  # a site, a session, the operator
            raw = raw_status(client, credential)
            assert not [s for s in secrets if s.encode() in raw], credential[:8]
        site_view, admin_view = client.status(edge.tokens["tacc"]), client.status(edge.admin)
    rows = {s.site: s for s in site_view.sites}
    assert "osc-1" in rows and rows["osc-1"].session_id == "" and site_view.version >= 1
    assert handle_of(osc.session_id) in {s.session_id for s in admin_view.sites}  # the public handle, for the operator


def test_a_leaked_handle_a_guessed_secret_or_another_sites_certificate_act_for_no_session(edge: EdgePS) -> None:
    with edge.client() as client:
        osc = edge.joined(client, "osc-2")
        handle = handle_of(osc.session_id)  # what an operator's status shows
        before = edge.status().version
        wrong = osc.session_id[:-1] + ("B" if osc.session_id[-1] != "B" else "C")
        for credential in (handle, f"gfs_{handle}_{'A' * 32}", wrong):
            assert set(every_rpc(client, credential).values()) == {CODE.UNAUTHENTICATED}, credential
        if not edge.mutual:  # the request names osc's session, the call carries another's: refused
            other = edge.joined(client, "osc-22")
            assert set(every_rpc(client, osc.session_id, other.session_id).values()) == {CODE.UNAUTHENTICATED}
        assert client.heartbeat(m.HeartbeatRequest(osc.session_id)).version == before
    if edge.mutual:  # tacc's certificate holding osc's whole credential acts for nothing, on every RPC
        with edge.client("tacc") as thief:
            assert set(every_rpc(thief, osc.session_id).values()) == {CODE.PERMISSION_DENIED}
    assert edge.status().version == before


def test_a_token_or_certificate_enrolls_only_its_own_site(edge: EdgePS) -> None:
    with edge.client("tacc") as client:  # osc's token for tacc's name (from tacc's certificate, under mutual TLS)
        wrong_token = m.JoinRequest("tacc-3", edge.tokens["osc"])
        join = client._calls["Join"]
        assert code_of(join, wrong_token, timeout=10, metadata=bearer(wrong_token.token)) == CODE.UNAUTHENTICATED
    with edge.client("osc") as client:
        join = client._calls["Join"]
        foreign = m.JoinRequest("tacc-3", edge.tokens["tacc"])  # tacc's own token, from osc's certificate
        expected = CODE.PERMISSION_DENIED if edge.mutual else CODE.OK
        assert code_of(join, foreign, timeout=10, metadata=bearer(foreign.token)) == expected
        assert edge.joined(client, "osc-3").session_id  # its own site's numbered job: admitted
    with edge.client("tacc") as client:
        assert edge.joined(client, "tacc-4").session_id


# ---------------------------------------------------------------- 2. no credential, no slot; every slot bounded
class Held:
    """A client stream held open: it sends `first` and then nothing until `release`; `code` is how it ended."""

    def __init__(self, call: Any, first: list[Any], metadata: tuple[tuple[str, str], ...]) -> None:
        self.release, self.sent = threading.Event(), threading.Event()

        def requests() -> Iterator[Any]:
            yield from first
            self.sent.set()
            self.release.wait(60)

        self.future = call.future(requests(), timeout=60, metadata=metadata)

    def code(self, timeout: float) -> grpc.StatusCode:
        try:
            self.future.result(timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code()
        return CODE.OK

    def details(self) -> str:
        exc = self.future.exception(timeout=60)
        return str(exc.details()) if exc is not None else ""


def legit_push(client: PSClient, session: str) -> m.PushReply:
    version = client.heartbeat(m.HeartbeatRequest(session)).version
    payload = codec.encode({k: np.full_like(v, 1e-3) for k, v in small_params().items()}, FP32)
    return client.push_delta(m.PushHeader(session, version, 1, 1, "fp32", 0, b"", uuid.uuid4().hex), payload)


def test_calls_without_a_credential_are_refused_unread_and_hold_nothing(edge: EdgePS) -> None:
    with edge.client() as attacker, edge.client() as client:
        held = [Held(attacker._calls["PushDelta"], [], bearer(cred)) for cred in ["", "junk", "gfs_0_0"] * 10]
        # answered while the streams have sent nothing at all (their first message waits for `release`)
        assert {h.code(timeout=20) for h in held} == {CODE.UNAUTHENTICATED}
        assert edge_streams(edge) == 0
        assert legit_push(client, edge.joined(client, "osc-4").session_id).accepted
        for h in held:
            h.release.set()


def test_stalled_pushes_are_ended_by_the_idle_timeout_and_hold_at_most_their_share(edge: EdgePS) -> None:
    with edge.client("osc") as attacker, edge.client("tacc") as client:
        bad, legit = edge.joined(attacker, "osc-5"), edge.joined(client, "tacc-6")  # two families take part
        payload = b"\0" * (1 << 20)
        stalled = []
        for _ in range(2):  # a header and the first chunk, then nothing (without shares: both slots, both decoders)
            header = m.PushHeader(bad.session_id, 0, 1, 1, "fp32", len(payload), digest(payload), uuid.uuid4().hex)
            first = [next(iter(to_chunks(header, payload, 4096)))]
            stalled.append(Held(attacker._calls["PushDelta"], first, bearer(bad.session_id)))
        wait_for(lambda: edge_streams(edge) == 2, 30, "the stalled pushes to be held")
        third = Held(attacker._calls["PushDelta"], [], bearer(bad.session_id))
        assert third.code(timeout=20) == CODE.RESOURCE_EXHAUSTED  # ps.max_uploads_per_session=2
        trailers = dict(third.future.exception().trailing_metadata() or ())
        assert int(trailers[RETRY_PUSHBACK_KEY]) > 0 and "max_uploads_per_session" in third.details()
        # another site's push lands while both stalled pushes are still held: of the PS's two receiving slots and
        # two decoders, osc's family holds one of each (a push of osc's would wait)
        assert legit_push(client, legit.session_id).accepted
        assert not [h for h in stalled if h.future.done()]
        for h in stalled:  # ended within ps.stream_idle_timeout: idle with a receiving slot, or waiting for osc's
            code = h.code(timeout=60)
            assert code in (CODE.DEADLINE_EXCEEDED, CODE.RESOURCE_EXHAUSTED), code
            assert ("ps.stream_idle_timeout" if code == CODE.DEADLINE_EXCEEDED else "busy with other pushes") in (
                h.details()
            )
            h.release.set()
        third.release.set()
    wait_for(lambda: edge_streams(edge) == 0, 30, "every stream to be released")


def test_a_push_slower_than_the_floor_is_ended(edge: EdgePS) -> None:
    with edge.client() as client:
        osc = edge.joined(client, "osc-7")
        payload = np.random.default_rng(0).bytes(1 << 20)
        header = m.PushHeader(osc.session_id, 0, 1, 1, "fp32", len(payload), digest(payload), uuid.uuid4().hex)
        done = threading.Event()

        def trickle() -> Iterator[m.Chunk]:  # 4 KiB every 0.2 s: 20 KiB/s, under the PS's 64 KiB/s floor
            for chunk in to_chunks(header, payload, 4096):
                yield chunk
                if done.wait(0.2):
                    return

        try:
            with pytest.raises(grpc.RpcError) as info:
                client._calls["PushDelta"](trickle(), timeout=60, metadata=bearer(osc.session_id))
        finally:
            done.set()
        assert info.value.code() == CODE.DEADLINE_EXCEEDED and "ps.stream_min_rate" in str(info.value.details())


def test_idle_streams_of_many_sessions_leave_threads_for_join_heartbeat_and_status(edge: EdgePS) -> None:
    streams = LIMITS["max_workers"] - LIMITS["reserved_workers"]  # type: ignore[operator]
    with edge.client() as attacker, edge.client(rpc_timeout="3s") as client:
        sessions = [edge.joined(attacker, f"osc-{10 + i}").session_id for i in range(12)]
        held = [Held(attacker._calls["PushDelta"], [], bearer(s)) for s in sessions for _ in range(2)]
        # 24 idle streams of 12 sessions, each within its session's share: 16 threads take streams, 8 never do
        wait_for(lambda: sum(h.future.done() for h in held) >= len(held) - streams, 30, "the streams over the cap")
        refused = [h for h in held if h.future.done()]
        assert len(refused) == len(held) - streams and edge_streams(edge) == streams
        assert {h.code(timeout=1) for h in refused} == {CODE.RESOURCE_EXHAUSTED}
        assert "ps.reserved_workers" in refused[0].details()
        for i in range(5):  # the reserved threads answer at once (the client's deadline: 3 s)
            osc = edge.joined(client, f"osc-{30 + i}")
            assert client.heartbeat(m.HeartbeatRequest(osc.session_id)).version >= 1
            assert client.status(edge.admin).streams == streams
        for h in held:  # ended by the PS: idle with a receiving slot, or waiting for one, ps.stream_idle_timeout
            assert h in refused or h.code(timeout=60) in (CODE.DEADLINE_EXCEEDED, CODE.RESOURCE_EXHAUSTED)
            h.release.set()
    wait_for(lambda: edge_streams(edge) == 0, 30, "every stream to be released")


def test_long_polls_are_bounded_per_session_and_a_cancelled_one_frees_its_slot_at_once(edge: EdgePS) -> None:
    with edge.client() as client:
        osc = edge.joined(client, "osc-8")
        version = client.heartbeat(m.HeartbeatRequest(osc.session_id)).version
        pull, auth = client._calls["StreamModel"], bearer(osc.session_id)

        def long_poll() -> Any:  # waits up to 25 s for a version nobody makes
            return pull(m.ModelRequest(osc.session_id, version + 1000, 25.0), timeout=30, metadata=auth)

        polls = [long_poll() for _ in range(2)]
        wait_for(lambda: edge_streams(edge) == 2, 20, "two long-polls to be waiting")
        assert code_of(long_poll) == CODE.RESOURCE_EXHAUSTED  # ps.max_downloads_per_session=2
        for poll in polls:
            poll.cancel()
        # freed by the cancel: within 10 s, long before their 25 s wait would have run out
        wait_for(lambda: edge_streams(edge) == 0, 10, "the cancelled long-polls' slots")
        assert code_of(pull, m.ModelRequest(osc.session_id, 0), timeout=10, metadata=auth) == CODE.OK


def edge_streams(edge: EdgePS) -> int:
    """The pushes, downloads and long-polls the PS holds now (its operator's status)."""
    return edge.status().streams


# ---------------------------------------------------------------- 3. leaving is final
def test_a_session_that_left_is_refused_on_every_call_until_its_site_joins_again(edge: EdgePS) -> None:
    with edge.client() as client:
        osc = edge.joined(client, "osc-9")
        before = edge.status().version
        client.heartbeat(m.HeartbeatRequest(osc.session_id, leaving=True))
        codes = every_rpc(client, osc.session_id)
        assert set(codes.values()) == {CODE.UNAUTHENTICATED}, codes
        heartbeat, auth = client._calls["Heartbeat"], bearer(osc.session_id)
        with pytest.raises(grpc.RpcError) as info:
            heartbeat(m.HeartbeatRequest(osc.session_id), timeout=10, metadata=auth)
        assert "left; join again" in str(info.value.details())
        assert {s.state for s in edge.status().sites if s.site == "osc-9"} == {"left"}
        again = client.join(m.JoinRequest("osc-9", osc.rejoin_token, resume_session=osc.session_id))
        assert handle_of(again.session_id) == handle_of(osc.session_id)  # the same session, joined again
        assert client.heartbeat(m.HeartbeatRequest(again.session_id)).version == before
        assert code_of(heartbeat, m.HeartbeatRequest(osc.session_id), timeout=10, metadata=auth) == (
            CODE.UNAUTHENTICATED  # the secret of before the rejoin
        )
    assert edge.status().version == before


# ---------------------------------------------------------------- 4. strings from the wire: bounded, escaped
def test_oversized_and_control_character_fields_are_refused_and_never_echoed(edge: EdgePS) -> None:
    big, huge = "x" * (1 << 20), "x" * (16 << 20)
    with edge.client(max_message_bytes=64 << 20) as client:
        osc = edge.joined(client, "osc-20")
        join, token = client._calls["Join"], edge.tokens["osc"]
        cases = {
            "JoinRequest.site": m.JoinRequest(big, token),
            "JoinRequest.paradigm": m.JoinRequest("osc-21", token, paradigm=big),
            "JoinRequest.client_version": m.JoinRequest("osc-21", token, client_version=big),
        }
        for name, request in cases.items():  # within ps.max_request_bytes: read, and refused naming the field
            with pytest.raises(grpc.RpcError) as info:
                join(request, timeout=30, metadata=bearer(token))
            details = str(info.value.details())
            assert info.value.code() == CODE.INVALID_ARGUMENT and name in details and "limit" in details
            assert len(details) < 200
        for request in (m.JoinRequest(huge, token), m.JoinRequest("osc-21", token, paradigm=huge)):
            with pytest.raises(grpc.RpcError) as info:  # over it (4 MiB): refused by gRPC as it arrives, never read
                join(request, timeout=30, metadata=bearer(token))
            assert info.value.code() == CODE.RESOURCE_EXHAUSTED and "larger than max" in str(info.value.details())
        for site in ("osc\n00:00:00 INFO geofed_hpc: FORGED LINE", "osc\x1b[31m", "osc-0\r"):
            request = m.JoinRequest(site, token)
            assert code_of(join, request, timeout=10, metadata=bearer(token)) == CODE.INVALID_ARGUMENT
        payload = codec.encode({k: np.ones_like(v) for k, v in small_params().items()}, FP32)
        auth = bearer(osc.session_id)
        for push_id in ("p\nFORGED LINE", "y" * (3 << 20), "p\x00"):
            header = m.PushHeader(osc.session_id, 0, 1, 1, "fp32", len(payload), digest(payload), push_id)
            chunks = iter(to_chunks(header, payload, 4096))
            assert code_of(client._calls["PushDelta"], chunks, timeout=30, metadata=auth) == CODE.INVALID_ARGUMENT
        forged = m.HeartbeatRequest(osc.session_id + "\nFORGED LINE")
        assert code_of(client._calls["Heartbeat"], forged, timeout=10, metadata=auth) == CODE.UNAUTHENTICATED
        assert client.heartbeat(m.HeartbeatRequest(osc.session_id)).version >= 1  # the PS serves on
    log = "".join(edge.lines)
    assert not [ln for ln in edge.lines if ln.startswith(("00:00:00 INFO", "FORGED"))]  # no line of the attacker's
    assert "\x1b" not in log and "\x00" not in log and "\r" not in log
    assert max(len(ln) for ln in edge.lines) < 4096  # no 16 MiB or 4 MiB string in the log


def test_status_on_the_command_line_uses_the_operators_token_or_the_sites(edge: EdgePS) -> None:
    pki = edge.where / "pki"
    cert = (
        [f"ps.client_cert_file={pki}/sites/osc.crt", f"ps.client_key_file={pki}/sites/osc.key"] if edge.mutual else []
    )

    def status(*args: str) -> subprocess.CompletedProcess:
        where = [f"ps.address=127.0.0.1:{edge.port}", "ps.insecure=false", f"ps.ca_file={pki / 'ca.crt'}", *cert]
        command = [sys.executable, "-m", "geofed_hpc.cli", "status", *where, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=edge.where)

    operator = status(f"ps.state_dir={edge.where / 'state'}")  # on the PS's machine: its admin token
    site = status(f"site.token={edge.tokens['osc']}")  # on a login node: the site's enrollment token
    nobody = status()
    for done in (operator, site):
        assert done.returncode == 0 and f"version {edge.status().version} " in done.stdout, done.stderr
        assert "osc-0" in done.stdout
    assert nobody.returncode == 2 and nobody.stderr.count("\n") == 1 and "Status needs a credential" in nobody.stderr
    assert edge.admin not in operator.stdout + operator.stderr


# ---------------------------------------------------------------- 5. state on disk
def test_what_the_ps_wrote_is_private_and_a_deleted_token_file_opens_nothing(edge: EdgePS) -> None:
    state = edge.where / "state"
    assert loose(state) == []  # after every test above: snapshots, journal, updates, tokens, admin token, metrics
    assert {"tokens.json", "auth.json", "admin.token"} <= {p.name for p in state.iterdir()}
    kept = (state / "tokens.json").read_bytes()
    (state / "tokens.json").unlink()
    try:
        with edge.client() as client:
            join = client._calls["Join"]
            for request in (m.JoinRequest("osc-40", ""), m.JoinRequest("osc-40", edge.tokens["osc"])):
                assert code_of(join, request, timeout=10, metadata=bearer(request.token)) == CODE.UNAUTHENTICATED
    finally:
        (state / "tokens.json").write_bytes(kept)
        os.chmod(state / "tokens.json", 0o600)
    with edge.client() as client:
        wait_for(lambda: code_of(edge.joined, client, "osc-41") == CODE.OK, 30, "the token file read again")


def test_a_malformed_state_file_stops_ps_up_in_one_line_and_nothing_is_deleted(edge: EdgePS, tmp_path: Path) -> None:
    state = tmp_path / "state"
    shutil.copytree(edge.where / "state", state, ignore=shutil.ignore_patterns("staging", "metrics"))
    os.chmod(state, 0o700)
    records = json.loads((state / "tokens.json").read_text())
    records["tokens"][0]["expires"] = "next week"
    (state / "tokens.json").write_text(json.dumps(records))
    before = {p: p.read_bytes() for p in state.rglob("*") if p.is_file()}
    done = subprocess.run(edge.command(state, free_port()), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "tokens.json" in done.stderr and "'expires'" in done.stderr and "Traceback" not in done.stderr
    assert {p: p.read_bytes() for p in state.rglob("*") if p.is_file()} == before  # nothing deleted or rewritten
