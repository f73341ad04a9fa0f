"""Injected faults (killed PS and sites, full disks, torn checkpoints, partitions): every delta lands exactly once."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from geofed_hpc import codec, faults
from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.ckpt.atomic import TEMP_MARKER
from geofed_hpc.config import CodecConfig
from geofed_hpc.errors import ProtocolError, UnavailableError
from geofed_hpc.ps.app import ParameterServer
from geofed_hpc.ps.sessions import handle_of
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from geofed_hpc.testing.partition import Partition
from tests.conftest import ps_config, small_params
from tests.dist_util import free_port
from tests.site_procs import Site, events, wait_for
from tests.test_ps_logic import expect, full, init, joined, make, push
from tests.test_site_client import BATCH, MODEL, latest, make_ps, metrics, run_site, shards, site_cfg

__all__ = ["shards"]  # the module-scoped token shards fixture, shared with test_site_client
FP32 = CodecConfig(name="fp32")
REPO = Path(__file__).resolve().parents[1]


def test_fault_plans_parse_fire_on_the_nth_matching_hit_and_cost_nothing_unset() -> None:
    assert faults.parse("") == []
    with pytest.raises(ValueError, match="bad fault 'x=boom'"):
        faults.parse("x=boom")
    faults.install("atomic.write[global]@2=enospc")
    try:
        faults.fault("atomic.write", "site-00000001.gft")  # another label: not counted
        faults.fault("atomic.write", "global-00000001.gft")
        with pytest.raises(OSError, match="No space left") as info:
            faults.fault("atomic.write", "global-00000002.gft")
        assert info.value.errno == 28
        faults.fault("atomic.write", "global-00000003.gft")  # fired once
    finally:
        faults.install("")
    assert faults._PLAN == []


@contextmanager
def ps_process(
    state: Path, port: int, plan: str = "", aggregation: str = "async", *overrides: str
) -> Iterator[subprocess.Popen]:
    """`geofed-hpc ps up` (async by default, fp32, a snapshot every version) as a real process on a fixed port."""
    env = {**os.environ, faults.ENV: plan}
    args = ["ps", "up", f"ps.port={port}", f"ps.state_dir={state}", "codec=fp32", f"ps.aggregation={aggregation}"]
    args += overrides
    proc = subprocess.Popen(
        [sys.executable, "-m", "geofed_hpc.cli", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for _ in range(50):
            line = proc.stdout.readline()
            if re.search(r"^parameter server on ", line) or not line:
                break
        assert "parameter server on" in line, line
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()


def ones_payload(params: dict) -> bytes:
    return codec.encode({k: np.ones_like(v) for k, v in params.items()}, FP32)


# (fault plan, the version the restarted PS comes back at, whether resending the cut push is a duplicate)
PS_KILLS = {
    # killed after push 2's delta was journaled and summed, before it was applied: the snapshot of version 1 and
    # the journal replayed after it bring the PS back to version 2, so the resend is a duplicate
    "mid-aggregation": ("ps.aggregate@2=kill", 2, True),
    # killed while writing the snapshot of version 2 (temp file written, not renamed): version 1 and the journal
    "mid-snapshot": ("atomic.write[global]@3=kill", 2, True),
    # killed after the snapshot of version 2 was written, before push 2 was answered: it is remembered there
    "after-snapshot": ("ps.snapshot@3=kill", 2, True),
}


@pytest.mark.parametrize("plan, restart_version, duplicate", PS_KILLS.values(), ids=PS_KILLS.keys())
def test_ps_sigkilled_then_restarted_loses_no_delta_and_applies_none_twice(
    tmp_path: Path, plan: str, restart_version: int, duplicate: bool
) -> None:
    state, port = tmp_path / "state", free_port()
    params = small_params()
    cfg = ps_config(connect_timeout="60s", retry_budget="3s")  # a dead PS is noticed fast
    address = f"127.0.0.1:{port}"
    versions = []
    headers = [m.PushHeader("", i, 1, 1, "fp32", 0, b"", f"push-{i}") for i in range(4)]
    with ps_process(state, port, plan) as proc, PSClient(cfg, address) as client:
        client.connect()
        joined_ = client.join(m.JoinRequest("site-a"))
        sid = joined_.session_id
        init_header = m.PushHeader(sid, 0, 0, 0, "fp32", 0, b"", "init", init=True)
        assert client.push_delta(init_header, codec.encode(params, FP32)).accepted
        headers[0].session_id = sid
        versions.append(client.push_delta(headers[0], ones_payload(params)).version)
        headers[1].session_id = sid
        with pytest.raises(UnavailableError):  # the PS dies while handling push 2
            client.push_delta(headers[1], ones_payload(params))
        assert proc.wait(timeout=30) == -9
    torn = [p for p in state.iterdir() if TEMP_MARKER in p.name]
    assert bool(torn) == plan.startswith("atomic.write")  # only the mid-snapshot kill leaves a torn temp file
    with ps_process(state, port) as proc, PSClient(cfg, address) as client:
        client.connect()
        assert client.status().version == restart_version
        again = client.join(m.JoinRequest("site-a", joined_.rejoin_token, resume_session=sid))  # session restored
        assert handle_of(again.session_id) == handle_of(sid)  # the same session, with a new secret
        sid = headers[0].session_id = headers[1].session_id = again.session_id
        resent = client.push_delta(headers[1], ones_payload(params))  # the site's retransmission, same push id
        assert resent.accepted and resent.duplicate == duplicate
        versions.append(resent.version)
        assert client.push_delta(headers[0], ones_payload(params)).duplicate  # an old resend: not applied again
        for h in headers[2:]:
            h.session_id, h.base_version = sid, versions[-1]
            versions.append(client.push_delta(h, ones_payload(params)).version)
        _, payload = client.pull_model(sid)
    assert versions == [1, 2, 3, 4]  # continuous
    model = codec.decode(payload)
    for k, v in params.items():  # every delta exactly once: Θ0 + 4 · 1
        np.testing.assert_allclose(model[k], v + 4, rtol=0, atol=1e-5)
    assert not any(TEMP_MARKER in p.name for p in state.iterdir())


def test_a_ps_sigkilled_with_a_sync_round_open_keeps_the_accepted_delta(tmp_path: Path) -> None:
    """Sync mode: site A's push is journaled and the PS is SIGKILLed before it answers (the round waits for B).
    The restarted PS replays the open round: A's retransmission is a duplicate, B's push closes the round, and
    the global model is Θ0 + mean(1, 3)."""
    state, port = tmp_path / "state", free_port()
    params = small_params()
    cfg = ps_config(connect_timeout="60s", retry_budget="3s")  # a dead PS is noticed fast
    address = f"127.0.0.1:{port}"
    with ps_process(state, port, "ps.journal@1=kill", aggregation="sync") as proc, PSClient(cfg, address) as client:
        client.connect()
        a, b = (client.join(m.JoinRequest(name)) for name in ("site-a", "site-b"))
        init_header = m.PushHeader(a.session_id, 0, 0, 0, "fp32", 0, b"", "init", init=True)
        assert client.push_delta(init_header, codec.encode(params, FP32)).accepted
        push_a = m.PushHeader(a.session_id, 0, 1, 1, "fp32", 0, b"", "push-a")
        with pytest.raises(UnavailableError):  # killed after the journal has it, before the reply
            client.push_delta(push_a, codec.encode({k: np.ones_like(v) for k, v in params.items()}, FP32))
        assert proc.wait(timeout=30) == -9
    assert len(list((state / "round").glob("*.json"))) == 1
    with ps_process(state, port, aggregation="sync") as proc, PSClient(cfg, address) as client:
        client.connect()
        assert client.status().version == 0 and client.status().pending_deltas == 1
        resent = client.push_delta(push_a, codec.encode({k: np.ones_like(v) for k, v in params.items()}, FP32))
        assert resent.accepted and resent.duplicate and resent.version == 0
        push_b = m.PushHeader(b.session_id, 0, 1, 1, "fp32", 0, b"", "push-b")
        reply = client.push_delta(push_b, codec.encode({k: np.full_like(v, 3.0) for k, v in params.items()}, FP32))
        assert reply.accepted and not reply.duplicate
        header, payload = client.pull_model(a.session_id, 1, timedelta(seconds=30))
    assert header.version == 1
    model = codec.decode(payload)
    for k, v in params.items():  # A's delta exactly once
        np.testing.assert_allclose(model[k], v + 2.0, rtol=0, atol=1e-6)
    assert not list((state / "round").iterdir())  # the snapshot of version 1 holds the round


@pytest.mark.parametrize("rule", ["none", "trimmed_mean"])
def test_a_restart_replays_the_journaled_open_round_and_sets_aside_a_damaged_entry(tmp_path: Path, rule: str) -> None:
    """Buffered mode (K=3), in memory: two deltas are journaled, the PS is abandoned without a shutdown (a crash),
    one entry's payload is cut short on disk. The restart replays the intact one and sets the damaged one aside (kept,
    never replayed); the damaged push's retransmission is applied as new; the third closes the round with exactly
    the three deltas."""
    kw = {"state_dir": str(tmp_path), "buffer_size": 3, "robust": rule, "trim_fraction": 0.0}
    logic = make("buffered", **kw)
    a, b, c = joined(logic, 3)
    params = init(logic, a)
    assert push(logic, a, 0, full(params, 1.0), push_id="pa").accepted
    assert push(logic, b, 0, full(params, 2.0), push_id="pb").accepted
    entries = sorted((tmp_path / "round").glob("*.push"))
    assert len(entries) == 2 and logic.version == 0
    damaged = next(p for p in entries if json.loads(p.with_suffix(".json").read_text())["header"]["push_id"] == "pb")
    damaged.write_bytes(damaged.read_bytes()[:-7])  # a torn disk write
    restarted = make("buffered", **kw)  # the first one never finished: its round lives only in the journal
    assert restarted.version == 0 and restarted.rounds.count == 1
    assert push(restarted, a, 0, full(params, 1.0), push_id="pa").duplicate
    assert not push(restarted, b, 0, full(params, 2.0), push_id="pb").duplicate
    assert push(restarted, c, 0, full(params, 6.0), push_id="pc").accepted
    assert restarted.version == 1
    expect(restarted, a, {k: v + 3.0 for k, v in params.items()}, 1, atol=1e-6)  # mean(1, 2, 6)
    assert [p.name for p in (tmp_path / "round").iterdir()] == ["set-aside"]
    assert sorted(p.name for p in (tmp_path / "round" / "set-aside").iterdir()) == [
        damaged.with_suffix(".json").name,
        damaged.name,
    ]
    restarted.finish()


def test_a_push_id_never_becomes_a_path_in_the_round_journal(tmp_path: Path) -> None:
    """Push ids come from sites: one with a path's separators is refused, one that is a path component ("..") is
    journaled inside the journal directory and replayed like any other."""
    state = tmp_path / "state"
    logic = make("buffered", state_dir=str(state), buffer_size=2)
    a, _ = joined(logic, 2)
    params = init(logic, a)
    with pytest.raises(ProtocolError, match="is not 1-128 letters, digits"):
        push(logic, a, 0, full(params, 1.0), push_id="../../outside/x")
    hostile = ".."
    assert push(logic, a, 0, full(params, 1.0), push_id=hostile).accepted
    assert sorted(p.suffix for p in (state / "round").iterdir()) == [".json", ".push"]
    assert not (tmp_path / "outside").exists() and not (state / "outside").exists()
    restarted = make("buffered", state_dir=str(state), buffer_size=2)
    assert restarted.rounds.count == 1 and push(restarted, a, 0, full(params, 1.0), push_id=hostile).duplicate
    restarted.finish()


def test_full_disk_during_a_ps_snapshot_is_survived_and_the_next_snapshot_lands(tmp_path: Path) -> None:
    logic = make("async", run_codec="fp32", state_dir=str(tmp_path))
    (a,) = joined(logic, 1)
    params = init(logic, a)  # snapshot 1 (version 0)
    faults.install("atomic.write[global]@1=enospc")
    try:
        assert push(logic, a, 0, {k: np.ones_like(v) for k, v in params.items()}, push_id="p1").accepted
    finally:
        faults.install("")
    assert logic.version == 1 and logic.snapshot_version == 0  # the write failed; the PS goes on
    assert not any(TEMP_MARKER in p.name for p in tmp_path.iterdir())
    assert push(logic, a, 1, {k: np.ones_like(v) for k, v in params.items()}, push_id="p2").accepted
    assert logic.snapshot_version == 2
    logic.finish()
    restarted = make("async", run_codec="fp32", state_dir=str(tmp_path))
    assert restarted.version == 2
    assert push(restarted, a, 2, {k: np.ones_like(v) for k, v in params.items()}, push_id="p1").duplicate
    restarted.finish()


def test_full_disk_during_a_checkpoint_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, prefix="site", keep=2)
    store.save(1, {"w": np.ones(1000, np.float32)}, {"syncs": 1})
    faults.install("atomic.write[site]@1=enospc")
    try:
        with pytest.raises(OSError, match="No space left"):
            store.save(2, {"w": np.full(1000, 2, np.float32)}, {"syncs": 2})
    finally:
        faults.install("")
    loaded = store.load_latest()
    assert loaded is not None and loaded[1]["syncs"] == 1
    assert not any(TEMP_MARKER in p.name for p in tmp_path.iterdir())


# ---------------------------------------------------------------- site processes (slow: real FSDP2 training)
def site_pushes(ps: ParameterServer, site: str = "local-0") -> int:
    return sum(s.pushes for s in ps.logic.status(m.StatusRequest()).sites if s.site == site)


def synced(folder: Path) -> list[tuple[int, int]]:
    """(sync index, global version after it) of every sync the site recorded."""
    return [(int(r["sync/index"]), int(r["sync/version"])) for r in metrics(folder) if "train/loss" in r]


@pytest.mark.slow
def test_site_killed_mid_push_resumes_and_no_delta_is_lost_or_applied_twice(
    tmp_path: Path, shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ps = make_ps(tmp_path, aggregation="async")
    try:
        monkeypatch.setenv(faults.ENV, "rpc.push@3=kill")  # push 1 uploads the model, 2 is sync 1, 3 is cut
        site = Site(site_cfg(tmp_path, shards, max_syncs=3), tmp_path, ps.address)
        try:
            assert site.wait(timeout=600) == [-9], site.output()
        finally:
            site.close()
        assert "fault injected: kill at rpc.push" in site.output()
        assert ps.logic.version == 1 and site_pushes(ps) == 1  # the cut push was never applied
        monkeypatch.delenv(faults.ENV)
        run_site(tmp_path, shards, ps, max_syncs=3)
        assert ps.logic.version == 3 and site_pushes(ps) == 3  # each sync's delta exactly once
    finally:
        ps.stop()
    assert synced(tmp_path) == [(1, 1), (2, 2), (3, 3)]
    ready = [e["source"] for e in events(tmp_path / "run" / "sites" / "local-0") if e["event"] == "ready"]
    assert ready == ["fresh", "local"]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_or_truncated_site_checkpoint_falls_back_and_the_federation_continues(
    tmp_path: Path, shards: Path, damage: str
) -> None:
    ps = make_ps(tmp_path, aggregation="async")
    try:
        run_site(tmp_path, shards, ps, max_syncs=2)
        _, _, path = latest(tmp_path)
        data = bytearray(path.read_bytes())
        if damage == "truncate":
            path.write_bytes(bytes(data[: len(data) // 2]))
        else:
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        run_site(tmp_path, shards, ps, max_syncs=3)
        # The damaged file is skipped: the site resumes from sync 1's checkpoint; its record of sync 2's push,
        # which the PS applied, makes it skip sync 2's batches and go on from the global model with sync 3.
        assert ps.logic.version == 3 and site_pushes(ps) == 3
    finally:
        ps.stop()
    assert synced(tmp_path) == [(1, 1), (2, 2), (3, 3)]  # versions continuous, each delta once, no batch twice
    ready = [e["source"] for e in events(tmp_path / "run" / "sites" / "local-0") if e["event"] == "ready"]
    assert ready == ["fresh", "global"]
    _, meta, _ = latest(tmp_path)
    assert meta["version"] == 3 and meta["syncs"] == 3 and meta["sampler"]["draws"] == 9


@pytest.mark.slow
def test_partition_between_a_site_and_the_ps_heals_and_every_delta_lands_once(tmp_path: Path, shards: Path) -> None:
    ps = make_ps(tmp_path, aggregation="async")
    host, port = ps.address.rsplit(":", 1)
    link = Partition((host, int(port)))
    try:
        site = Site(site_cfg(tmp_path, shards, max_syncs=4), tmp_path, link.address)
        try:
            wait_for(lambda: ps.logic.version >= 2, 300, "the first sync")
            link.cut()
            # the outage lasts until a call of the site (its pull of the new version, a push, a heartbeat) is caught
            # in it, however long that takes; well inside the client's retry budget
            wait_for(lambda: link.held() > 0, 300, "a call of the site caught in the outage")
            cut_at = ps.logic.version  # (a push whose last byte crossed before the cut may have landed by now)
            time.sleep(1.0)
            assert site.procs[0].poll() is None
            assert ps.logic.version == cut_at  # nothing got through
            link.heal()
            assert site.wait(timeout=600) == [0], site.output()
        finally:
            site.close()
        assert ps.logic.version == 4 and site_pushes(ps) == 4
    finally:
        link.close()
        ps.stop()
    assert synced(tmp_path) == [(i, i) for i in (1, 2, 3, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("action", ["enospc", "kill"])
def test_a_site_stopped_between_its_push_and_the_checkpoint_after_it_trains_no_batch_twice(
    tmp_path: Path, shards: Path, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    """The checkpoint after sync 2 fails (a full disk) or the job is SIGKILLed while writing it: sync 2's delta is
    applied already. The restart finds its push recorded (push.json), learns from the PS that it went in, and skips
    its batches: 3 pushes and 9 draws' tokens for 3 syncs, not a fourth push of batches trained twice."""
    ps = make_ps(tmp_path, aggregation="async")
    try:
        # the checkpoint after sync 2 (its weights-only copy among the best ones is written after it)
        monkeypatch.setenv(faults.ENV, f"atomic.write[site-000000002]@1={action}")
        site = Site(site_cfg(tmp_path, shards, max_syncs=3), tmp_path, ps.address)
        try:
            codes = site.wait(timeout=600)
        finally:
            site.close()
        # The job fails (Slurm requeues it); sync 2's delta is already applied, once.
        assert codes == ([1] if action == "enospc" else [-9]), site.output()
        assert action == "kill" or "No space left on device" in site.output()
        assert ps.logic.version == 2 and site_pushes(ps) == 2
        monkeypatch.delenv(faults.ENV)
        run_site(tmp_path, shards, ps, max_syncs=3)  # resumes from sync 1's checkpoint and the global model
        assert ps.logic.version == 3 and site_pushes(ps) == 3
        (status,) = [s for s in ps.logic.status(m.StatusRequest()).sites if s.site == "local-0"]
        assert status.tokens == 9 * BATCH * MODEL.context  # 3 syncs of 3 steps: no batch pushed twice
    finally:
        ps.stop()
    ckpt = tmp_path / "run" / "sites" / "local-0" / "ckpt"
    assert not [p for p in ckpt.iterdir() if TEMP_MARKER in p.name]  # no torn file left behind
    assert synced(tmp_path) == [(1, 1), (2, 2), (3, 3)]
    assert latest(tmp_path)[1]["sampler"]["draws"] == 9
    site_events = events(tmp_path / "run" / "sites" / "local-0")
    assert [e["state"] for e in site_events if e["event"] == "push_after_checkpoint"] == ["applied"]
    assert [e["source"] for e in site_events if e["event"] == "ready"] == ["fresh", "global"]


