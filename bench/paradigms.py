"""Paradigm benchmark: bytes exchanged per round and eval loss after a fixed number of rounds, per paradigm.

    python bench/paradigms.py --json paradigms.json         # 2 sites, 5 rounds of 4 steps, a 3.3M GPT-2 shape

For each paradigm a local PS runs in this process and two sites run as their own processes (this script with
--site, exactly as a Slurm task runs ClientJob) on the same token shards, seeds and cadence. Bytes per round:
what the sites pushed plus what they pulled, summed over both sites, averaged over the rounds after the first
full download (the bootstrap: a fresh site always takes the whole model once). bytes_vs_full compares with
the identity paradigm (pretraining) measured in the same run. Eval loss: site 0's validation loss of the model
it holds after the last round. Expectations: lora under 2% of the full bytes, zo under 1 KB per step.
Output: a list of {"paradigm", "bytes_per_round", "bytes_vs_full", "bytes_per_step", "eval_loss", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PARADIGMS = ("identity", "lora", "hybrid_lora", "ravan", "zo")
LR = {"identity": 3e-3, "lora": 2e-2, "hybrid_lora": 3e-3, "ravan": 2e-2, "zo": 3e-3}


def site_main(cfg_file: str, index: str, address: str) -> None:
    from geofed_hpc.client.job import ClientJob

    ClientJob(json.loads(Path(cfg_file).read_text()), int(index), address)()


def run_paradigm(name: str, work: Path, shards: Path, args: argparse.Namespace) -> dict[str, Any]:
    from geofed_hpc.cli import compose_config
    from geofed_hpc.config import to_dict
    from geofed_hpc.metrics import read_jsonl
    from geofed_hpc.ps.app import ParameterServer

    folder = work / name
    overrides = [
        f"paradigm={name}",
        "model=tiny",
        f"model.context={args.context}",
        "site.num_sites=2",
        f"run_dir={folder}",
        "wandb_mode=disabled",
        f"data.source={shards}",
        "data.val_batches=4",
        f"train.max_syncs={args.rounds}",
        f"train.max_local_steps={args.steps}",
        "train.sync_interval=10m",
        f"train.lr={LR[name]}",
        "ps.port=0",
        "ps.round_timeout=10m",
        f"ps.state_dir={folder / 'ps'}",
    ]
    cfg, _ = compose_config(overrides)
    ps = ParameterServer(cfg)
    cfg_file = folder / "site.json"
    cfg_file.write_text(json.dumps(to_dict(cfg)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "RANK", "WORLD_SIZE"))}
    env.update(WANDB_SILENT="true", OMP_NUM_THREADS="1")
    procs = []
    t0 = time.time()
    try:
        for i in range(2):
            with open(folder / f"site-{i}.log", "ab") as out:
                cmd = [sys.executable, __file__, "--site", str(cfg_file), str(i), ps.address]
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
        for i, p in enumerate(procs):
            if p.wait(timeout=1800) != 0:
                raise SystemExit(f"{name}: site {i} failed, see {folder / f'site-{i}.log'}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=60)
        ps.stop()
    per_round: list[int] = []
    loss = float("nan")
    for i in range(2):
        rows = [r for r in read_jsonl(folder / "metrics" / f"local-{i}.metrics.jsonl") if "sync/bytes_received" in r]
        later = rows[1:]  # the first round's pull follows the bootstrap download
        per_round.append(sum(int(r["sync/bytes_sent"]) + int(r["sync/bytes_received"]) for r in later) // len(later))
        if i == 0:
            loss = float(rows[-1]["val/loss"])
    total = sum(per_round)
    return {
        "paradigm": name,
        "describe": cfg.paradigm.describe(),
        "bytes_per_round": total,
        "bytes_per_step": total / args.steps,
        "eval_loss": round(loss, 4),
        "seconds": round(time.time() - t0, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("paradigms.json"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="local steps per round (train.max_local_steps)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--only", nargs="*", default=list(PARADIGMS), choices=PARADIGMS)
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--site", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.site:
        site_main(*args.site)
        return

    from geofed_hpc.config import DataConfig
    from geofed_hpc.data.prepare import prepare_shards

    work = args.work or Path(tempfile.mkdtemp(prefix="paradigms-"))
    shards = work / "shards"
    prepare_shards(
        DataConfig(tokenizer="gpt2", source="bible", max_tokens=200_000, cache_dir=str(work / "cache")), shards, 2
    )
    names = ["identity", *[n for n in args.only if n != "identity"]]  # the baseline always runs
    results = [run_paradigm(name, work, shards, args) for name in names]
    full = results[0]["bytes_per_round"]
    for r in results:
        r["bytes_vs_full"] = round(r["bytes_per_round"] / full, 6)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"{'paradigm':<13}{'bytes/round':>14}{'vs full':>10}{'bytes/step':>12}{'eval loss':>11}")
    for r in results:
        print(
            f"{r['paradigm']:<13}{r['bytes_per_round']:>14,}{r['bytes_vs_full']:>10.4%}"
            f"{r['bytes_per_step']:>12,.0f}{r['eval_loss']:>11.4f}"
        )
    lora = next((r for r in results if r["paradigm"] == "lora"), None)
    zo = next((r for r in results if r["paradigm"] == "zo"), None)
    if lora:
        print(f"lora: {lora['bytes_vs_full']:.3%} of the full bytes (target < 2%)")
    if zo:
        print(f"zo: {zo['bytes_per_step']:.0f} bytes per step (target < 1024)")
    print(f"{args.rounds} rounds x {args.steps} steps, 2 sites; wrote {args.json}")


if __name__ == "__main__":
    main()
