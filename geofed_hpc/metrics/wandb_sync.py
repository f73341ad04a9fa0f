"""`geofed-hpc wandb sync RUN_DIR`: upload the offline W&B runs that compute nodes wrote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from geofed_hpc.errors import ConfigError, GeofedError
from geofed_hpc.log import logger

# What the wandb CLI prints when the failure is the login or the network, and what to do about each.
_LOGIN = ("no api key", "wandb login", "api key", "401", "unauthorized", "permission denied")
_NETWORK = ("connection", "timed out", "timeout", "network", "resolve", "unreachable", "name or service", "ssl")


def offline_runs(run_dir: Path) -> list[Path]:
    """Offline run folders under RUN_DIR (sites and PS write them under RUN_DIR/metrics/wandb)."""
    return sorted(p for p in Path(run_dir).glob("**/wandb/offline-run-*") if p.is_dir())


def sync_command(runs: list[Path]) -> list[str]:
    """`wandb sync` of these run folders. Folders named explicitly are synced whatever their mode, in every wandb
    release the project allows (`--include-offline` only ever applied to `--sync-all`, and 0.30 removed it)."""
    return [sys.executable, "-m", "wandb", "sync", *map(str, runs)]


def explain(output: str, code: int) -> str:
    """One line for a failed `wandb sync`: the login, the network, or wandb's own last error line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()] or lines
    last = errors[-1] if errors else f"exit code {code}"
    text = output.lower()
    if any(k in text for k in _LOGIN):
        return f"wandb sync: not logged in to W&B ({last}): run `wandb login` (or set WANDB_API_KEY) on this host"
    if any(k in text for k in _NETWORK):
        return f"wandb sync: the W&B server does not answer from this host ({last}): sync from a host that reaches it"
    return f"wandb sync failed: {last}"


def sync_offline_runs(run_dir: Path) -> int:
    runs = offline_runs(run_dir)
    if not runs:
        raise ConfigError(
            f"no offline W&B runs under {run_dir}: expected {run_dir}/metrics/wandb/offline-run-*; "
            "pass the run directory of a launch (run_dir=...)"
        )
    logger.debug("uploading %d offline W&B runs from %s", len(runs), run_dir)
    print(f"syncing {len(runs)} offline runs: {', '.join(p.name for p in runs)}", flush=True)
    proc = subprocess.Popen(
        sync_command(runs), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:  # wandb's progress, as it comes
        seen.append(line)
        print(line, end="", flush=True)
    code = proc.wait()
    if code != 0:
        raise GeofedError(explain("".join(seen[-40:]), code) + "; the offline runs are untouched, so you can retry")
    print(f"synced {len(runs)} runs")
    return 0
