"""PS persistence: restart from snapshots (also after a kill mid-write), SIGTERM snapshots, re-seeding."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.ckpt import CheckpointStore, save_tensors
from geofed_hpc.ckpt.atomic import TEMP_MARKER
from geofed_hpc.client.replica import apply_updates
from geofed_hpc.config import CodecConfig
from geofed_hpc.errors import CheckpointError
from geofed_hpc.ps.sessions import handle_of
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from tests.conftest import ps_config, small_params
from tests.test_ps_downlink import fetch, random_delta
from tests.test_ps_logic import full, init, joined, make, pull, push

REPO = Path(__file__).resolve().parents[1]
INT8 = CodecConfig(name="int8", block_size=64)


def test_restart_restores_model_momentum_sessions_pushes_and_history(tmp_path: Path) -> None:
    kw = dict(outer_optimizer="nesterov", global_lr=0.7, run_codec="int8", state_dir=str(tmp_path))
    logic = make("async", **kw)
    (a,) = joined(logic, 1)
    rejoin = logic.join(m.JoinRequest("site1"))
    b = rejoin.session_id
    params = init(logic, a)
    replica = codec.decode(fetch(logic, b, None)[1])
    for i in range(3):
        push(logic, a, i, random_delta(params, i), cfg=INT8, push_id=f"r{i}")
    before = (
        logic.model_hash(),
        {k: v.copy() for k, v in logic.core.model.outer.buffers.items()},
        logic.core.model.downlink.residual,
    )
    logic.finish()

    restarted = make("async", **kw)
    assert restarted.version == 3 and restarted.model_hash() == before[0]
    for k, v in before[1].items():
        np.testing.assert_array_equal(restarted.core.model.outer.buffers[k], v)
    for k, v in before[2].items():
        np.testing.assert_array_equal(restarted.core.model.downlink.residual[k], v)
    again = restarted.join(m.JoinRequest("site1", rejoin.rejoin_token, resume_session=b))  # the token survived
    assert handle_of(again.session_id) == handle_of(b) and again.version == 3  # the same session, a new secret
    b = again.session_id
    assert push(restarted, a, 2, random_delta(params, 2), cfg=INT8, push_id="r2").duplicate
    header, payload = fetch(restarted, b, 0)  # the downlink history survived too
    assert header.kind == "updates" and len(header.segments) == 3
    replica = apply_updates(replica, header, payload)
    assert all(replica[k].tobytes() == restarted.core.model.params[k].tobytes() for k in replica)  # type: ignore[index]
    restarted.finish()


def test_a_crash_between_snapshots_replays_the_journal_to_the_same_model(tmp_path: Path) -> None:
    kw = dict(snapshot_every=3, run_codec="int8", state_dir=str(tmp_path))
    logic = make("async", **kw)
    (a,) = joined(logic, 1)
    params = init(logic, a)
    for i in range(5):
        push(logic, a, i, random_delta(params, i), cfg=INT8, push_id=f"s{i}")
    assert CheckpointStore(tmp_path, prefix="global").latest_step() == 3
    assert logic.core.model.downlink.versions() == [0, 1, 2, 3, 4]
    updates = {v: codec.decode((tmp_path / "updates" / f"update-{v:09d}.gfdc").read_bytes()) for v in range(5)}
    # a crash here (no finish): the restart loads version 3 and replays the journaled pushes of versions 3 and 4
    restarted = make("async", **kw)
    assert restarted.version == 5 and restarted.model_hash() == logic.model_hash()  # bit for bit
    assert restarted.core.model.downlink.versions() == [0, 1, 2, 3, 4]
    for v, update in updates.items():  # republished as they were: a site applying the old files matches too
        again = codec.decode((tmp_path / "updates" / f"update-{v:09d}.gfdc").read_bytes())
        assert all(again[k].tobytes() == u.tobytes() for k, u in update.items())
    (b,) = joined(restarted, 1)
    assert push(restarted, b, 4, random_delta(params, 5), cfg=INT8, push_id="s4").duplicate  # applied once
    with pytest.raises(Exception, match="newer than the global version 5"):
        push(restarted, b, 6, random_delta(params, 9), cfg=INT8)
    assert fetch(restarted, b, 6)[0].kind == "full"  # a site from a future the PS never made takes the full model


CHILD = """
import sys
import numpy as np
from geofed_hpc.ps.servicer import ParameterServerLogic
from geofed_hpc.rpc import messages as m
from tests.conftest import ps_config
from tests.test_ps_logic import push

logic = ParameterServerLogic(ps_config(aggregation="async", state_dir=sys.argv[1], downlink_history=0),
                             m.RunSettings(aggregation="async", codec="fp32"))
sid = logic.join(m.JoinRequest("writer")).session_id
if not logic.initialized:
    push(logic, sid, 0, {"w": np.zeros(1 << 23, np.float32)}, init=True, push_id="init")