@pytest.mark.slow
def test_a_resumed_push_resent_after_a_kill_is_applied_once(
    tmp_path: Path, shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM mid-interval leaves unpushed work; the global model moves on; the restart pushes that work and is
    SIGKILLed before its next checkpoint; the next restart resends it under the checkpoint's push id: once."""
    ps = make_ps(tmp_path, interval="60s", steps=0, aggregation="async")
    site_dir = tmp_path / "run" / "sites" / "local-0"
    try:
        site = Site(site_cfg(tmp_path, shards, max_syncs=1), tmp_path, ps.address)
        try:
            wait_for(lambda: any(e["event"] == "first_step" for e in events(site_dir)), 240, "the first step")
            site.signal(signal.SIGTERM)
            assert site.wait(timeout=120) == [128 + signal.SIGTERM], site.output()
        finally:
            site.close()
        _, meta, _ = latest(tmp_path)
        push_id = meta["pending"]["push_id"]
        assert meta["version"] == 0 and push_id
        other = ps.logic.join(m.JoinRequest("other")).session_id  # another site moves the global model on
        zeros = {k: np.zeros_like(v) for k, v in (ps.logic.core.model.params or {}).items()}
        assert push(ps.logic, other, 0, zeros).accepted and ps.logic.version == 1

        monkeypatch.setenv(faults.ENV, "atomic.write[site-]@1=kill")  # the checkpoint after the resume push
        site = Site(site_cfg(tmp_path, shards, max_syncs=1), tmp_path, ps.address)
        try:
            assert site.wait(timeout=300) == [-9], site.output()
        finally:
            site.close()
        assert ps.logic.version == 2 and site_pushes(ps) == 1  # the resumed work went in, then the job died
        assert latest(tmp_path)[1]["pending"]["push_id"] == push_id  # the restart finds the same work again

        monkeypatch.delenv(faults.ENV)
        run_site(tmp_path, shards, ps, max_syncs=2)
        assert site_pushes(ps) == 2 and ps.logic.version == 3  # resent as a duplicate, then one more sync
    finally:
        ps.stop()
