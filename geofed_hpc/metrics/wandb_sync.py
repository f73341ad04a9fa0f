"""`geofed-hpc wandb sync RUN_DIR`: upload the offline W&B runs that compute nodes wrote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger


def offline_runs(run_dir: Path) -> list[Path]:
    """Offline run folders under RUN_DIR (sites and PS write them under RUN_DIR/metrics/wandb)."""
    return sorted(p for p in Path(run_dir).glob("**/wandb/offline-run-*") if p.is_dir())


def sync_command(runs: list[Path]) -> list[str]:
    return [sys.executable, "-m", "wandb", "sync", "--include-offline", *map(str, runs)]


def sync_offline_runs(run_dir: Path) -> int:
    runs = offline_runs(run_dir)
    if not runs:
        raise ConfigError(
            f"no offline W&B runs under {run_dir}: expected {run_dir}/metrics/wandb/offline-run-*; "
            "pass the run directory of a launch (run_dir=...)"
        )
    logger.info("uploading %d offline W&B runs from %s", len(runs), run_dir)
    print(f"syncing {len(runs)} offline runs: {', '.join(p.name for p in runs)}", flush=True)
    result = subprocess.run(sync_command(runs))
    if result.returncode != 0:
        print(
            "geofed-hpc: wandb sync failed: check `wandb login` (or WANDB_API_KEY) and that this host reaches "
            "the W&B server; the offline runs are untouched, so you can retry",
            file=sys.stderr,
        )
    return result.returncode
