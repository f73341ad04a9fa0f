"""A site evaluating its local model every N steps against a real PS keeps the k best checkpoints by loss;
train.eval_interval skips evaluations of the pulled global model until they are due."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from geofed_hpc.ckpt.best import BestCheckpoints
from geofed_hpc.ckpt.tensorfile import load_tensors
from geofed_hpc.config import DataConfig
from geofed_hpc.data.prepare import prepare_shards
from geofed_hpc.metrics import read_jsonl
from tests.site_procs import Site
from tests.test_site_client import make_ps, site_cfg

pytestmark = pytest.mark.slow


def run_one_site(tmp_path: Path, steps: int, syncs: int, **train: Any) -> list[dict[str, Any]]:
    """One real site process against an async PS that asks `steps` local steps per sync; its metrics records."""
    shards = tmp_path / "shards"
    data = DataConfig(
        tokenizer="gpt2", source="bible", max_tokens=40000, val_fraction=0.05, cache_dir=str(tmp_path / "cache")
    )
    prepare_shards(data, shards, 1)
    ps = make_ps(tmp_path, steps=steps, aggregation="async")
    site = Site(site_cfg(tmp_path, shards, syncs, sites=1, max_local_steps=0, **train), tmp_path, ps.address)
    try:
        assert site.wait(timeout=300) == [0], site.output()
    finally:
        site.close()
        ps.stop()
    return read_jsonl(tmp_path / "run" / "metrics" / "local-0.metrics.jsonl")


def test_eval_every_n_steps_keeps_the_k_lowest_losses(tmp_path: Path) -> None:
    records = run_one_site(tmp_path, steps=5, syncs=2, lr=1e-2, eval_every=2, keep_best=3)
    local = [r for r in records if "val/local_loss" in r]
    assert [r["train/step"] for r in local] == [2, 4, 6, 8, 10]  # 2 syncs of 5 steps, every 2nd step
    at_sync = [r["val/loss"] for r in records if "val/loss" in r and r.get("sync/index", 0) >= 1]
    assert len(at_sync) == 2
    candidates = sorted([r["val/local_loss"] for r in local] + at_sync)
    best_dir = tmp_path / "run" / "sites" / "local-0" / "ckpt" / "best"
    entries = BestCheckpoints(best_dir, keep=3).entries()
    assert [e["loss"] for e in entries] == candidates[:3]  # exactly the 3 lowest of every evaluation
    assert len({e["file"] for e in entries}) == 3
    for e in entries:
        tensors, meta = load_tensors(best_dir / e["file"])  # each holds the model's weights, and only them
        assert {k.split("/")[0] for k in tensors} == {"model"} and meta["weights_only"]


def test_eval_interval_skips_evaluations_until_due_and_keeps_no_checkpoint_with_a_stale_loss(tmp_path: Path) -> None:
    records = run_one_site(tmp_path, steps=2, syncs=3, eval_interval="1h", keep_best=3)
    syncs = [r for r in records if r.get("sync/index", 0) >= 1]
    assert [r["sync/version"] for r in syncs] == [1, 2, 3]  # every sync pushed, pulled and logged its training
    assert all("train/loss" in r for r in syncs)
    assert [r for r in syncs if "val/loss" in r] == []  # the hour since the first evaluation never passed
    assert [r["sync/index"] for r in records if "val/loss" in r] == [0]
    # each sync's checkpoint holds a newer model than the one evaluated: none may enter the best ones with its loss
    best_dir = tmp_path / "run" / "sites" / "local-0" / "ckpt" / "best"
    assert BestCheckpoints(best_dir, keep=3).entries() == []
