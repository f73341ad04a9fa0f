"""Goodput benchmark: three real sites and `ps up` over an emulated WAN link, per sync mode and aggregation (root)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from geofed_hpc.metrics import read_jsonl
from geofed_hpc.testing.federation import TINY, WanFederation
from geofed_hpc.testing.wan import FAR, NEAR, Wan, exit_on_sigterm, unavailable_reason

LINKS = {"near": NEAR, "far": FAR}
SITES = 3
# Local steps per sync (H). DiLoCo-style runs use H of 100-500 inner steps: with a real model an interval lasts
# minutes and a sync seconds. With the tiny model at full speed a step takes ~0.1 s and a sync over the far link
# ~5-7 s: at H=100 an interval lasts at least a sync, as in such a run. --steps 6 is the communication-bound case.
STEPS = 100
BASELINE = "blocking"  # today's loop: train, push, wait for the version, pull, evaluate, checkpoint (in the background)
# Each mode's site overrides. `inline_ckpt` is the loop as it was before checkpoints left the training path;
# `overlap` pushes and pulls on a background sender while the site trains on (train.overlap, docs/overlap.md).
MODES: dict[str, list[str]] = {
    "blocking": ["train.overlap=false"],
    "inline_ckpt": ["train.overlap=false", "train.background_checkpoint=false"],
    "overlap": ["train.overlap=true"],
}


def run_one(
    mode: str,
    aggregation: str,
    link: str,
    workdir: Path,
    syncs: int,
    steps: int,
    slowdown: float = 1.0,
    step_time: float = 0.0,
) -> dict[str, Any]:
    """One federation: the PS and SITES sites, every site behind its own copy of `link`; its row. `slowdown`
    (train.slowdown) and `step_time` (train.step_time, seconds), every row alike, stand in for a larger model's
    compute per step; step_time is the same emulated accelerator time in every row, whatever the load."""
    names = [f"{link}{i}" for i in range(SITES)]
    with Wan({name: LINKS[link] for name in names}, workdir / "wan") as wan:
        # every site trains `steps` steps per sync, `syncs` syncs: the same tokens per site in every row
        cadence = [f"train.max_local_steps={steps}", "ps.round_timeout=10m", f"ps.min_sites={SITES}"]
        cadence += [f"train.slowdown={slowdown}", f"train.step_time={step_time}s"]
        fed = WanFederation(wan, workdir, sync_interval="600s", max_syncs=syncs, extra=cadence)
        fed.start_ps(f"ps.aggregation={aggregation}")
        for name in names:
            fed.launch(name, *MODES[mode])
        codes = fed.wait(timedelta(minutes=20))
        if any(codes.values()):
            raise SystemExit(f"{mode}/{aggregation}/{link}: a site failed {codes}:\n{fed.logs()}")
        goodputs, rates, losses, tokens = [], [], [], []
        for name in names:
            events = read_jsonl(fed.run_dir(name) / "sites" / f"{name}-0" / "events.jsonl")
            (summary,) = [e for e in events if e["event"] == "goodput"]
            goodputs.append(summary["step_seconds"] / summary["wall_seconds"])
            rates.append(summary["tokens"] / summary["wall_seconds"])
            tokens.append(summary["tokens"])
            last = fed.syncs(name)[-1]
            losses.append(last["val/loss"])
        return {
            "mode": mode,
            "aggregation": aggregation,
            "link": link,
            "link_spec": LINKS[link].describe(),
            "sites": SITES,
            "syncs": syncs,
            "steps_per_sync": steps,
            "slowdown": slowdown,
            "step_time_s": step_time,
            "goodput": statistics.mean(goodputs),
            "goodput_per_site": goodputs,
            "tokens_per_site": tokens,  # equal across rows unless a sync-mode "sync now" cut an interval short
            "load_average_1m": os.getloadavg()[0],  # at the row's end: other work on the machine
            "tokens_per_s": sum(rates),  # the federation's: each site's tokens over its first-to-last-step seconds
            "final_val_loss": statistics.mean(losses),
        }


ROW_KEYS = ("mode", "aggregation", "link", "goodput", "tokens_per_s", "final_val_loss", "loss_penalty_vs_blocking")


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, default=Path("bench/results/goodput.json"))
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--aggregations", nargs="*", default=["sync", "async"], choices=["sync", "async"])
    parser.add_argument("--links", nargs="*", default=list(LINKS), choices=list(LINKS))
    parser.add_argument("--syncs", type=int, default=4)
    parser.add_argument(
        "--steps",
        type=int,
        default=STEPS,
        help=f"local steps per sync, the same for every row (default {STEPS}: an interval lasts at least a sync over "
        "the far link at full speed, as DiLoCo's H of 100-500 does with a real model; 6: the communication-bound "
        "case, where a sync lasts many intervals)",
    )
    parser.add_argument("--slowdown", type=float, default=1.0, help="train.slowdown of every site in every row")
    parser.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="train.step_time (seconds) of every site in every row: emulated accelerator time added to each step",
    )
    parser.add_argument("--show", action="store_true", help="only print the table of an existing --json file")
    args = parser.parse_args()
    if args.show:
        print_table(json.loads(args.json.read_text()), args.json)
        return
    reason = unavailable_reason()
    if reason:
        sys.exit(f"bench/goodput.py: {reason}")
    modes = sorted(set(args.modes) | {BASELINE}, key=lambda m: m != BASELINE)  # the baseline, in the same run
    rows: list[dict[str, Any]] = []
    started, load_before = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="geofed-goodput-bench-") as tmp:
        for link in args.links:
            for aggregation in args.aggregations:
                for mode in modes:
                    where = Path(tmp) / f"{mode}-{aggregation}-{link}"
                    row = run_one(mode, aggregation, link, where, args.syncs, args.steps, args.slowdown, args.step_time)
                    rows.append(row)
                    print(f"{mode} {aggregation} {link}: goodput {rows[-1]['goodput']:.3f}", flush=True)
    base = {(r["aggregation"], r["link"]): r for r in rows if r["mode"] == BASELINE}
    for r in rows:
        b = base[(r["aggregation"], r["link"])]
        r["loss_penalty_vs_blocking"] = r["final_val_loss"] / b["final_val_loss"] - 1.0
        r["tokens_per_s_vs_blocking"] = r["tokens_per_s"] / b["tokens_per_s"]
    out = {
        "bench": "goodput",
        "baseline": BASELINE,
        "model": TINY,
        "seconds": time.time() - started,
        "load_average": {"start": load_before, "end": os.getloadavg()},  # 1, 5, 15 min: other work on the machine
        "rows": [{k: r[k] for k in ROW_KEYS} for r in rows],  # exactly the keys the issue names
        # per-site goodput, link spec and counts of the same rows, in the same order
        "details": [{k: v for k, v in r.items() if k not in ROW_KEYS[3:]} for r in rows],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    print_table(out, args.json)


def print_table(out: dict[str, Any], path: Path) -> None:
    print(f"{'mode':<13}{'aggregation':<12}{'link':<6}{'goodput':>9}{'tokens/s':>10}{'val loss':>10}"
          f"{'loss vs base':>14}{'tok/s vs base':>15}")  # fmt: skip
    for r, d in zip(out["rows"], out["details"], strict=True):
        print(
            f"{r['mode']:<13}{r['aggregation']:<12}{r['link']:<6}{r['goodput']:>9.3f}{r['tokens_per_s']:>10.0f}"
            f"{r['final_val_loss']:>10.4f}{r['loss_penalty_vs_blocking']:>+13.2%}"
            f"{d['tokens_per_s_vs_blocking']:>14.2f}x"
        )
    first = out["details"][0]
    slow = f", train.slowdown={first['slowdown']:g}" if first.get("slowdown", 1.0) != 1.0 else ""
    slow += f", train.step_time={first['step_time_s']:g}s" if first.get("step_time_s", 0.0) else ""
    print(f"{first['sites']} sites per row, {first['syncs']} syncs of {first['steps_per_sync']} steps{slow}; {path}")


if __name__ == "__main__":
    main()
