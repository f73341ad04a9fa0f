"""`geofed-hpc report RUN_DIR`: a loss-curve PNG and a short text summary from the metrics JSONL files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from geofed_hpc.errors import ConfigError
from geofed_hpc.metrics.recorder import read_jsonl


def load_records(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every recorder's JSONL under RUN_DIR/metrics (sites) and RUN_DIR/ps/metrics (an embedded PS), by name."""
    metrics_dir = Path(run_dir) / "metrics"
    files = sorted(metrics_dir.glob("*.metrics.jsonl")) + sorted((Path(run_dir) / "ps" / "metrics").glob("*.jsonl"))
    runs = {p.name.removesuffix(".metrics.jsonl"): read_jsonl(p) for p in files}
    runs = {name: recs for name, recs in runs.items() if recs}
    if not runs:
        raise ConfigError(
            f"no metrics in {metrics_dir}: expected <name>.metrics.jsonl files written by `geofed-hpc launch` "
            "or `ps up`; pass the run directory (the run_dir=... of the launch)"
        )
    return runs


def _series(records: Sequence[dict[str, Any]], key: str, t0: float) -> tuple[list[float], list[float]]:
    points = [(r["time"] - t0, float(r[key])) for r in records if key in r and "time" in r]
    return [p[0] / 60 for p in points], [p[1] for p in points]


def _global_val(runs: dict[str, list[dict[str, Any]]], t0: float) -> tuple[list[float], list[float]]:
    """One point per global version: the first validation loss any site recorded for it."""
    first: dict[Any, tuple[float, float]] = {}
    for recs in runs.values():
        for r in recs:
            for key in ("val/loss", "ps/global_val_loss"):
                if key in r and "time" in r:
                    version = r.get("sync/version", r.get("ps/version", r["time"]))
                    if version not in first or r["time"] < first[version][0]:
                        first[version] = (r["time"], float(r[key]))
    points = sorted(first.values())
    return [(t - t0) / 60 for t, _ in points], [v for _, v in points]


def summary_text(runs: dict[str, list[dict[str, Any]]]) -> str:
    lines = [f"{'run':<14}{'syncs':>6}{'last train loss':>17}{'last val loss':>15}{'tokens':>12}{'sent':>12}"]
    for name, recs in sorted(runs.items()):
        syncs = [r for r in recs if "train/loss" in r]
        vals = [r for r in recs if "val/loss" in r]
        sent = sum(int(r.get("sync/bytes_sent", 0)) for r in syncs)
        train = f"{syncs[-1]['train/loss']:.4f}" if syncs else "-"
        val = f"{vals[-1]['val/loss']:.4f}" if vals else "-"
        tokens = int(syncs[-1].get("train/tokens", 0)) if syncs else 0
        lines.append(f"{name:<14}{len(syncs):>6}{train:>17}{val:>15}{tokens:>12,}{sent / 2**20:>10.1f}MiB")
    evals = sorted((r for recs in runs.values() for r in recs if "val/loss" in r), key=lambda r: r["time"])
    if evals:
        first, last = evals[0], evals[-1]
        minutes = (last["time"] - first["time"]) / 60
        lines.append(
            f"global validation loss {first['val/loss']:.4f} -> {last['val/loss']:.4f} "
            f"(version {first.get('sync/version', '?')} -> {last.get('sync/version', '?')}) in {minutes:.1f} min"
        )
    return "\n".join(lines)


def write_report(run_dir: Path, out: Path | None = None) -> tuple[Path, str]:
    """Write RUN_DIR/report.png (or `out`): train loss per site and global validation loss vs wall-clock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load_records(run_dir)
    t0 = min(r["time"] for recs in runs.values() for r in recs if "time" in r)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    for name, recs in sorted(runs.items()):
        x, y = _series(recs, "train/loss", t0)
        if x:
            left.plot(x, y, marker="o", markersize=3, label=name)
    x, y = _global_val(runs, t0)
    if x:
        right.plot(x, y, color="black", marker="s", markersize=4, label="global model (evaluated on pull)")
    left.set(title="training loss per site", xlabel="wall-clock minutes", ylabel="loss")
    right.set(title="global validation loss", xlabel="wall-clock minutes", ylabel="loss")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"geofed-hpc run {Path(run_dir).resolve().name}")
    fig.tight_layout()
    target = Path(out) if out else Path(run_dir) / "report.png"
    fig.savefig(target)
    plt.close(fig)
    return target, summary_text(runs)
