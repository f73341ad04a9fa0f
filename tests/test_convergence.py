"""bench/convergence.py end to end, small: real sites at unequal speeds, ours and synchronous FedAvg both learn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_ours_and_fedavg_both_lower_the_validation_loss(tmp_path: Path) -> None:
    out, png = tmp_path / "convergence.json", tmp_path / "convergence.png"
    args = ["--minutes", "0.3", "--speeds", "1,4", "--sync-interval", "4s", "--methods", "ours,fedavg"]
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
