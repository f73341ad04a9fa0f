"""The site client as processes against a real PS: 2-rank FSDP2 syncs, SIGTERM, restarts, the fresher source."""

from __future__ import annotations

import signal
import stat
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.ckpt.best import BestCheckpoints
from geofed_hpc.client.sharded import read_shards
from geofed_hpc.config import CodecConfig, DataConfig, ModelConfig, RunConfig, SiteConfig, TrainConfig, to_dict
from geofed_hpc.data.prepare import prepare_shards
from geofed_hpc.errors import CheckpointError
from geofed_hpc.metrics import read_jsonl
from geofed_hpc.ps.app import ParameterServer
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from tests.conftest import ps_config
from tests.dist_util import free_port
from tests.site_procs import Site, events, wait_for

pytestmark = pytest.mark.slow

MODEL = ModelConfig(name="t", vocab_size=50257, context=32, d_model=32, n_layers=2, n_heads=2, d_ff=64)
BATCH = 4


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    cache = tmp_path_factory.mktemp("cache")
    prepare_shards(
        DataConfig(tokenizer="gpt2", source="bible", max_tokens=40000, val_fraction=0.05, cache_dir=str(cache)), out, 2
    )
    return out


def make_ps(folder: Path, interval: str = "60s", steps: int = 3, **ps: Any) -> ParameterServer:
    train = TrainConfig(sync_interval=interval, max_local_steps=steps)
    cfg = RunConfig(ps=ps_config(state_dir=str(folder / "ps"), **ps), train=train, codec=CodecConfig(name="int8"))
    return ParameterServer(cfg)


def site_cfg(folder: Path, shards: Path, max_syncs: int, sites: int = 2, **train: Any) -> dict[str, Any]:
    """A tiny site's config as a job receives it; `train` overrides TrainConfig fields."""
    train = {"lr": 3e-3, "sync_interval": "60s", "max_local_steps": 3, **train}
    cfg = RunConfig(
        federation="t",
        run_dir=str(folder / "run"),
        wandb_mode="disabled",
        site=SiteConfig(num_sites=sites),
        model=MODEL,
        ps=ps_config(),
        data=DataConfig(source=str(shards), val_batches=2),
        train=TrainConfig(batch_size=BATCH, max_syncs=max_syncs, **train),
    )
    return to_dict(cfg)


def run_site(folder: Path, shards: Path, ps: ParameterServer, max_syncs: int, world: int = 1) -> Site:
    site = Site(site_cfg(folder, shards, max_syncs), folder, ps.address, world=world)
    try:
        codes = site.wait(timeout=600)
    finally:
        site.close()
    assert codes == [0] * world, site.output()
    return site


def latest(folder: Path) -> tuple[dict[str, np.ndarray], dict[str, Any], Path]:
    loaded = CheckpointStore(folder / "run" / "sites" / "local-0" / "ckpt", prefix="site").load_latest()
    assert loaded is not None
    return loaded


def metrics(folder: Path) -> list[dict[str, Any]]:
    return read_jsonl(folder / "run" / "metrics" / "local-0.metrics.jsonl")


def test_two_rank_fsdp2_site_syncs_with_a_real_ps_like_one_process(tmp_path: Path, shards: Path) -> None:
    runs = {}
    for world in (2, 1):
        folder = tmp_path / f"world{world}"
        ps = make_ps(folder)
        try:
            site = run_site(folder, shards, ps, max_syncs=3, world=world)
            assert ps.logic.version == 3
        finally:
            ps.stop()
        result = site.results()
        assert result[0]["syncs"] == 3 and result[0]["version"] == 3
        if world == 2:
            assert result[1] == {"site": "local-0", "rank": 1}
        runs[world] = [r["train/loss"] for r in metrics(folder) if "train/loss" in r]

        tensors, meta, path = latest(folder)
        assert meta["syncs"] == 3 and meta["version"] == 3 and meta["global_model"] and not meta["pending"]
        assert meta["sampler"]["draws"] == 9 and meta["tokens_seen"] == 9 * BATCH * MODEL.context
        if world == 1:  # one process: the model and optimizer state are in the file
            assert {"rng/cpu", "model/wte.weight", "optim/wte.weight/exp_avg"} <= set(tensors)
        else:  # two ranks: each wrote its shard (DCP) into the folder the file names
            assert "rng/cpu" in tensors and not any(k.startswith(("model/", "optim/")) for k in tensors)
            assert meta["shards"]["world_size"] == 2
            state = read_shards(path.parent / meta["shards"]["dir"])
            assert state["model"]["wte.weight"].shape == (MODEL.vocab_size, MODEL.d_model)
            assert state["optim"]["state"]["wte.weight"]["exp_avg"].shape == (MODEL.vocab_size, MODEL.d_model)
        assert "rejoin_token" not in meta and meta["model"]["d_model"] == MODEL.d_model
        token = path.parent.parent / "rejoin.json"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) > 40
        best = BestCheckpoints(path.parent / "best").entries()
        assert len(best) == 3 and [e["loss"] for e in best] == sorted(e["loss"] for e in best)
    assert len(runs[2]) == 3
    np.testing.assert_allclose(runs[2], runs[1], rtol=2e-3)  # FSDP2 over 2 ranks trains like one process


