"""bench/convergence.py end to end, small: real sites at unequal speeds, ours and synchronous FedAvg both learn."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from geofed_hpc.config import DataConfig
from geofed_hpc.data.shards import open_site_shards, prepare_shards

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_ours_and_fedavg_both_lower_the_validation_loss(tmp_path: Path) -> None:
    out, png = tmp_path / "convergence.json", tmp_path / "convergence.png"
    args = ["--minutes", "0.3", "--speeds", "1,4", "--sync-interval", "4s", "--eval-interval", "0s"]
    args += ["--methods", "ours,fedavg"]
    args += ["--json", str(out), "--png", str(png), "--work-dir", str(tmp_path / "work")]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "convergence.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "WANDB_SILENT": "true"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert sorted(rows) == ["fedavg", "ours"]
    for method, row in rows.items():
        first = row["curve"][0]
        assert first["version"] == 0, (method, row["curve"])
        assert row["final_val_loss"] < first["loss"], (method, row["curve"])
        assert row["tokens"] > 0 and row["bytes_sent"] > 0
    assert png.stat().st_size > 0


def test_the_development_set_is_the_validation_tail_past_the_tokens_results_are_read_on(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("convergence_bench", ROOT / "bench" / "convergence.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 80))}) + "\n" for _ in range(120)))
    data = tmp_path / "data"
    prepare_shards(DataConfig(source=str(corpus), cache_dir=str(tmp_path / "cache"), val_fraction=0.1), data, 3)
    args = argparse.Namespace(val_batches=2, batch=3, model="tiny_llama")
    dev = bench.dev_split(data, args)

    used = 2 * 3 * (bench.model_config("tiny_llama").context + 1)  # the tokens the validation batches read
    train, val = open_site_shards(data, 1, 3, "gpt2", 50257)
    dev_train, dev_val = open_site_shards(dev, 1, 3, "gpt2", 50257)  # verifies every checksum
    assert len(val) > used
    np.testing.assert_array_equal(dev_train, train)
    np.testing.assert_array_equal(dev_val, val[used:])
    np.testing.assert_array_equal(open_site_shards(data, 1, 3, "gpt2", 50257)[1], val)  # validation untouched
    with pytest.raises(SystemExit, match="too few for a development set"):
        bench.dev_split(data, argparse.Namespace(val_batches=len(val), batch=1, model="tiny_llama"))
