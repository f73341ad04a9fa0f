"""Per-site enrollment tokens (issue, revoke, list, expiry) and session limits, in memory and over real gRPC."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from geofed_hpc.cli import main
from geofed_hpc.config import PSConfig, RunConfig
from geofed_hpc.errors import AuthError, ConfigError, LimitError, ProtocolError
from geofed_hpc.ps.app import ParameterServer
from geofed_hpc.ps.sessions import handle_of
from geofed_hpc.ps.tokens import TokenFile, TokenVerifier, tokens_path
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from tests.conftest import ps_config
from tests.test_ps_logic import Clock, make


def issue(state: Path, site: str, *extra: str, capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """`geofed-hpc token issue`; (token, id) from what it prints."""
    assert main(["token", "issue", f"site={site}", f"ps.state_dir={state}", *extra]) == 0
    out = capsys.readouterr().out.splitlines()
    token = out[-1]
    assert token.startswith("gft_") and out[0].startswith("token ")
    return token, out[0].split()[1]


def test_issue_list_revoke_by_command_keep_only_hashes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    osc, osc_id = issue(state, "osc", "--ttl", "2h", capsys=capsys)
    tacc, _ = issue(state, "tacc", capsys=capsys)
    path = tokens_path(str(state))
    text = path.read_text()
    assert osc not in text and tacc not in text and osc.split("_", 2)[2] not in text  # only hashes on disk
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    rows = json.loads(text)["tokens"]
    assert [r["site"] for r in rows] == ["osc", "tacc"]
    assert rows[0]["expires"] - rows[0]["created"] == pytest.approx(7200)
    assert rows[1]["expires"] - rows[1]["created"] == pytest.approx(PSConfig().token_ttl.total_seconds())
    assert not [p for p in state.iterdir() if p.name.startswith(".tokens.json.") and "lock" not in p.name]

    assert main(["token", "list", f"ps.state_dir={state}"]) == 0
    listed = capsys.readouterr().out
    assert osc_id in listed and "valid" in listed and osc not in listed and tacc not in listed

    assert main(["token", "revoke", osc_id, f"ps.state_dir={state}"]) == 0
    assert osc_id in capsys.readouterr().out
    assert main(["token", "list", f"ps.state_dir={state}"]) == 0
    assert [ln.split()[-1] for ln in capsys.readouterr().out.splitlines()[1:]] == ["revoked", "valid"]
    # Revoking again, revoking nothing, or no state directory: one line naming what to fix.
    assert main(["token", "revoke", osc_id, f"ps.state_dir={state}"]) == 2
    assert "no unrevoked token" in capsys.readouterr().err
    assert main(["token", "revoke", f"ps.state_dir={state}"]) == 2
    assert "name a token id" in capsys.readouterr().err
    assert main(["token", "issue", "site=osc"]) == 2
    assert "ps.state_dir" in capsys.readouterr().err
    assert main(["token", "issue", f"ps.state_dir={state}"]) == 2
    assert "site=osc" in capsys.readouterr().err


def test_verifier_refuses_wrong_site_expired_revoked_unknown_and_logs_no_secret(
    tmp_path: Path, warnings_log: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tokens.json"
    now = [1_000_000.0]
    tokens = TokenFile(path, clock=lambda: now[0])
    good, rec = tokens.issue("osc", timedelta(hours=1))
    short, _ = tokens.issue("osc", timedelta(seconds=10))
    logic = make(state_dir=str(tmp_path))
    logic.core.sessions.verifier = TokenVerifier(path, clock=lambda: now[0])
    sid = logic.join(m.JoinRequest("osc-0", good)).session_id  # osc's token admits its numbered jobs
    assert logic.core.sessions.sessions[handle_of(sid)].token_id == rec.id
    assert logic.join(m.JoinRequest("osc", short)).session_id
    cases = [
        ("for site 'osc', not this one", m.JoinRequest("tacc", good)),
        ("unknown or wrong", m.JoinRequest("osc", good[:-2] + "xx")),
        ("unknown or wrong", m.JoinRequest("osc", "gft_nothere_abc")),
        ("unknown or wrong", m.JoinRequest("osc", "")),
        ("characters refused", m.JoinRequest("osc", "x" * 100_000)),
    ]
    now[0] += 11
    cases.append(("is expired", m.JoinRequest("osc", short)))
    for why, request in cases:
        with pytest.raises(AuthError, match=why):
            logic.join(request)
    with pytest.raises(ProtocolError, match="site name"):
        logic.join(m.JoinRequest("osc\nFAKE LOG LINE", good))
    tokens.revoke(site="osc")
    with pytest.raises(AuthError, match="revoked"):
        logic.join(m.JoinRequest("osc", good))
    with pytest.raises(AuthError, match="revoked"):  # the session that joined with it ends too
        logic.heartbeat(m.HeartbeatRequest(sid))
    assert handle_of(sid) not in logic.core.sessions.sessions
    refused = [r.getMessage() for r in warnings_log.records if "refused" in r.getMessage()]
    assert len(refused) >= 6
    assert not [line for line in refused if good.split("_", 2)[2] in line or short.split("_", 2)[2] in line]


def test_shared_enroll_token_still_admits_any_site_alongside_issued_tokens(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    issued, _ = TokenFile(path).issue("osc", timedelta(0))
    logic = make(enroll_token="demo-secret", state_dir=str(tmp_path))
    assert logic.join(m.JoinRequest("anything", "demo-secret")).session_id
    assert logic.join(m.JoinRequest("osc", issued)).session_id
    with pytest.raises(AuthError):
        logic.join(m.JoinRequest("tacc", issued))


def test_a_removed_token_file_does_not_open_the_ps(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    issued, _ = TokenFile(path).issue("osc", timedelta(0))
    logic = make(state_dir=str(tmp_path))
    assert logic.join(m.JoinRequest("osc", issued)).session_id
    path.unlink()
    with pytest.raises(AuthError):
        logic.join(m.JoinRequest("osc", issued))
    with pytest.raises(AuthError):
        logic.join(m.JoinRequest("osc", ""))


def test_sessions_per_site_and_in_all_are_bounded_under_a_flood_of_joins() -> None:
    clock = Clock()
    logic = make(clock=clock, max_sessions_per_site=3, max_sessions=20)
    first = [logic.join(m.JoinRequest("osc")).session_id for _ in range(3)]
    with pytest.raises(LimitError, match="ps.max_sessions_per_site=3"):
        logic.join(m.JoinRequest("osc"))
    clock.now += 1
    logic.heartbeat(m.HeartbeatRequest(first[1]))
    logic.heartbeat(m.HeartbeatRequest(first[2]))
    clock.now += logic.core.sessions.idle_after  # first[0] went idle, the others were seen a moment later
    logic.heartbeat(m.HeartbeatRequest(first[1]))
    logic.heartbeat(m.HeartbeatRequest(first[2]))
    fresh = logic.join(m.JoinRequest("osc")).session_id  # the idle session makes room
    assert set(logic.core.sessions.sessions) == {handle_of(s) for s in (first[1], first[2], fresh)}
    # A flood of joins under many site names: the table never grows past ps.max_sessions.
    refused = 0
    for i in range(2000):
        try:
            logic.join(m.JoinRequest(f"flood-{i}"))
        except LimitError:
            refused += 1
        assert len(logic.core.sessions.sessions) <= 20
        if i % 500 == 499:
            clock.now += logic.core.sessions.idle_after + 1  # the flood's sessions go idle and are replaced
    assert refused > 1900 and len(logic.core.sessions.sessions) == 20


def test_rejoin_must_name_the_same_site() -> None:
    logic = make()
    first = logic.join(m.JoinRequest("osc"))
    with pytest.raises(AuthError, match="already used"):
        logic.join(m.JoinRequest("tacc", first.rejoin_token, resume_session=first.session_id))
    assert logic.join(m.JoinRequest("osc", first.rejoin_token, resume_session=first.session_id)).session_id


def test_running_ps_sees_issued_and_revoked_tokens_over_grpc(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    state = tmp_path / "state"
    server = ParameterServer(replace(RunConfig(), ps=ps_config(state_dir=str(state), aggregation="async")))
    try:
        with PSClient(server.cfg.ps, server.address) as client:
            client.connect()
            assert client.join(m.JoinRequest("osc")).session_id  # no token issued yet: an open PS
            token, token_id = issue(state, "osc", capsys=capsys)
            with pytest.raises(AuthError, match="enrollment token refused"):
                client.join(m.JoinRequest("osc", "not-a-token"))
            with pytest.raises(AuthError, match="not this one"):
                client.join(m.JoinRequest("tacc", token))
            joined = client.join(m.JoinRequest("osc-0", token))
            again = client.join(m.JoinRequest("osc-0", joined.rejoin_token, resume_session=joined.session_id))
            with pytest.raises(AuthError, match="already used"):  # a replayed rejoin token
                client.join(m.JoinRequest("osc-0", joined.rejoin_token, resume_session=joined.session_id))
            assert client.heartbeat(m.HeartbeatRequest(again.session_id)).version == 0
            assert main(["token", "revoke", "site=osc", f"ps.state_dir={state}"]) == 0
            assert token_id in capsys.readouterr().out
            with pytest.raises(AuthError, match="revoked"):
                client.heartbeat(m.HeartbeatRequest(again.session_id))
            with pytest.raises(AuthError, match="revoked"):
                client.join(m.JoinRequest("osc-0", token))
            assert client.health() == "SERVING"
    finally:
        server.stop()


def test_session_limits_are_validated() -> None:
    with pytest.raises(ConfigError, match="ps.max_sessions_per_site"):
        PSConfig(max_sessions_per_site=0)
    with pytest.raises(ConfigError, match="ps.max_sessions:"):
        PSConfig(max_sessions=4, max_sessions_per_site=8)
    with pytest.raises(ConfigError, match="ps.token_ttl"):
        PSConfig(token_ttl="soon")


def test_merging_a_peers_records_adds_its_tokens_and_its_earliest_revocations(tmp_path: Path) -> None:
    mine, theirs = TokenFile(tmp_path / "a" / "tokens.json"), TokenFile(tmp_path / "b" / "tokens.json")
    assert mine.merge([]) == [] and not mine.path.exists()  # nothing to take: no token file appears
    _, kept = mine.issue("osc", timedelta(days=1))
    _, given = theirs.issue("tacc", timedelta(0))
    assert mine.merge(theirs.read()) == [given.id] and {r.id for r in mine.read()} == {kept.id, given.id}
    stamp = mine.path.stat().st_mtime_ns
    assert mine.merge(theirs.read()) == [] and mine.path.stat().st_mtime_ns == stamp  # unchanged: not rewritten
    theirs.merge(mine.read())
    theirs.revoke(token_id=kept.id)
    later = replace(next(r for r in theirs.read() if r.id == kept.id), revoked=1e12)
    assert mine.merge([later]) == [kept.id]  # revoked there: revoked here
    revoked = next(r for r in theirs.read() if r.id == kept.id).revoked
    assert mine.merge(theirs.read()) == [kept.id]  # an earlier revocation time wins
    assert next(r for r in mine.read() if r.id == kept.id).revoked == revoked
    assert mine.merge([later]) == []  # a later one changes nothing


def test_a_token_file_mangled_under_a_running_ps_keeps_the_tokens_read_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tokens.json"
    token, record = TokenFile(path).issue("osc", timedelta(days=1))
    verifier = TokenVerifier(path)
    assert [r.id for r in verifier.records() or []] == [record.id]
    path.write_text("{not json")
    with caplog.at_level("ERROR", logger="geofed_hpc"):
        assert verifier.check("osc", token) == record.id  # still admitted: the last good read holds
        assert verifier.records() is None and not verifier.readable  # nothing to share with a PS group's peers
        verifier.check("osc", token)
    assert sum("cannot be read" in r.getMessage() for r in caplog.records) == 1  # read once per change, not per call
    TokenFile(path).path.unlink()
    TokenFile(path).issue("tacc", timedelta(0))
    assert [r.site for r in verifier.records() or []] == ["tacc"] and verifier.readable  # mended: read again
    assert TokenVerifier(None).records() is None


def test_tokens_issued_together_each_admit_only_their_own_site(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    issued = TokenFile(path).issue_many(["a", "b", "c"], timedelta(days=1))
    assert [r.site for r in TokenFile(path).read()] == ["a", "b", "c"]
    assert len({token for token, _ in issued}) == 3 and all(token not in path.read_text() for token, _ in issued)
    verifier = TokenVerifier(path)
    for site, (token, record) in zip("abc", issued, strict=True):
        assert verifier.check(site, token) == record.id
    with pytest.raises(AuthError, match="is for site 'a'"):
        verifier.check("b", issued[0][0])
    with pytest.raises(ConfigError):
        TokenFile(path).issue_many(["ok", "not a name"], timedelta(days=1))
    assert len(TokenFile(path).read()) == 3  # a bad name issues none of them
