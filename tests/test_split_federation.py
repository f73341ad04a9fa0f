"""Split learning over real gRPC with two site processes: it learns, aligns, outlives a PS kill and a requeue."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.config import (
    CodecConfig,
    DataConfig,
    ModelConfig,
    ParadigmConfig,
    RunConfig,
    SiteConfig,
    TrainConfig,
    to_dict,
)
from geofed_hpc.metrics import read_jsonl
from geofed_hpc.paradigms.site import SplitSite
from geofed_hpc.ps.app import ParameterServer
from tests.conftest import bible_shards, ps_config
from tests.dist_util import free_port
from tests.site_procs import Site, events, wait_for
from tests.test_faults import ps_process

MODEL = ModelConfig(name="t", vocab_size=50257, context=32, d_model=32, n_layers=2, n_heads=2, d_ff=64)
FSL = {"cut": 1, "aux_blocks": 1, "server_update_interval": 2, "align_interval": 2, "align_steps": 4}
STEPS, SYNCS = 4, 4


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bible_shards(tmp_path_factory, 2)


def run_config(folder: Path, shards: Path, name: str, port: int = 0, sites: int = 1, **paradigm: Any) -> RunConfig:
    """`sites`: the PS's ps.min_sites (2: rounds of both sites, however late one starts)."""
    return RunConfig(
        federation="s",
        run_dir=str(folder / "run"),
        wandb_mode="disabled",
        site=SiteConfig(num_sites=2),
        model=MODEL,
        ps=ps_config(port=port, state_dir=str(folder / "ps"), round_timeout="60s", retry_budget="90s", min_sites=sites),
        codec=CodecConfig(name="fp32"),
        data=DataConfig(source=str(shards), val_batches=2),
        train=TrainConfig(batch_size=4, lr=3e-3, sync_interval="60s", max_local_steps=STEPS, max_syncs=SYNCS),
        paradigm=ParadigmConfig(name=name, **({**FSL, **paradigm} if name == "fsl_sage" else {"cut": 1})),
    )


def run_sites(cfg: RunConfig, folder: Path, address: str, indices: tuple[int, ...] = (0, 1)) -> None:
    sites = [Site(to_dict(cfg), folder, address, index=i) for i in indices]
    try:
        for site in sites:
            assert site.wait(timeout=400) == [0], site.output()
    finally:
        for site in sites:
            site.close()


def site_rows(folder: Path, site: str) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(folder / "run" / "metrics" / f"{site}.metrics.jsonl") if "sync/index" in r]


def composed_losses(folder: Path, site: str) -> list[float]:
    return [r["val/loss"] for r in site_rows(folder, site) if "val/loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsl_sage", "split"])
def test_two_sites_lower_the_composed_loss_and_alignment_keeps_its_interval(
    tmp_path: Path, shards: Path, name: str
) -> None:
    cfg = run_config(tmp_path, shards, name, sites=2)
    ps = ParameterServer(cfg)
    try:
        run_sites(cfg, tmp_path, ps.address)
        assert ps.split is not None
        split = ps.split.metrics()
        held = set(ps.logic.core.model.params or {})
    finally:
        ps.stop()
    uploads_per_sync = STEPS // FSL["server_update_interval"] if name == "fsl_sage" else STEPS
    # an fsl_sage upload the PS did not answer in time is skipped (the site counts it): the server took the rest
    skipped = sum(
        r.get("split/failed_uploads", 0) for site in ("local-0", "local-1") for r in site_rows(tmp_path, site)
    )
    assert split["split/server_steps"] == 2 * SYNCS * uploads_per_sync - skipped
    # the global model is what sites hold: the client part (and the auxiliary model), never the server part
    assert "wte.weight" in held and not {n for n in held if n.startswith(("blocks.1.", "ln_f.", "lm_head."))}
    assert {n.startswith("aux.") for n in held} == ({True, False} if name == "fsl_sage" else {False})
    for site in ("local-0", "local-1"):
        losses = composed_losses(tmp_path, site)
        assert len(losses) == SYNCS + 1 and losses[-1] < losses[0] - 0.5, (site, losses)
        rows = site_rows(tmp_path, site)[1:]  # the syncs (row 0: the first evaluation)
        assert all(r["split/bytes_up"] > 0 and r["split/eval_bytes"] > 0 for r in rows)
        aligned = [e["version"] for e in events(tmp_path / "run" / "sites" / site) if e["event"] == "aligned"]
        if name == "fsl_sage":  # every align_interval=2 rounds: at versions 2 and 4, the server's 1st and 2nd
            assert aligned == [2, 4]
            assert [r["split/bytes_down"] > 0 for r in rows] == [False, True, False, True]  # the fitted models
        else:  # every step waited for the server's gradient
            assert aligned == [] and all(r["split/bytes_down"] > 0 for r in rows)
    assert split["split/alignments"] == (2 if name == "fsl_sage" else 0)
    ps_records = read_jsonl(tmp_path / "ps" / "metrics" / "ps.metrics.jsonl")
    assert ps_records[-1]["split/server_steps"] == split["split/server_steps"]


