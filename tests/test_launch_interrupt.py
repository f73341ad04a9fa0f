"""Ctrl-C on a local `launch` is a clean stop: every site checkpoints, one line says a rerun resumes, and the rerun
counts the run's syncs on from where they were (train.max_syncs is the run's, not the launch's)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.metrics import read_jsonl
from tests.site_procs import wait_for

pytestmark = pytest.mark.slow
SITES = ("local-0", "local-1")


def args(run_dir: Path, cache: Path) -> list[str]:
    return [
        "launch",
        "site=local",
        "model=tiny",
        f"run_dir={run_dir}",
        "train.max_syncs=4",
        "train.sync_interval=2s",
        "data.max_tokens=60000",
        "data.val_batches=2",
        f"data.cache_dir={cache}",
    ]


def test_ctrl_c_stops_every_site_with_a_checkpoint_and_a_rerun_resumes(tmp_path: Path) -> None:
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    env = {**os.environ, "WANDB_SILENT": "true"}
    # its own process group, as a terminal's foreground job: Ctrl-C is SIGINT to every process of the group. SIGINT
    # as a terminal leaves it, whatever this test inherited (a shell's background job starts with SIGINT ignored).
    proc = subprocess.Popen(
        [sys.executable, "-m", "geofed_hpc.cli", *args(run_dir, cache)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()

    def training() -> bool:  # a sync made, and both sites past their start (one may start late on a busy machine)
        synced = any(re.match(r"^local-\d\s+1\s", ln) for ln in lines)
        return synced and all(any(e["event"] == "first_step" for e in site_events(run_dir, s)) for s in SITES)

    try:
        wait_for(lambda: training() or proc.poll() is not None, 300, "a sync, with both sites training")
        assert proc.poll() is None, "".join(lines)
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    err = proc.stderr.read() if proc.stderr else ""
    out = "".join(lines)
    assert code == 130, out + err
    assert "interrupted: stopping the sites" in out and f"run the same command again to resume from {run_dir}" in out
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "submitit").glob("*/*_log.*"))
    assert "Traceback" not in logs and "KeyboardInterrupt" not in logs, logs[-3000:]
    stopped_at = {}
    for site in SITES:
        events = site_events(run_dir, site)
        assert any(e["event"] == "signal" and e["signal"] == "SIGTERM" for e in events), events[-5:]
        _, meta, _ = CheckpointStore(run_dir / "sites" / site / "ckpt", prefix="site").load_latest()
        stopped_at[site] = meta["syncs"]
    assert all(n < 4 for n in stopped_at.values()), stopped_at  # each wrote one as it stopped
    time.sleep(0.5)
    again = subprocess.run(
        [sys.executable, "-m", "geofed_hpc.cli", *args(run_dir, cache)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    for site in SITES:
        records = read_jsonl(run_dir / "metrics" / f"{site}.metrics.jsonl")
        syncs = [r["sync/index"] for r in records if "train/loss" in r]
        assert syncs == [1, 2, 3, 4], (site, syncs)  # four syncs in the run, across its two launches


def site_events(run_dir: Path, site: str) -> list[dict[str, Any]]:
    path = run_dir / "sites" / site / "events.jsonl"
    return read_jsonl(path) if path.exists() else []