print("ready", logic.version, flush=True)
for _ in range(100_000):
    push(logic, sid, logic.version, {"w": np.ones(1 << 23, np.float32)}, push_id=f"v{logic.version}")
"""


def test_kill_during_snapshot_leaves_the_previous_one_loadable(tmp_path: Path) -> None:
    """A real process writing 32 MiB snapshots is SIGKILLed by a fault point while the temp file of its third is
    half-written (its first chunks on disk, the rest not); the restart loads the snapshot before."""
    env = {**os.environ, "GEOFED_FAULTS": "atomic.chunk[global-000000003.gft]@2=kill"}
    child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=REPO, env=env, capture_output=True)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode(errors="replace")[-3000:]
    assert b"fault injected: kill at atomic.chunk [global-000000003.gft] (hit 2)" in child.stderr
    torn = [p for p in tmp_path.iterdir() if TEMP_MARKER in p.name]
    assert len(torn) == 1 and torn[0].name.startswith(".global-000000003.gft"), torn
    assert 0 < torn[0].stat().st_size < 4 << 23  # mid-write: less than the 32 MiB of its tensor
    assert CheckpointStore(tmp_path, prefix="global").latest_step() == 2
    restored = make("async", run_codec="fp32", state_dir=str(tmp_path), downlink_history=0)
    assert restored.initialized and restored.version >= 2
    assert restored.core.model.params is not None
    np.testing.assert_array_equal(restored.core.model.params["w"], np.full(1 << 23, restored.version, np.float32))
    restored.finish()
    assert not any(TEMP_MARKER in p.name for p in tmp_path.iterdir())


def test_a_fresh_ps_is_reseeded_by_the_first_site_with_a_checkpoint() -> None:
    logic = make("sync")
    a, b = joined(logic, 2)
    assert not logic.initialized
    params = small_params(3)
    reply = push(logic, a, 7, params, init=True, push_id="reseed")  # its checkpoint holds version 7
    assert reply.accepted and reply.version == 7 and logic.version == 7
    late = push(logic, b, 5, small_params(4), init=True, push_id="late-seed")
    assert not late.accepted and "already initialized at version 7" in late.reason
    version, got = pull(logic, b)
    assert version == 7 and all(np.array_equal(got[k], params[k]) for k in params)
    assert logic.join(m.JoinRequest("site2")).version == 7


@pytest.mark.parametrize("prefix", ["model/", "param/", ""])
def test_init_from_reads_site_checkpoints_ps_snapshots_and_plain_files(tmp_path: Path, prefix: str) -> None:
    params = small_params(2)
    path = tmp_path / "seed.gft"
    save_tensors(path, {f"{prefix}{k}": v for k, v in params.items()} | {"optim/x/step": np.ones(1)}, {"version": 4})
    if not prefix:
        path.unlink()
        save_tensors(path, params, {})
    logic = make("async", init_from=str(path))
    assert logic.version == (4 if prefix else 0)
    (a,) = joined(logic, 1)
    assert all(np.array_equal(pull(logic, a)[1][k], params[k]) for k in params)


def test_init_from_refuses_bad_files_and_is_ignored_once_state_exists(tmp_path: Path) -> None:
    bad = tmp_path / "nan.gft"
    save_tensors(bad, {"w": np.array([np.nan], np.float32)}, {})
    with pytest.raises(CheckpointError, match="NaN"):
        make("async", init_from=str(bad))
    with pytest.raises(CheckpointError, match="does not exist"):
        make("async", init_from=str(tmp_path / "missing.gft"))
    state = tmp_path / "state"
    logic = make("async", state_dir=str(state))
    (a,) = joined(logic, 1)
    init(logic, a)
    push(logic, a, 0, {k: np.ones_like(v) for k, v in small_params().items()})
    logic.finish()
    good = tmp_path / "good.gft"
    save_tensors(good, small_params(9), {"version": 0})
    again = make("async", state_dir=str(state), init_from=str(good))
    assert again.version == 1  # the snapshot wins; the file is ignored with a warning


def test_sigterm_applies_the_open_round_and_snapshots(tmp_path: Path) -> None:
    """`geofed-hpc ps up` in a real process: SIGTERM finishes, applies the partial round, writes a snapshot."""
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "geofed_hpc.cli",
            "-v",
            "ps",
            "up",
            "ps.port=0",
            f"ps.state_dir={state}",
            "codec=fp32",
            "ps.round_timeout=1h",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = None
        for _ in range(50):
            line = proc.stdout.readline()
            port = re.search(r"^parameter server on [^ ]+:(\d+) \(", line)
            if port or not line:
                break
        assert port, line
        with PSClient(ps_config(), f"127.0.0.1:{port[1]}") as client:
            a = client.join(m.JoinRequest("site-a")).session_id
            client.join(m.JoinRequest("site-b"))
            params = small_params()
            client.push_delta(
                m.PushHeader(a, 0, 0, 0, "fp32", 0, b"", "", init=True), codec.encode(params, CodecConfig("fp32"))
            )
            ones = codec.encode({k: np.ones_like(v) for k, v in params.items()}, CodecConfig("fp32"))
            assert client.push_delta(m.PushHeader(a, 0, 1, 8, "fp32", 0, b"", ""), ones).version == 0  # b is late
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    tensors, meta, _ = CheckpointStore(state, prefix="global").load_latest()  # type: ignore[misc]
    assert meta["version"] == 1 and {s["site"] for s in meta["sessions"]} == {"site-a", "site-b"}
    np.testing.assert_array_equal(tensors["param/ln.bias"], np.ones(8, np.float32))
    assert "applying the open round early" in out


@pytest.mark.slow
def test_site_reseeds_a_ps_that_lost_everything_and_keeps_a_bit_identical_copy(
    tmp_path: Path, warnings_log: pytest.LogCaptureFixture
) -> None:
    """A real SiteTrainer: trains 2 syncs (pulling int8 updates), the PS is replaced by an empty one, and the
    site's next run re-seeds it from its checkpoint at version 2 and carries on."""
    from geofed_hpc.cli import compose_config
    from geofed_hpc.client.trainer import SiteTrainer
    from geofed_hpc.ps.app import ParameterServer

    def config(max_syncs: int):
        overrides = ["site=local", "model=tiny", f"train.max_syncs={max_syncs}", "train.sync_interval=1s"]
        overrides += ["data.max_tokens=60000", "data.val_batches=2", "wandb_mode=disabled", f"run_dir={tmp_path}"]
        overrides += ["site.num_sites=1"]
        return compose_config(overrides)[0]

    first = ParameterServer(config(2))
    try:
        trainer = SiteTrainer(config(2), 0, first.address)
        assert trainer.run()["version"] == 2
        assert first.logic.core.model.cached_chains()  # the site pulled encoded updates, not the model
        base = trainer.sync.replica.base
        assert all(base[k].tobytes() == first.logic.core.model.params[k].tobytes() for k in base)
    finally:
        first.stop()
    empty = ParameterServer(config(3))  # no state_dir: the PS lost everything
    try:
        assert not empty.logic.initialized
        result = SiteTrainer(config(3), 0, empty.address).run()
        assert "re-seeded at version 2" in warnings_log.text
        assert result["version"] == 3 and empty.logic.version == 3
    finally:
        empty.stop()
    events = (tmp_path / "sites" / "local-0" / "events.jsonl").read_text()
    assert '"event": "reseed"' in events and '"version": 2' in events