@pytest.mark.slow
def test_the_server_part_survives_a_ps_kill_and_restart(tmp_path: Path, shards: Path) -> None:
    """A real `ps up` is SIGKILLed right after the snapshot its first alignment writes (at version 2, answering a
    site's FetchAux). The PS restarted on the same state directory comes back with that server part (its
    steps, buffer and alignment count), the sites ride out the outage and finish, and the server part goes on."""
    port = free_port()
    state = tmp_path / "ps"
    cfg = run_config(tmp_path, shards, "fsl_sage", port=port)
    model = [f"model.{k}={v}" for k, v in to_dict(MODEL).items() if k in ("context", "d_model", "n_heads", "d_ff")]
    fsl = [f"paradigm.{k}={v}" for k, v in FSL.items()]
    rounds = ("ps.round_timeout=60s", "ps.min_sites=2")  # rounds of both sites, however late one starts
    overrides = ("paradigm=fsl_sage", *fsl, *model, f"train.max_local_steps={STEPS}", *rounds)
    metrics = state / "metrics" / "ps.metrics.jsonl"
    sites = []
    try:
        with ps_process(state, port, "split.snapshot[align]@1=kill", "sync", *overrides) as proc:
            sites = [Site(to_dict(cfg), tmp_path, f"127.0.0.1:{port}", index=i) for i in (0, 1)]
            assert proc.wait(timeout=300) == -9
        saved = CheckpointStore(state / "split", prefix="split").load_latest()
        assert saved is not None
        tensors, meta, _ = saved
        kept = sum(len(v) for k, v in tensors.items() if k.endswith("/targets"))
        # rounds 1 and 2: two sites, two uploads of 4 sequences each per round (the alignment holds the lock)
        assert meta["alignments"] == 1 and meta["steps"] == 8 and kept == 32
        first_run = len(read_jsonl(metrics))
        with ps_process(state, port, "", "sync", *overrides):
            wait_for(lambda: len(read_jsonl(metrics)) > first_run, 60, "the restarted PS's first metrics")
            restored = read_jsonl(metrics)[first_run]
            for site in sites:
                assert site.wait(timeout=400) == [0], site.output()
    finally:
        for site in sites:
            site.close()
    assert restored["split/server_steps"] == 8 and restored["split/alignments"] == 1
    assert restored["split/kept_sequences"] == kept
    final = read_jsonl(metrics)[-1]
    assert final["split/server_steps"] > meta["steps"] and final["split/alignments"] == 2
    for site in ("local-0", "local-1"):
        losses = composed_losses(tmp_path, site)
        assert losses[-1] < losses[0] - 0.5, (site, losses)


@pytest.mark.slow
def test_a_requeued_site_keeps_its_auxiliary_model(tmp_path: Path, shards: Path) -> None:
    cfg = run_config(tmp_path, shards, "fsl_sage", align_interval=1)
    first = replace(cfg, train=replace(cfg.train, max_syncs=2))
    ps = ParameterServer(cfg)
    try:
        run_sites(first, tmp_path, ps.address, indices=(0,))
        site_dir = tmp_path / "run" / "sites" / "local-0"
        loaded = CheckpointStore(site_dir / "ckpt", prefix="site").load_latest()
        assert loaded is not None
        tensors, meta, _ = loaded
        aux = {k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/aux.")}
        fitted = {k.split("/", 2)[2]: v for k, v in tensors.items() if k.startswith("paradigm/split.fitted/")}
        assert aux and fitted and meta["syncs"] == 2
        assert list(tensors["paradigm/split.align"]) == [2, 0]  # fitted at version 2, to go in at the next step

        from geofed_hpc.client.trainer import SiteTrainer  # the requeued job, as far as its checkpoint load

        trainer = SiteTrainer(first, 0, "127.0.0.1:1")
        trainer.ckpt.load()
        params = dict(trainer.runtime.model.named_parameters())
        for name, value in aux.items():
            np.testing.assert_array_equal(params[name].detach().numpy(), value)
        paradigm = trainer.runtime.paradigm
        assert isinstance(paradigm, SplitSite) and paradigm.fitted_version == 2 and not paradigm.fitted_applied
        for name, value in fitted.items():
            np.testing.assert_array_equal(paradigm.fitted[name], value)
        del trainer

        run_sites(cfg, tmp_path, ps.address, indices=(0,))  # the requeue runs on to sync 4
    finally:
        ps.stop()
    names = [e["event"] for e in events(site_dir)]
    assert names.count("restored") == 2
    aligned = [e["version"] for e in events(site_dir) if e["event"] == "aligned"]
    assert aligned == [1, 2, 3, 4]  # version 2's fitted model was not fetched twice
    assert len(composed_losses(tmp_path, "local-0")) == SYNCS + 1  # one first evaluation, then every sync


@pytest.mark.slow
def test_a_site_with_another_cut_is_refused_and_the_federation_goes_on(tmp_path: Path, shards: Path) -> None:
    """Three blocks, the PS's server part after block 1; site 1 comes with paradigm.cut=2. It is refused at its
    Join, naming both cuts, and exits failed without a byte reaching the server part; site 0 trains on alone."""
    three = replace(MODEL, n_layers=3)
    cfg = replace(run_config(tmp_path, shards, "fsl_sage"), model=three)
    cfg = replace(cfg, train=replace(cfg.train, max_syncs=2))
    other = replace(cfg, paradigm=replace(cfg.paradigm, cut=2))
    ps = ParameterServer(cfg)
    good = Site(to_dict(cfg), tmp_path, ps.address, index=0)
    bad = Site(to_dict(other), tmp_path, ps.address, index=1)
    try:
        assert bad.wait(timeout=400) != [0]
        assert good.wait(timeout=400) == [0], good.output()
        assert ps.split is not None
        split = ps.split.metrics()
        sites = {s.site for s in ps.logic.core.sessions.sessions.values()}
    finally:
        good.close()
        bad.close()
        ps.stop()
    refusal = bad.output()
    assert "Join refused by the parameter server: site local-1 is configured with paradigm fsl_sage(cut=2" in refusal
    assert "this parameter server with fsl_sage(cut=1" in refusal, refusal
    assert sites == {"local-0"}
    # only site 0's uploads: every server_update_interval-th of its steps, over its two syncs
    assert split["split/server_steps"] == 2 * STEPS // FSL["server_update_interval"]
    assert len(composed_losses(tmp_path, "local-0")) == 3
