"""The whole local federation as a user runs it: embedded PS + two submitit sites, then a resume."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.metrics import read_jsonl

pytestmark = pytest.mark.slow

ROW = re.compile(r"^(local-\d)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+ \w+\s+([\d.]+)x$")


def launch(run_dir: Path, cache: Path, max_syncs: int) -> subprocess.CompletedProcess:
    args = [
        "launch",
        "site=local",
        "model=tiny",
        f"run_dir={run_dir}",
        f"train.max_syncs={max_syncs}",
        "train.sync_interval=2s",
        "ps.min_sites=2",  # rounds of both sites, however late one starts
        "ps.round_timeout=10m",  # and closed on their pushes, never on a timeout
        "data.max_tokens=60000",
        "data.val_batches=2",
        f"data.cache_dir={cache}",
    ]
    return subprocess.run(
        [sys.executable, "-m", "geofed_hpc.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=run_dir.parent,
        env={**os.environ, "WANDB_SILENT": "true"},
    )


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "geofed_hpc.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_two_sites_lower_the_global_validation_loss_and_resume(tmp_path: Path) -> None:
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    first = launch(run_dir, cache, max_syncs=2)
    assert first.returncode == 0, first.stdout + first.stderr
    rows = [ROW.match(line) for line in first.stdout.splitlines()]
    rows = [r for r in rows if r]
    assert sorted((r[1], int(r[2])) for r in rows) == [("local-0", 1), ("local-0", 2), ("local-1", 1), ("local-1", 2)]
    assert all(float(r[7]) > 1.0 for r in rows)  # int8 deltas compress
    summary = re.search(r"global validation loss: ([\d.]+) at version 0 -> ([\d.]+) at version 2", first.stdout)
    assert summary, first.stdout
    assert float(summary[2]) < float(summary[1])

    for site in ("local-0", "local-1"):
        tensors, meta, _ = CheckpointStore(run_dir / "sites" / site / "ckpt", prefix="site").load_latest()
        assert meta["version"] == 2 and meta["syncs"] == 2 and any(k.startswith("optim/") for k in tensors)
    assert CheckpointStore(run_dir / "ps", prefix="global").latest_step() == 2
    offline = list((run_dir / "metrics" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 2
    assert not (run_dir / "submitit" / "%j").exists()  # only the jobs' own folders
    # a local launch records itself as a Slurm launch does: `status` and `logs` find its jobs afterwards
    record = json.loads((run_dir / "launch.json").read_text())
    assert [j["executor"] for j in record["jobs"]] == ["local", "local"]
    assert (run_dir / "launch.json").stat().st_mode & 0o777 == 0o600  # it holds the sites' config, tokens included
    assert (run_dir / "submitit").stat().st_mode & 0o777 == 0o700  # so do the jobs' pickles below it
    status = cli(["status", f"run_dir={run_dir}"], run_dir.parent)
    assert status.returncode == 0, status.stderr
    table = status.stdout.splitlines()
    assert [line.split()[0] for line in table[1:3]] == ["local-0", "local-1"]
    assert all(line.split()[-1] == "COMPLETED" for line in table[1:3]), status.stdout
    assert "embedded in `launch`" in status.stdout and "which has ended" in status.stdout
    logs = cli(["logs", f"run_dir={run_dir}"], run_dir.parent)
    assert logs.returncode == 0 and "==> local-0 job" in logs.stdout, logs.stderr

    second = launch(run_dir, cache, max_syncs=3)  # PS restores version 2; sites resume from their checkpoints
    assert second.returncode == 0, second.stdout + second.stderr
    assert "at version 3" in second.stdout
    for site in ("local-0", "local-1"):
        records = read_jsonl(run_dir / "metrics" / f"{site}.metrics.jsonl")
        sources = [r["resume/source"] for r in records if "resume/source" in r]
        assert sources == ["fresh", "local"], json.dumps(records[-3:])
        syncs = [r["sync/index"] for r in records if "train/loss" in r]
        assert syncs == [1, 2, 3]
