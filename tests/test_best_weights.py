"""Best checkpoints hold the weights alone (the latest ones all a resume needs), and export and generate read them."""

from __future__ import annotations

from pathlib import Path

import pytest

from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.ckpt.best import BestCheckpoints
from geofed_hpc.ckpt.tensorfile import load_tensors
from geofed_hpc.cli import main
from geofed_hpc.config.run import WEIGHTS
from tests.test_site_eval import run_one_site

pytestmark = pytest.mark.slow


def test_best_checkpoints_are_weights_only_and_export_and_generate_read_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_one_site(tmp_path, steps=3, syncs=3, eval_every=2, keep_best=3)
    ckpt = tmp_path / "run" / "sites" / "local-0" / "ckpt"
    entries = BestCheckpoints(ckpt / "best").entries()
    assert len(entries) == 3
    latest = CheckpointStore(ckpt, prefix="site").load_latest()  # what a resume reads: everything
    assert latest is not None
    full, full_meta, full_path = latest
    assert any(k.startswith("optim/") for k in full) and any(k.startswith("residual/") for k in full)
    params = sum(v.size for k, v in full.items() if k.startswith("model/"))
    for e in entries:
        path = ckpt / "best" / e["file"]
        tensors, meta = load_tensors(path)
        assert {k.split("/", 1)[0] for k in tensors} == {"model"}, sorted(tensors)[:5]  # no optimizer, rng, residual
        assert meta["weights_only"] and meta["val_loss"] == e["loss"] and meta["model"] == full_meta["model"]
        assert sum(v.size for v in tensors.values()) == params
        assert path.stat().st_size < params * WEIGHTS + 64 * 1024 < full_path.stat().st_size / 3
    out = tmp_path / "hf"
    assert main(["export", "hf", str(ckpt / "best"), str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert f"exported {ckpt / 'best' / entries[0]['file']}" in capsys.readouterr().out  # the best one
    assert main(["generate", str(ckpt / "best"), "--prompt", "In the beginning", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("In the beginning")
    assert main(["export", "hf", str(tmp_path / "run"), str(tmp_path / "hf-run")]) == 0  # the run's global model
