"""The PS's state on disk: private modes, loose folders refused, tokens kept required, unreadable files set aside."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.ckpt import CheckpointStore, load_tensors, save_tensors
from geofed_hpc.cli import main
from geofed_hpc.errors import AuthError, CheckpointError, ConfigError
from geofed_hpc.ps.statedir import admin_token, check_state_dir, require_tokens, tokens_required
from geofed_hpc.ps.tokens import TokenFile
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from tests.conftest import ps_config, small_params
from tests.dist_util import free_port
from tests.test_faults import FP32, REPO, ones_payload, ps_process
from tests.test_ps_logic import full, init, joined, make, push


# ---------------------------------------------------------------- helpers
def loose(root: Path) -> list[str]:
    """What under `root` (itself included) is not private: folders not 0700, files not 0600 (links are skipped)."""
    found = []
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
        if stat.S_IMODE(st.st_mode) != want:
            found.append(f"{path.relative_to(root.parent)} {stat.S_IMODE(st.st_mode):04o}")
    return found


def tree(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry under `root`: its mode and, for a file, its bytes."""
    return {
        str(p.relative_to(root)): (p.stat().st_mode, p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def ps_up(state: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`geofed-hpc ps up` that is expected to stop at its start (it is killed after 60 s otherwise)."""
    args = ["ps", "up", "ps.port=0", f"ps.state_dir={state}", "codec=fp32", "ps.aggregation=async", *extra]
    return subprocess.run(
        [sys.executable, "-m", "geofed_hpc.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused `ps up` writes, checked to be that: exit 2, no traceback, nothing else on stderr."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    line = result.stderr.strip()
    assert line.startswith("geofed-hpc: error: "), line
    return line


def seeded(state: Path, pushes: int, snapshot_every: int = 1) -> None:
    """A state directory as a crashed in-process PS leaves it: snapshots, downlink updates and, when
    `snapshot_every` > 1, journaled deltas since the newest snapshot."""
    logic = make("async", run_codec="fp32", state_dir=str(state), snapshot_every=snapshot_every)
    (a,) = joined(logic, 1)
    params = init(logic, a)
    for i in range(pushes):
        assert push(logic, a, i, full(params, 1.0), push_id=f"p{i}").accepted
    logic.staging.close()  # a crash: no final snapshot


def remeta(path: Path, **changes: object) -> None:
    """Rewrite a snapshot with its meta changed (None removes a field); its checksum stays valid."""
    tensors, meta = load_tensors(path)
    for key, value in changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    save_tensors(path, tensors, meta, mode=0o600)


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def issue(state: Path, site: str, capsys: pytest.CaptureFixture[str]) -> str:
    """`geofed-hpc token issue`: the token it prints."""
    assert main(["token", "issue", f"site={site}", f"ps.state_dir={state}"]) == 0
    return capsys.readouterr().out.splitlines()[-1]


# ---------------------------------------------------------------- modes
def test_everything_a_running_ps_writes_is_private(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real `ps up` (W&B offline) with a site pushing, a token issued beside it and a kill: every folder under the
    state directory is 0700 and every file 0600: snapshots, journal, updates, tokens, auth record, metrics."""
    state, port = tmp_path / "state", free_port()
    params = small_params()
    with umask(0o022), ps_process(state, port, "", "async", "ps.snapshot_every=100") as proc:
        with PSClient(ps_config(), f"127.0.0.1:{port}") as client:
            client.connect()
            sid = client.join(m.JoinRequest("site-a")).session_id
            init_header = m.PushHeader(sid, 0, 0, 0, "fp32", 0, b"", "init", init=True)
            assert client.push_delta(init_header, codec.encode(params, FP32)).accepted
            for i in range(3):
                header = m.PushHeader(sid, i, 1, 1, "fp32", 0, b"", f"push-{i}")
                assert client.push_delta(header, ones_payload(params)).version == i + 1
        issue(state, "tacc", capsys)  # beside the running PS, as an operator does
        proc.kill()  # the journal keeps the three pushes (the only snapshot is version 0's)
    names = {str(p.relative_to(state)) for p in state.rglob("*")}
    expected = {"global-000000000.gft", "tokens.json", "auth.json", "metrics/ps.metrics.jsonl", "staging"}
    assert expected <= names, names
    assert len([n for n in names if n.startswith("round/") and n.endswith(".push")]) == 3, names
    assert len([n for n in names if n.startswith("updates/update-")]) == 3, names
    assert any(n.startswith("metrics/wandb/") for n in names), names
    assert loose(state) == []


def test_an_in_process_ps_makes_its_files_private_whatever_the_umask(tmp_path: Path) -> None:
    """No umask helps here (a library PS, umask 022): each code path makes its folders 0700 and files 0600."""
    state = tmp_path / "deep" / "state"
    with umask(0o022):
        logic = make("buffered", run_codec="fp32", state_dir=str(state), buffer_size=2, snapshot_every=2)
        a, b = joined(logic, 2)
        params = init(logic, a)
        for i in range(3):  # rounds of two: versions 1 (no snapshot) and, with a round open, a journaled delta
            assert push(logic, a if i % 2 else b, i // 2, full(params, 1.0), push_id=f"p{i}").accepted
        TokenFile(state / "tokens.json").issue("osc", timedelta(0))
        admin_token(state, create=True)
        logic.staging.close()
    assert {"global-000000000.gft", "tokens.json", "auth.json", "admin.token"} <= {p.name for p in state.iterdir()}
    assert list((state / "round").glob("*.push")) and list((state / "updates").iterdir())
    assert loose(tmp_path / "deep") == []  # the folder made on the way too


# ---------------------------------------------------------------- the state directory's own permissions
@pytest.mark.parametrize("mode", [0o775, 0o757])
def test_a_state_dir_other_users_may_write_in_is_refused_and_left_as_it_was(tmp_path: Path, mode: int) -> None:
    state = tmp_path / "state"
    seeded(state, 2, snapshot_every=2)
    state.chmod(mode)
    before = tree(state)
    line = one_line(ps_up(state))
    assert str(state) in line and f"{mode:04o}" in line and f"chmod 700 {state}" in line
    assert tree(state) == before  # nothing written, nothing removed, no mode changed
    assert stat.S_IMODE(state.stat().st_mode) == mode


def test_a_state_dir_an_older_version_left_readable_is_tightened_and_used(tmp_path: Path) -> None:
    state, port = tmp_path / "state", free_port()
    seeded(state, 2)
    for path in [state, *state.rglob("*")]:  # as an older version wrote them, under umask 022
        path.chmod(0o755 if path.is_dir() else 0o644)
    with ps_process(state, port) as proc:
        assert proc.poll() is None
        assert loose(state) == []
        with PSClient(ps_config(), f"127.0.0.1:{port}") as client:
            assert client.join(m.JoinRequest("site-a")).version == 2  # its state was taken, not replaced


def test_check_state_dir_makes_refuses_and_tightens(tmp_path: Path, warnings_log: pytest.LogCaptureFixture) -> None:
    made = check_state_dir(tmp_path / "a" / "b")
    assert loose(tmp_path / "a") == []
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is not a folder"):
        check_state_dir(tmp_path / "file")
    (made / "sub").mkdir(mode=0o755)
    (made / "sub" / "f").write_text("x")
    (made / "sub" / "f").chmod(0o644)
    made.chmod(0o755)
    with warnings_log.at_level(logging.INFO, logger="geofed_hpc"):
        check_state_dir(made)
        assert loose(tmp_path / "a") == []
        lines = {r.getMessage() for r in warnings_log.records if "readable by other users" in r.getMessage()}
        assert len(lines) == 1 and "2 folder(s) 0700 and 1 file(s) 0600" in lines.pop(), lines
        warnings_log.clear()
        check_state_dir(made)  # nothing left to do: no line
        assert not [r for r in warnings_log.records if "readable by other users" in r.getMessage()]
    made.chmod(0o770)
    with pytest.raises(ConfigError, match=rf"ps.state_dir: {made} has mode 0770.*chmod 700 {made}"):
        check_state_dir(made)
    made.chmod(0o1777)  # a shared folder such as /tmp or /dev/shm: no chmod advice
    with pytest.raises(ConfigError, match=rf"ps.staging_dir: {made} has mode 1777.*a folder of your own inside it"):
        check_state_dir(made, "ps.staging_dir")
    made.chmod(0o700)


# ---------------------------------------------------------------- tokens and the admin secret
def test_tokens_required_is_recorded_when_a_token_is_issued(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    state = tmp_path / "state"
    assert not tokens_required(state)
    issue(state, "osc", capsys)
    assert tokens_required(state) and stat.S_IMODE((state / "auth.json").stat().st_mode) == 0o600
    (state / "tokens.json").unlink()
    assert tokens_required(state)  # not inferred from the token file
    require_tokens(state)
    assert json.loads((state / "auth.json").read_text()) == {"format": 1, "tokens_required": True}
    (state / "auth.json").write_text('{"format": 1, "tokens_required": "yes"}')
    with pytest.raises(CheckpointError, match=f"{state / 'auth.json'}: not a geofed auth record"):
        tokens_required(state)


def test_a_ps_started_with_a_token_file_records_that_tokens_are_required(tmp_path: Path) -> None:
    """A token file of an older version (no auth record): the PS's start records it."""
    state = tmp_path / "state"
    TokenFile(state / "tokens.json").issue("osc", timedelta(0))
    (state / "auth.json").unlink()
    make(state_dir=str(state)).staging.close()
    assert tokens_required(state)


def test_a_deleted_token_file_still_requires_a_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`token issue`, then tokens.json is deleted and the PS (re)started: Join still needs a token."""
    state = tmp_path / "state"
    token = issue(state, "osc", capsys)
    (state / "tokens.json").unlink()
    logic = make(state_dir=str(state))
    try:
        assert logic.core.sessions.verifier.required
        with pytest.raises(AuthError):
            logic.join(m.JoinRequest("osc", ""))
        with pytest.raises(AuthError):  # its record went with the file
            logic.join(m.JoinRequest("osc", token))
    finally:
        logic.staging.close()


def test_the_admin_token_is_made_once_kept_private_and_checked(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert admin_token(state, create=False) == "" and not state.exists()
    token = admin_token(state, create=True)
    assert token.startswith("gfa_") and len(token) >= 4 + 43
    assert admin_token(state, create=True) == token == admin_token(state, create=False)
    assert stat.S_IMODE((state / "admin.token").stat().st_mode) == 0o600 and loose(state) == []
    (state / "admin.token").write_text("gfa_short\n")
    with pytest.raises(CheckpointError, match=f"{state / 'admin.token'}: not an admin token"):
        admin_token(state, create=True)


BAD_RECORDS = {
    "id": ("id", "not-hex!"),
    "site": ("site", "../etc"),
    "hash": ("hash", "ABC"),
    "created": ("created", True),
    "expires": ("expires", "soon"),
    "revoked": ("revoked", -1),
    "infinite": ("expires", float("inf")),
}


@pytest.mark.parametrize("field, value", BAD_RECORDS.values(), ids=BAD_RECORDS.keys())
def test_each_field_of_a_token_record_is_checked(tmp_path: Path, field: str, value: object) -> None:
    path = tmp_path / "tokens.json"
    TokenFile(path).issue("osc", timedelta(0))
    _, record = TokenFile(path).issue("tacc", timedelta(days=1))
    raw = json.loads(path.read_text())
    raw["tokens"][1][field] = value
    path.write_text(json.dumps(raw))
    with pytest.raises(
        CheckpointError, match=rf"{re.escape(str(path))}: token record 1.*field '{field}' is .*, not "
    ) as info:
        TokenFile(path).read()
    assert "\n" not in str(info.value)
    if field != "id":
        assert record.id in str(info.value)


def test_a_token_record_with_a_malformed_expiry_stops_ps_up_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    issue(state, "osc", capsys)
    raw = json.loads((state / "tokens.json").read_text())
    raw["tokens"][0]["expires"] = "next week"
    (state / "tokens.json").write_text(json.dumps(raw))
    line = one_line(ps_up(state))
    assert str(state / "tokens.json") in line and "token record 0" in line and "field 'expires'" in line


# ---------------------------------------------------------------- snapshots
BAD_META = {
    "no version": ({"version": None}, "'version'"),
    "version a string": ({"version": "1"}, "'version'"),
    "sessions not rows": ({"sessions": [["id", "x"]]}, "'sessions'"),
    "push id row short": ({"push_ids": [["p0", True, 1, ""]]}, "'push_ids'"),
    "strategy": ({"strategy": {"recent_tokens": ["many"]}}, "'strategy'"),
    "settings": ({"settings": ["async"]}, "'settings'"),
    "format": ({"format": 9}, "'format'"),
}


@pytest.mark.parametrize("changes, field", BAD_META.values(), ids=BAD_META.keys())
def test_a_newest_snapshot_with_a_malformed_field_is_set_aside_for_an_older_one(
    tmp_path: Path, changes: dict, field: str, warnings_log: pytest.LogCaptureFixture
) -> None:
    seeded(tmp_path, 1)
    newest = CheckpointStore(tmp_path, prefix="global").path_for(1)
    remeta(newest, **changes)
    restarted = make("async", run_codec="fp32", state_dir=str(tmp_path))
    assert restarted.version == 0
    aside = tmp_path / "set-aside" / newest.name
    assert aside.exists() and not newest.exists() and stat.S_IMODE(aside.parent.stat().st_mode) == 0o700
    errors = [r.getMessage() for r in warnings_log.records if r.levelno == logging.ERROR]
    assert any(str(newest) in e and field in e and str(aside) in e for e in errors), errors
    (a,) = joined(restarted, 1)
    for i in range(3):  # new snapshots are pruned to two; the one set aside is never pruned
        assert push(restarted, a, i, full(small_params(), 1.0), push_id=f"again-{i}").accepted
    assert aside.exists() and [s for s, _ in CheckpointStore(tmp_path, prefix="global").files()] == [2, 3]
    restarted.finish()


def test_a_newest_snapshot_that_is_corrupt_is_set_aside_not_pruned_later(tmp_path: Path) -> None:
    seeded(tmp_path, 1)
    newest = CheckpointStore(tmp_path, prefix="global").path_for(1)
    data = bytearray(newest.read_bytes())
    data[-60] ^= 0xFF
    newest.write_bytes(bytes(data))
    restarted = make("async", run_codec="fp32", state_dir=str(tmp_path))
    assert restarted.version == 0
    assert (tmp_path / "set-aside" / newest.name).read_bytes() == bytes(data)
    restarted.finish()


def test_the_only_snapshot_missing_a_field_stops_ps_up_in_one_line(tmp_path: Path) -> None:
    state = tmp_path / "state"
    seeded(state, 0)
    only = CheckpointStore(state, prefix="global").path_for(0)
    remeta(only, version=None)
    before = tree(state)
    line = one_line(ps_up(state))
    assert only.name in line and "'version'" in line and "restore one from a copy" in line
    assert tree(state) == before


def test_when_no_snapshot_loads_ps_up_stops_in_one_line_and_keeps_every_file(tmp_path: Path) -> None:
    state = tmp_path / "state"
    seeded(state, 3, snapshot_every=2)  # snapshots of versions 0 and 2, the push of version 2 journaled
    store = CheckpointStore(state, prefix="global")
    assert [s for s, _ in store.files()] == [0, 2] and len(list((state / "round").glob("*.json"))) == 1
    store.path_for(2).write_bytes(store.path_for(2).read_bytes()[:-100])  # truncated
    remeta(store.path_for(0), push_ids=[["p", True]])  # readable, one field malformed
    before = tree(state)
    line = one_line(ps_up(state))
    assert "none of the 2 snapshot(s)" in line and "global-000000002.gft is truncated" in line
    assert "global-000000000.gft has a malformed meta field 'push_ids'" in line
    assert "restore one from a copy, or move them out of" in line
    assert tree(state) == before  # the snapshots and the journal are all still there, untouched


def test_a_snapshot_that_cannot_be_restored_names_its_file_and_field(tmp_path: Path) -> None:
    seeded(tmp_path, 0)
    only = CheckpointStore(tmp_path, prefix="global").path_for(0)
    remeta(only, sessions=[{"id": "x"}])  # a row with an id and nothing a session needs
    with pytest.raises(CheckpointError, match=rf"snapshot {only}: its 'sessions' cannot be restored") as info:
        make("async", run_codec="fp32", state_dir=str(tmp_path))
    assert "\n" not in str(info.value) and only.exists()


# ---------------------------------------------------------------- the round journal
def test_damaged_journal_entries_are_set_aside_with_a_line_each_never_deleted(
    tmp_path: Path, warnings_log: pytest.LogCaptureFixture
) -> None:
    logic = make("buffered", run_codec="fp32", state_dir=str(tmp_path), buffer_size=9)
    sites = joined(logic, 4)
    params = init(logic, sites[0])
    for i, site in enumerate(sites):
        assert push(logic, site, 0, full(params, 1.0), push_id=f"p{i}").accepted
    logic.staging.close()  # a crash with the round open
    entries = sorted((tmp_path / "round").glob("*.json"))
    assert len(entries) == 4
    entries[0].write_text("{not json")
    meta = json.loads(entries[1].read_text())
    meta["header"]["base_version"] = "0"
    entries[1].write_text(json.dumps(meta))
    payload = entries[2].with_suffix(".push")
    payload.write_bytes(payload.read_bytes()[::-1])
    damaged = {p: p.read_bytes() for e in entries[:3] for p in (e, e.with_suffix(".push"))}
    orphan = tmp_path / "round" / "00000000000000000001-0123456789abcdef.push"  # killed before its header
    orphan.write_bytes(b"never acknowledged")

    restarted = make("buffered", run_codec="fp32", state_dir=str(tmp_path), buffer_size=9)
    assert restarted.rounds.count == 1  # the intact entry
    aside = tmp_path / "round" / "set-aside"
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == {p.name: b for p, b in damaged.items()}
    assert not orphan.exists()
    errors = [r.getMessage() for r in warnings_log.records if r.levelno == logging.ERROR]
    whys = ["not valid JSON", "'base_version' is '0'", "does not match its checksum"]
    for entry, why in zip(entries[:3], whys, strict=True):
        assert sum(str(entry) in e and why in e and "set aside" in e for e in errors) == 1, (why, errors)
    restarted.finish()


def test_journal_entries_with_no_snapshot_to_fold_into_are_set_aside(
    tmp_path: Path, warnings_log: pytest.LogCaptureFixture
) -> None:
    """The operator moved the snapshots away: the journaled deltas are kept aside, and a site re-seeds the PS."""
    seeded(tmp_path, 2, snapshot_every=100)
    journaled = {p.name: p.read_bytes() for p in (tmp_path / "round").iterdir() if p.is_file()}
    assert len(journaled) == 4
    moved = tmp_path.parent / f"{tmp_path.name}-snapshots"
    moved.mkdir()
    for _, path in CheckpointStore(tmp_path, prefix="global").files():
        path.rename(moved / path.name)
    restarted = make("async", run_codec="fp32", state_dir=str(tmp_path))
    assert not restarted.initialized
    aside = tmp_path / "round" / "set-aside"
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == journaled
    assert any("no snapshot to fold them into" in r.getMessage() for r in warnings_log.records)
    (a,) = joined(restarted, 1)
    seed = init(restarted, a, small_params(4))
    assert restarted.version == 0 and restarted.core.model.params is not None
    assert np.array_equal(restarted.core.model.params["wte.weight"], seed["wte.weight"])
    assert {p.name for p in aside.iterdir()} == set(journaled)  # a new model does not clear them
    restarted.finish()