def test_sigterm_checkpoints_mid_interval_and_the_restart_finishes_it(tmp_path: Path, shards: Path) -> None:
    ps = make_ps(tmp_path, interval="10s", steps=0)
    site_dir = tmp_path / "run" / "sites" / "local-0"
    site = Site(site_cfg(tmp_path, shards, max_syncs=1), tmp_path, ps.address, world=2)
    try:
        wait_for(lambda: any(e["event"] == "first_step" for e in events(site_dir)), 240, "the first step")
        site.signal(signal.SIGTERM)  # what `scontrol requeue` or a node drain sends to every task
        codes = site.wait(timeout=120)
        assert codes == [128 + signal.SIGTERM] * 2, site.output()
        tensors, meta, _ = latest(tmp_path)
        pending = meta["pending"]
        assert pending and pending["steps"] >= 1 and meta["version"] == 0 and not meta["global_model"]
        assert meta["sampler"]["draws"] == pending["steps"]
        assert any(k.startswith("base/") for k in tensors)  # two ranks: the optimizer state is in the shards
        assert (
            "exp_avg"
            in read_shards(tmp_path / "run" / "sites" / "local-0" / "ckpt" / meta["shards"]["dir"])["optim"]["state"][
                "wte.weight"
            ]
        )

        again = Site(site_cfg(tmp_path, shards, max_syncs=1), tmp_path, ps.address, world=2)
        try:
            assert again.wait(timeout=300) == [0, 0], again.output()
        finally:
            again.close()
        _, meta2, _ = latest(tmp_path)
        steps = [r["sync/local_steps"] for r in metrics(tmp_path) if "train/loss" in r]
        assert meta2["syncs"] == 1 and meta2["version"] == 1 and len(steps) == 1
        assert steps[0] > pending["steps"] and meta2["sampler"]["draws"] == steps[0]  # continued, nothing redone
        sources = [r["resume/source"] for r in metrics(tmp_path) if "resume/source" in r]
        assert sources == ["fresh", "local"]
    finally:
        site.close()
        ps.stop()


def test_restarts_continue_the_data_and_take_the_fresher_model(tmp_path: Path, shards: Path) -> None:
    ps = make_ps(tmp_path, aggregation="async")
    try:
        run_site(tmp_path, shards, ps, max_syncs=2)  # state on disk = a kill right after sync 2's checkpoint
        run_site(tmp_path, shards, ps, max_syncs=3)  # the PS is still at our version: the model comes from disk
        version = ps.logic.version
        with PSClient(ps_config(), ps.address) as client:  # another site moves the global model on
            client.connect()
            other = client.join(m.JoinRequest("other"))
            header, payload = client.pull_model(other.session_id)
            step = {k: np.full_like(v, 1e-3) for k, v in codec.decode(payload).items()}
            push = m.PushHeader(other.session_id, header.version, 1, 1, "fp32", 0, b"", "")
            assert client.push_delta(push, codec.encode(step, CodecConfig(name="fp32"))).accepted
        assert ps.logic.version == version + 1
        run_site(tmp_path, shards, ps, max_syncs=4)  # now the PS is fresher
        with PSClient(ps_config(), ps.address) as client:
            client.connect()
            pushes = {s.site: s.pushes for s in client.status().sites}
    finally:
        ps.stop()
    records = metrics(tmp_path)
    assert [r["resume/source"] for r in records if "resume/source" in r] == ["fresh", "local", "global"]
    resumed = [r["sync/version"] for r in records if "resume/source" in r]
    assert resumed[1] == 2 and resumed[2] == version + 1
    synced = [(r["sync/index"], r["train/tokens"]) for r in records if "train/loss" in r]
    per_sync = 3 * BATCH * MODEL.context
    assert synced == [(i, i * per_sync) for i in (1, 2, 3, 4)]  # no batch repeated or skipped across restarts
    assert pushes["local-0"] == 4  # no delta lost or applied twice
    _, meta, _ = latest(tmp_path)
    assert meta["sampler"]["draws"] == 12
    ready = [e for e in events(tmp_path / "run" / "sites" / "local-0") if e["event"] == "ready"]
    assert [e["source"] for e in ready] == ["fresh", "local", "global"] and all(e["seconds"] > 0 for e in ready)

    # A checkpoint of another model config is refused with the field named.
    from geofed_hpc.client.trainer import SiteTrainer

    cfg = RunConfig(**{**site_cfg_obj(tmp_path, shards).__dict__, "model": replace(MODEL, d_model=64)})
    trainer = SiteTrainer(cfg, 0, ps.address)
    with pytest.raises(CheckpointError, match="model.d_model=32, this run has 64"):
        trainer.ckpt.load()


def site_cfg_obj(folder: Path, shards: Path) -> RunConfig:
    from geofed_hpc.config import from_dict

    return from_dict(RunConfig, site_cfg(folder, shards, 4))


def test_followers_leave_when_rank0_is_killed(tmp_path: Path, shards: Path) -> None:
    ps = make_ps(tmp_path, interval="60s", steps=0)
    site = Site(site_cfg(tmp_path, shards, max_syncs=1), tmp_path, ps.address, world=2)
    try:
        site_dir = tmp_path / "run" / "sites" / "local-0"
        wait_for(lambda: any(e["event"] == "first_step" for e in events(site_dir)), 240, "the first step")
        site.procs[0].kill()  # SIGKILL: no stop command ever comes
        code = site.procs[1].wait(timeout=120)  # the follower's collective fails at once; it does not hang
        assert code not in (0, None), site.output()
    finally:
        site.close()
        ps.stop()


def test_followers_fail_with_rank0(tmp_path: Path, shards: Path) -> None:
    cfg = site_cfg(tmp_path, shards, max_syncs=1)
    cfg["ps"]["connect_timeout"] = "1s"
    site = Site(cfg, tmp_path, f"127.0.0.1:{free_port()}", world=2)  # nobody listens there
    try:
        codes = site.wait(timeout=180)
    finally:
        site.close()
    assert codes[0] != 0 and codes[1] != 0, site.output()
    assert "rank 0 failed" in site.logs[1].read_text()