def test_a_ps_behind_a_sites_base_is_reseeded_from_it_and_applies_its_work_once(tmp_path: Path) -> None:
    """Restarted from a state directory whose journal was lost (round/ removed, or an older backup), the PS is back
    at its last snapshot, behind a site's base: that site's copy wins, and its work lands on it once."""
    import shutil

    from geofed_hpc.errors import StaleError

    kw = dict(snapshot_every=10, state_dir=str(tmp_path))
    logic = make("async", **kw)
    (a,) = joined(logic, 1)
    params = init(logic, a)
    for i in range(3):
        push(logic, a, i, full(params, 0.01), push_id=f"w{i}")
    version, site_base = pull(logic, a)  # the site's base: the global model at version 3
    assert version == 3
    shutil.rmtree(tmp_path / "round")  # the journal is lost; the newest snapshot holds version 0
    restarted = make("async", **kw)
    assert restarted.version == 0
    work = full(params, 0.02)
    with pytest.raises(StaleError, match="newer than the global version 0"):
        push(restarted, a, 3, work, push_id="work")  # from the future: the site re-seeds (client/sync.py)
    stale = push(restarted, a, 0, small_params(5), init=True, push_id="not-fresher")
    assert not stale.accepted and "already initialized at version 0" in stale.reason
    other = {k: v for k, v in site_base.items() if k != "ln.bias"}
    assert not push(restarted, a, 9, other, init=True, push_id="other-model").accepted  # not this PS's tensors
    reseed = push(restarted, a, 3, site_base, init=True, push_id="reseed")
    assert reseed.accepted and restarted.version == 3
    assert all(restarted.core.model.params[k].tobytes() == site_base[k].tobytes() for k in site_base)  # type: ignore[index]
    assert push(restarted, a, 3, work, push_id="work").accepted and restarted.version == 4
    assert push(restarted, a, 3, work, push_id="work").duplicate and restarted.version == 4  # applied once
    got_version, got = pull(restarted, a)
    assert got_version == 4
    np.testing.assert_allclose(got["blocks.0.w"], site_base["blocks.0.w"] + 0.02, rtol=0, atol=1e-6)
    restarted.finish()
