"""The gate's parts in process: credentials, who a caller is, what it may hold, stalls, bounded strings, quoting."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from geofed_hpc.errors import AuthError, LimitError, PermissionDeniedError, ProtocolError, UnavailableError
from geofed_hpc.log import quote
from geofed_hpc.ps.gate import Gate, admits
from geofed_hpc.ps.sessions import handle_of
from geofed_hpc.ps.slots import FairSlots
from geofed_hpc.ps.tokens import TokenFile
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc import serde
from geofed_hpc.rpc.guard import Caller, Principal, Progress, bearer, credential_in, peer_host
from tests.conftest import ps_config
from tests.test_ps_logic import init, make, push_chunks


def caller(
    method: str, principal: Principal, peer: str = "10.0.0.1", certs: tuple[str, ...] = (), credential: str = ""
) -> Caller:
    return Caller(method, principal, credential, peer=peer, cert_names=certs)


def test_credentials_travel_as_bearer_metadata_and_malformed_ones_are_refused() -> None:
    assert credential_in(bearer("gfs_x")) == "gfs_x" and credential_in(()) == "" and bearer("") == ()
    assert credential_in([("other", "v"), ("authorization", "Bearer t")]) == "t"
    with pytest.raises(AuthError, match="Bearer <credential>"):
        credential_in([("authorization", "Basic dXNlcg==")])
    with pytest.raises(AuthError, match="2 authorization entries"):
        credential_in([("authorization", "Bearer a"), ("authorization", "Bearer b")])
    with pytest.raises(AuthError, match="at most 512"):
        credential_in([("authorization", "Bearer " + "x" * 600)])
    with pytest.raises(Exception, match="printable ASCII"):
        bearer("tok\nen")
    assert peer_host("ipv4:10.1.2.3:5555") == "10.1.2.3" and peer_host("ipv6:[::1]:5555") == "::1"


def test_who_a_credential_proves_per_method(tmp_path: Path) -> None:
    logic = make(state_dir=str(tmp_path))
    gate = logic.gate
    assert gate.authenticate("Join", "") == Principal("open")  # no token issued: an open PS
    session = logic.join(m.JoinRequest("osc")).session_id
    assert gate.authenticate("Heartbeat", session) == Principal("session", "osc", handle_of(session))
    other = session[:-1] + ("A" if session[-1] != "A" else "B")  # the secret with its last character changed
    for bad in ("", handle_of(session), other, "gfs_" + "0" * 16 + "_" + "a" * 32):
        with pytest.raises(AuthError):
            gate.authenticate("PushDelta", bad)
    token, record = TokenFile(tmp_path / "tokens.json").issue("osc", timedelta(days=1))
    with pytest.raises(AuthError, match="Join needs a token"):
        gate.authenticate("Join", "")
    assert gate.authenticate("Join", token) == Principal("enroll", "osc")
    with pytest.raises(AuthError, match="already used"):
        gate.authenticate("Join", "not-a-token")
    with pytest.raises(AuthError, match="Status needs a credential"):
        gate.authenticate("Status", "")
    assert gate.authenticate("Status", token).kind == "enroll"
    assert gate.authenticate("Status", session).kind == "session"
    admin = (tmp_path / "admin.token").read_text()
    assert admin.strip() and gate.authenticate("Status", admin.strip()) == Principal("admin")
    joined = logic.join(m.JoinRequest("osc-1", token))
    assert gate.authenticate("Join", joined.rejoin_token) == Principal("rejoin", "osc-1", handle_of(joined.session_id))
    logic.join(m.JoinRequest("osc-1", joined.rejoin_token, resume_session=joined.session_id))
    with pytest.raises(AuthError, match="already used"):  # a rejoin token is good once
        gate.authenticate("Join", joined.rejoin_token)
    logic.finish()


def test_a_session_holds_at_most_its_share_a_peer_its_own_and_the_server_leaves_threads_in_reserve() -> None:
    gate = Gate(ps_config(max_workers=12, reserved_workers=4, max_streams_per_peer=5), make().core.sessions)
    a, b = Principal("session", "osc", "a" * 16), Principal("session", "osc", "b" * 16)
    held = [gate.admit(caller("PushDelta", a)), gate.admit(caller("Split", a))]
    with pytest.raises(LimitError, match="max_uploads_per_session") as info:
        gate.admit(caller("PushDelta", a))
    assert info.value.retry_after is not None and info.value.retry_after > timedelta(0)
    held += [gate.admit(caller("StreamModel", a)), gate.admit(caller("FetchAux", a))]  # downloads: a share of their own
    with pytest.raises(LimitError, match="max_downloads_per_session"):
        gate.admit(caller("StreamModel", a))
    held.append(gate.admit(caller("PushDelta", b)))
    with pytest.raises(LimitError, match="ps.max_streams_per_peer=5"):  # the sixth stream of one host
        gate.admit(caller("PushDelta", b))
    c = Principal("session", "tacc", "c" * 16)
    held += [gate.admit(caller("PushDelta", c, peer=f"10.0.0.{i}")) for i in (2, 3)]
    held.append(gate.admit(caller("StreamModel", c, peer="10.0.0.4")))
    with pytest.raises(LimitError, match="reserved_workers"):  # 8 of 12 threads: the other 4 are kept
        gate.admit(caller("StreamModel", c, peer="10.0.0.9"))
    assert gate.admit(caller("Heartbeat", b))() is None  # unary calls hold no slot
    held[0]()
    held[0]()  # released twice: counted once
    assert gate.streams == 7
    gate.admit(caller("PushDelta", a))
    for release in held:
        release()
    assert gate.streams == 1


def test_under_mutual_tls_a_certificate_acts_only_for_its_site_and_its_numbered_jobs() -> None:
    gate = Gate(ps_config(insecure=False, ca_file="x", client_ca_file="ca.crt"), make().core.sessions)
    assert admits("osc", "osc") and admits("osc", "osc-12") and not admits("osc", "osc2") and not admits("osc", "tacc")
    gate.check_site(caller("Join", Principal("enroll", "osc"), certs=("osc",)), "osc-3")
    with pytest.raises(PermissionDeniedError, match="for 'osc', not for site 'tacc'"):
        gate.check_site(caller("Join", Principal("enroll", "tacc"), certs=("osc",)), "tacc")
    with pytest.raises(PermissionDeniedError, match="no client certificate"):
        gate.check_site(caller("Join", Principal("enroll", "osc")), "osc")
    with pytest.raises(PermissionDeniedError):  # a session of tacc's, from osc's certificate
        gate.admit(caller("Heartbeat", Principal("session", "tacc", "c" * 16), certs=("osc",)))
    gate.check_site(None, "anything")  # in process: no channel to bind


def test_the_watchdog_ends_what_stalls_or_trickles_and_spares_what_moves() -> None:
    idle, floor, age = 2.0, 1000.0, 100.0
    p = Progress(None, "PushDelta")  # type: ignore[arg-type]
    t0 = p.started
    assert p.verdict(t0 + 50, idle, floor, age) == ""  # the server works (not waiting on the caller): spared
    p.waiting()
    p.waiting_since = t0
    assert "ps.stream_idle_timeout" in p.verdict(t0 + idle + 0.1, idle, floor, age)  # no header for 2 s
    p.moved(100)  # the header: the rate counts from here
    p.waited, p.bytes = 3.0, 4000  # 4 KB in 3 s of waiting on the caller, and 0.5 s more now: above the floor
    p.waiting_since = t0 + 10
    assert p.verdict(t0 + 10.5, idle, floor, age) == ""
    p.bytes = 1000  # 1 KB in 3.5 s of waiting: under the floor
    assert "ps.stream_min_rate" in p.verdict(t0 + 10.5, idle, floor, age)
    p.waiting_since = None
    assert "ps.rpc_timeout" in p.verdict(t0 + age + 1, idle, floor, age)


def test_request_strings_are_bounded_at_parse_naming_the_field() -> None:
    parse = serde.deserializer(m.Chunk, bounded=True)
    ok = m.Chunk(data=b"x", push=m.PushHeader("s", 0, 1, 1, "fp32", 1, b"h" * 32, "p" * 128))
    assert parse(serde.serializer(m.Chunk)(ok)) == ok
    too_long = m.Chunk(push=m.PushHeader("s", 0, 1, 1, "fp32", 1, b"h" * 32, "p" * 129))
    with pytest.raises(ProtocolError, match=r"PushHeader.push_id: 129 characters, over its limit of 128"):
        parse(serde.serializer(m.Chunk)(too_long))
    split = m.Chunk(split=m.SplitHeader("s", "train", shape=list(range(9))))
    with pytest.raises(ProtocolError, match=r"SplitHeader.shape: 9 items"):
        parse(serde.serializer(m.Chunk)(split))
    join = serde.deserializer(m.JoinRequest, bounded=True)
    with pytest.raises(ProtocolError, match=r"JoinRequest.site: 65 characters"):
        join(serde.serializer(m.JoinRequest)(m.JoinRequest("s" * 65)))
    assert serde.deserializer(m.JoinRequest)(serde.serializer(m.JoinRequest)(m.JoinRequest("s" * 65))).site  # replies


def test_wire_text_in_logs_is_quoted_escaped_and_cut() -> None:
    assert quote("osc") == "'osc'"
    assert "\n" not in quote("a\nFORGED") and "\\n" in quote("a\nFORGED")
    assert "\x1b" not in quote("\x1b[31mred") and "\x00" not in quote("\x00")
    long = quote("x" * (16 << 20))
    assert len(long) < 120 and long.endswith(f"(+{(16 << 20) - 64} chars)'")


def test_a_cancelled_long_poll_returns_at_once_and_a_waiting_push_stops_waiting() -> None:
    logic = make(rpc_timeout="60s", max_concurrent_pushes=1)
    session = logic.join(m.JoinRequest("osc")).session_id
    init(logic, session)
    who = caller("StreamModel", Principal("session", "osc", handle_of(session)), credential=session)
    ended: list[BaseException] = []

    def long_poll() -> None:
        try:
            list(logic.stream_model(m.ModelRequest(session, 99, 60.0), who))
        except UnavailableError as exc:
            ended.append(exc)

    poll = threading.Thread(target=long_poll)
    poll.start()
    time.sleep(0.3)
    assert poll.is_alive()  # waiting for version 99, for up to 60 s
    who.end()  # the client cancelled: gRPC ends the call
    poll.join(timeout=30)
    assert not poll.is_alive()  # not after its 60 s wait: the end of the call woke it
    assert "the call ended while it waited" in str(ended[0])  # and no model was made for nobody
    # a push waiting for the one receiving slot stops waiting when its call ends
    held = threading.Semaphore(0)
    with logic._receiving.held("another", timedelta(seconds=1), "pushes"):  # the one receiving slot, taken
        pusher = caller("PushDelta", Principal("session", "osc", handle_of(session)), credential=session)
        errors: list[BaseException] = []

        def push() -> None:
            try:
                logic.push_delta(iter(push_chunks(session, 0, {}, push_id="waits")), pusher)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
            held.release()

        threading.Thread(target=push).start()
        time.sleep(0.3)
        pusher.end()
        assert held.acquire(timeout=5)
    assert errors and "ended while it waited" in str(errors[0])
    logic.finish()


def test_one_family_of_sites_never_holds_the_last_quarter_of_a_pool_of_slots() -> None:
    slots = FairSlots(4)
    assert slots.share == 3 and FairSlots(16).share == 12 and FairSlots(2).share == 1 and FairSlots(1).share == 1
    assert all(slots.try_take("osc") for _ in range(3)) and not slots.try_take("osc")  # osc-0, osc-1: one family
    assert slots.try_take("tacc") and not slots.try_take("iitm")  # all four taken
    slots.give_back("tacc")  # a slot is free, but not for osc: it holds its share already
    with pytest.raises(LimitError, match="busy with other pushes"):
        with slots.held("osc", timedelta(milliseconds=300), "pushes"):
            pass
    with slots.held("iitm", timedelta(seconds=1), "pushes"):
        assert slots.in_use == 4
    ended = threading.Event()
    threading.Timer(0.3, ended.set).start()
    with pytest.raises(UnavailableError, match="the call ended while it waited"):
        with slots.held("osc", timedelta(seconds=60), "pushes", ended.is_set):
            pass
    assert slots.in_use == 3


def test_a_federation_of_one_family_uses_every_slot_and_shares_them_once_another_takes_part() -> None:
    logic = make(max_concurrent_pushes=4)
    logic.join(m.JoinRequest("osc-0"))
    logic.join(m.JoinRequest("osc-1"))
    slots = logic._receiving
    assert all(slots.try_take("osc") for _ in range(4))  # one family alone: all four
    logic.join(m.JoinRequest("tacc"))
    slots.give_back("osc")
    assert not slots.try_take("osc") and slots.try_take("tacc")  # osc holds 3, its share with tacc taking part
    logic.finish()
