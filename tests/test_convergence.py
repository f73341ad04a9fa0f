"""bench/convergence.py end to end, small: real sites at unequal speeds, ours and synchronous FedAvg both learn."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geofed_hpc.config import DataConfig
from geofed_hpc.data.prepare import prepare_shards
from geofed_hpc.data.shards import open_site_shards

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_ours_and_fedavg_both_lower_the_validation_loss(tmp_path: Path) -> None:
    out, png = tmp_path / "convergence.json", tmp_path / "convergence.png"
    # Each site stops after 2 syncs (FedAvg's of at most 4 local steps): the run is counted in syncs, whatever the
    # machine's speed; the 5-minute budget only bounds a run that hangs.
    args = ["--minutes", "5", "--max-syncs", "2", "--local-steps", "4"]
    args += ["--speeds", "1,4", "--sync-interval", "4s", "--eval-interval", "0s", "--methods", "ours,fedavg"]
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
        assert row["batch"] == 8  # the sites' training batch, recorded with the row
    assert png.stat().st_size > 0


def load_bench() -> Any:
    spec = importlib.util.spec_from_file_location("convergence_bench", ROOT / "bench" / "convergence.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_development_set_is_the_validation_tail_past_the_tokens_results_are_read_on(tmp_path: Path) -> None:
    bench = load_bench()
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 80))}) + "\n" for _ in range(120)))
    data = tmp_path / "data"
    prepare_shards(
        DataConfig(tokenizer="gpt2", source=str(corpus), cache_dir=str(tmp_path / "cache"), val_fraction=0.1), data, 3
    )
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


def report(target: float, method: str, budget_s: float, curve: list[tuple[float, float]]) -> dict[str, Any]:
    points = [{"t": t, "version": v, "loss": loss, "tokens": 1000 * v} for v, (t, loss) in enumerate(curve)]
    row = {"method": method, "final_val_loss": curve[-1][1], "time_to_target_s": None, "tokens": 1000 * len(curve)}
    row |= {"bytes_sent": 10, "versions": len(curve) - 1, "budget_s": budget_s, "curve": points}
    return {"config": {"minutes": budget_s / 60}, "machine": {}, "target_val_loss": target, "rows": [row]}


def test_merge_measures_the_speedup_once_fedavg_had_the_time_to_reach_the_target(tmp_path: Path) -> None:
    bench = load_bench()
    ours, fedavg, short = tmp_path / "ours.json", tmp_path / "fedavg.json", tmp_path / "short.json"
    ours.write_text(json.dumps(report(5.0, "ours", 150, [(0, 10.0), (60, 6.0), (120, 4.9), (150, 4.5)])))
    fedavg.write_text(json.dumps(report(5.0, "fedavg", 600, [(0, 10.0), (300, 6.0), (480, 4.95), (600, 4.8)])))
    short.write_text(json.dumps(report(5.0, "fedavg", 150, [(0, 10.0), (150, 6.0)])))

    merged = bench.merge([fedavg, ours])
    assert [r["method"] for r in merged["rows"]] == ["ours", "fedavg"]  # the benchmark's order, not the files'
    assert [r["time_to_target_s"] for r in merged["rows"]] == [120, 480]
    assert merged["targets"]["speedup_vs_fedavg"] == {"value": 4.0, "met": True}
    # within FedAvg's own budget only a bound is known: its budget over ours' time
    assert bench.merge([ours, short])["targets"]["speedup_vs_fedavg"] == {"value": None, "at_least": 1.25, "met": False}

    other = tmp_path / "other.json"
    other.write_text(json.dumps(report(5.2, "fedavg", 600, [(0, 10.0)])))
    with pytest.raises(SystemExit, match="has target 5.2.*rerun with the same --target"):
        bench.merge([ours, other])
    with pytest.raises(SystemExit, match="method fedavg is in more than one file"):
        bench.merge([ours, fedavg, short])
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="bad.json is not a report of this benchmark"):
        bench.merge([tmp_path / "bad.json"])

    out, png = tmp_path / "merged.json", tmp_path / "merged.png"
    assert bench.main(["--merge", str(ours), str(fedavg), "--json", str(out), "--png", str(png)]) == 0
    written = json.loads(out.read_text())
    assert written["targets"]["speedup_vs_fedavg"]["value"] == 4.0
    assert [s["file"] for s in written["merged_from"]] == [str(ours), str(fedavg)]
    assert png.stat().st_size > 0
    with pytest.raises(SystemExit):  # without --json the merge would replace the committed result
        bench.main(["--merge", str(ours), str(fedavg)])


def test_centralized_trains_at_the_sites_batches_together_and_every_method_validates_alike(tmp_path: Path) -> None:
    bench = load_bench()
    args = bench.parse(["--json", str(tmp_path / "c.json")])
    assert (args.batch, args.central_batch) == (8, 24)  # three sites of batch 8: a data-parallel batch of 24
    configs = {m: bench.method_config(m, args, 4, tmp_path, tmp_path) for m in ("centralized", "ours", "fedavg")}
    assert {m: c.train.batch_size for m, c in configs.items()} == {"centralized": 24, "ours": 8, "fedavg": 8}
    assert {c.data.val_batch_size for c in configs.values()} == {8}  # the same validation windows for all
    assert bench.parse(["--speeds", "1,4", "--batch", "4"]).central_batch == 8
    assert bench.parse(["--central-batch", "8"]).central_batch == 8  # one process at the sites' batch
    with pytest.raises(SystemExit):
        bench.parse(["--central-batch", "-1"])
