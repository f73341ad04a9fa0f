"""Compression at equal tokens: the validation loss each codec (and downlink) reaches, against the bits it sends.

    python bench/compression.py --json docs/compression.json --png docs/compression.png   # ~25 min on 2 cores
    python bench/compression.py --rows fp32,sparse --seeds 0 --syncs 4 --json /tmp/c.json  # a quick look

The convergence setup (bench/convergence.py, whose helpers this reuses): three real site processes (ClientJob)
train tiny_llama on disjoint shards of the shipped King James Bible against a real ParameterServer over gRPC on
127.0.0.1. Here every site runs exactly --local-steps AdamW steps per sync and --syncs syncs (ps.aggregation=sync,
no wall-clock cut, equal speeds), so every row trains on the same tokens and only what is exchanged differs.
Rows (--rows):

  fp32, int8, int4, int2, sparse   uploads with that codec (error feedback on the site for the lossy ones);
                                   downlink "full": each pull is the whole fp32 model (ps.downlink_codec=fp32,
                                   ps.downlink_history=0)
  sparse+down                      sparse uploads and a compressed downlink: the PS publishes each update with
                                   ps.downlink_codec=sparse at ps.downlink_density (--down-density), keeps what it
                                   left out for the next update, and sites add the published updates

Per row and seed: upload and download bits per parameter (the mean over every push and every pull after a push,
counted from the sites' metrics) and the validation loss of the PS's final global model on --val-batches held-out
batches (the same windows for every row). Rows report the mean over --seeds and the loss penalty relative to
fp32's mean. The plot shows final validation loss against bits per parameter sent per sync.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convergence import ROOT, WORKER, _reap, _wait_ready, machine, model_config, prepare_data  # noqa: E402

ROWS = ("fp32", "int8", "int4", "int2", "sparse", "sparse+down")
SPARSE_KEYS = ("mean_row", "dense_below", "dense_codec", "chunk", "block_size")  # --sparse
CONVERGENCE = Path(__file__).resolve().parent / "convergence.py"  # its --site-worker runs one site process
RUN_TIMEOUT_S = 900.0


def row_config(row: str, args: argparse.Namespace, seed: int, run_dir: Path, shards: Path) -> Any:
    """The RunConfig of one row and seed (the PS's; sites take it as it is)."""
    from geofed_hpc.config import CodecConfig, DataConfig, PSConfig, RunConfig, SiteConfig, TrainConfig

    name, compressed = row.removesuffix("+down"), row.endswith("+down")
    ps: dict[str, Any] = {"aggregation": "sync", "outer_optimizer": args.outer, "global_lr": args.global_lr}
    if args.outer == "nesterov":
        ps["momentum"] = 0.9
    if compressed:
        ps.update(downlink_codec="sparse", downlink_density=args.down_density, downlink_history=4 * args.syncs)
    else:
        ps.update(downlink_codec="fp32", downlink_history=0)
    return RunConfig(
        federation=f"compression-{row.replace('+', '-')}",
        run_dir=str(run_dir),
        wandb_mode="disabled",
        verbosity=0,
        site=SiteConfig(name="site", num_sites=args.sites),
        model=model_config(args.model),
        ps=PSConfig(host="127.0.0.1", port=0, insecure=True, round_timeout="10m", **ps),
        codec=CodecConfig(name=name, density=args.density, value_bits=args.value_bits, **sparse_fields(name, args)),
        data=DataConfig(source=str(shards), val_batches=1, val_batch_size=args.batch),
        train=TrainConfig(
            lr=args.lr,
            batch_size=args.batch,
            sync_interval=timedelta(hours=1),
            max_local_steps=args.local_steps,
            max_syncs=args.syncs,
            eval_interval=timedelta(hours=1),
            keep_best=0,
            seed=seed,
            threads=1,
        ),
    )


def sparse_fields(codec: str, args: argparse.Namespace) -> dict[str, Any]:
    """--sparse KEY=VALUE settings, for the sparse rows only (e.g. mean_row=false dense_below=0: top-k alone)."""
    return dict(args.sparse) if codec == "sparse" else {}


def run_row(row: str, seed: int, args: argparse.Namespace, work: Path, shards: Path) -> dict[str, Any]:
    """Start the PS and the sites, let every site finish its syncs; measure bits and the final model's loss."""
    from geofed_hpc.config import to_dict
    from geofed_hpc.ps.app import ParameterServer

    run_dir = work / f"{row}-{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cfg = row_config(row, args, seed, run_dir, shards)
    t0 = time.time()
    server = ParameterServer(cfg)
    go = run_dir / "go"
    procs: list[subprocess.Popen] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", WANDB_SILENT="true", PYTHONPATH=str(ROOT))
    try:
        cfg_file = run_dir / "site.json"
        cfg_file.write_text(json.dumps(to_dict(cfg)))
        for i in range(args.sites):
            with open(run_dir / f"site-{i}.log", "ab") as log:
                cmd = [sys.executable, str(CONVERGENCE), WORKER, str(cfg_file), str(i), server.address, str(go)]
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        _wait_ready(procs, go, run_dir)
        go.touch()
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        _reap(procs)
        params = {k: v.copy() for k, v in (server.logic.core.model.params or {}).items()}
        version = server.logic.version
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        server.stop(grace=timedelta(seconds=5))
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        log = (run_dir / f"site-{failed[0]}.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"{row} seed {seed}: site {failed[0]} failed (exit {procs[failed[0]].returncode}):\n{log}")
    numel = sum(int(v.size) for v in params.values())
    up, down = transfers(run_dir / "metrics")
    result = {
        "row": row,
        "seed": seed,
        "version": version,
        "upload_bits_per_param": 8 * statistics.mean(up) / numel,
        "download_bits_per_param": 8 * statistics.mean(down) / numel,
        "pushes": len(up),
        "val_loss": val_loss(cfg, params, args.val_batches, shards),
        "wall_s": round(time.time() - t0, 1),
    }
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def transfers(metrics_dir: Path) -> tuple[list[int], list[int]]:
    """Bytes of every push, and of every pull after a push (the first pull, a full model, left out)."""
    from geofed_hpc.metrics import read_jsonl

    up, down = [], []
    for path in sorted(metrics_dir.glob("*.metrics.jsonl")):
        for r in read_jsonl(path):
            if "sync/local_steps" in r and "train/loss" in r:
                up.append(int(r.get("sync/bytes_sent", 0) or 0))
                down.append(int(r.get("sync/bytes_received", 0) or 0))
    if not up:
        raise SystemExit(f"no sync was recorded in {metrics_dir}")
    return up, down


def val_loss(cfg: Any, params: dict[str, Any], batches: int, shards: Path) -> float:
    """The mean loss of the global model `params` on the first `batches` validation batches."""
    import torch

    from geofed_hpc.client.fsdp import load_full_state
    from geofed_hpc.data import eval_batches
    from geofed_hpc.data.shards import site_tokens
    from geofed_hpc.models import build_model

    torch.set_num_threads(2)
    model = build_model(cfg.model, seed=0)
    load_full_state(model, {k: torch.from_numpy(v) for k, v in params.items()})
    _, val = site_tokens(cfg.data, cfg.model.vocab_size, 0, cfg.site.shards)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in eval_batches(val, cfg.train.batch_size, cfg.model.context, batches):
            total += float(model(x, y)[1]) * x.size(0)
            count += x.size(0)
    return total / count


def summarize(runs: list[dict[str, Any]], rows: list[str]) -> list[dict[str, Any]]:
    """One row per codec and downlink, exactly the issue's keys: means over seeds; the loss penalty relative to
    fp32's mean (each seed's loss is in the report's "runs")."""
    out = []
    for row in rows:
        mine = [r for r in runs if r["row"] == row]
        out.append(
            {
                "codec": row.removesuffix("+down"),
                "downlink": "compressed" if row.endswith("+down") else "full",
                "upload_bits_per_param": round(statistics.mean(r["upload_bits_per_param"] for r in mine), 4),
                "download_bits_per_param": round(statistics.mean(r["download_bits_per_param"] for r in mine), 4),
                "final_val_loss": round(statistics.mean(r["val_loss"] for r in mine), 4),
            }
        )
    ref = next((r["final_val_loss"] for r in out if r["codec"] == "fp32" and r["downlink"] == "full"), None)
    for r in out:
        r["loss_penalty_vs_fp32"] = None if ref is None else round(r["final_val_loss"] / ref - 1, 4)
    return out


def checks_for(table: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets: sparse up <= 0.5 bits/param (stretch 0.25) within 1% of fp32; with the compressed
    downlink, down <= 2 bits/param within the same 1%."""
    out: dict[str, Any] = {}
    for r in table:
        if r["codec"] != "sparse" or r["loss_penalty_vs_fp32"] is None:
            continue
        if r["downlink"] == "full":
            out["sparse_upload"] = {
                "bits": r["upload_bits_per_param"],
                "penalty": r["loss_penalty_vs_fp32"],
                "met": r["upload_bits_per_param"] <= 0.5 and r["loss_penalty_vs_fp32"] <= 0.01,
                "stretch_met": r["upload_bits_per_param"] <= 0.25 and r["loss_penalty_vs_fp32"] <= 0.01,
            }
        else:
            out["sparse_compressed_downlink"] = {
                "bits": r["download_bits_per_param"],
                "penalty": r["loss_penalty_vs_fp32"],
                "met": r["download_bits_per_param"] <= 2.0 and r["loss_penalty_vs_fp32"] <= 0.01,
            }
    return out


def print_table(table: list[dict[str, Any]]) -> None:
    head = f"{'codec':<8}{'downlink':<12}{'up bits/param':>14}{'down bits/param':>16}{'val loss':>10}{'penalty':>9}"
    print(head)
    print("-" * len(head))
    for r in table:
        pen = r["loss_penalty_vs_fp32"]
        print(
            f"{r['codec']:<8}{r['downlink']:<12}{r['upload_bits_per_param']:>14.3f}"
            f"{r['download_bits_per_param']:>16.3f}{r['final_val_loss']:>10.4f}"
            + (f"{100 * pen:>8.2f}%" if pen is not None else f"{'-':>9}")
        )


def plot(table: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for r in table:
        label = f"{r['codec']} ({r['downlink']} downlink)"
        up, total = r["upload_bits_per_param"], r["upload_bits_per_param"] + r["download_bits_per_param"]
        dots = ax.plot([up], [r["final_val_loss"]], "o", label=label)
        ax.plot([total], [r["final_val_loss"]], "s", color=dots[0].get_color(), fillstyle="none")
        ax.plot([up, total], [r["final_val_loss"]] * 2, ":", color=dots[0].get_color(), linewidth=0.8)
    ref = next((r["final_val_loss"] for r in table if r["codec"] == "fp32" and r["downlink"] == "full"), None)
    if ref is not None:
        ax.axhline(ref * 1.01, color="grey", linestyle="--", linewidth=0.8, label="fp32 + 1%")
    ax.set_xscale("log")
    ax.set_xlabel("bits per parameter per sync (dot: upload; square: upload + download)")
    ax.set_ylabel("validation loss of the final global model")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=Path("docs/compression.json"))
    p.add_argument("--png", type=Path, default=None, help="final validation loss against bits sent")
    p.add_argument("--rows", default=",".join(ROWS), help=f"a subset of {','.join(ROWS)}")
    p.add_argument("--seeds", default="0,1", help="site seeds (batches and model init), one run per row each")
    p.add_argument("--syncs", type=int, default=24, help="syncs per site (train.max_syncs)")
    p.add_argument("--local-steps", type=int, default=6, help="AdamW steps per sync (train.max_local_steps)")
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="sequences per step of each site")
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate (the project's default)")
    p.add_argument("--outer", choices=("plain", "nesterov"), default="plain", help="ps.outer_optimizer")
    p.add_argument("--global-lr", type=float, default=1.0, help="ps.global_lr")
    p.add_argument("--density", type=float, default=1 / 64, help="codec.density of the sparse uploads")
    p.add_argument("--value-bits", type=int, default=2, help="codec.value_bits of the sparse uploads")
    p.add_argument("--down-density", type=float, default=1 / 16, help="ps.downlink_density of sparse+down")
    p.add_argument(
        "--sparse",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help=f"more codec.* of the sparse rows, one of {', '.join(SPARSE_KEYS)} (mean_row=false dense_below=0: the "
        "top-k alone)",
    )
    p.add_argument("--val-batches", type=int, default=24, help="validation batches the final model is scored on")
    p.add_argument("--model", default="tiny_llama", help="a conf/model/*.yaml option")
    p.add_argument("--cache-dir", default="", help="token cache (default $GEOFED_CACHE or ~/.cache/geofed_hpc)")
    p.add_argument("--work-dir", type=Path, default=None, help="run folders (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep each run's folder (logs, checkpoints, metrics)")
    args = p.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if not args.rows or set(args.rows) - set(ROWS):
        p.error(f"--rows: choose from {','.join(ROWS)}")
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    pairs = [item.partition("=") for item in args.sparse]
    if any(not eq or key not in SPARSE_KEYS for key, eq, _ in pairs):
        p.error(f"--sparse: give KEY=VALUE with KEY one of {', '.join(SPARSE_KEYS)}, got {' '.join(args.sparse)}")
    args.sparse = {key: yaml.safe_load(value) for key, _, value in pairs}
    if not args.seeds or min(args.syncs, args.local_steps, args.sites, args.batch) < 1:
        p.error("--seeds, --syncs, --local-steps, --sites and --batch must be given and positive")
    # what prepare_data (bench/convergence.py) reads
    args.speeds, args.shards_per_site, args.eval_on = [1.0] * args.sites, 8, "val"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.time()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="geofed-compression-"))
    work.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(f"compression: {', '.join(args.rows)} x seeds {args.seeds} on {info['cpus']} CPUs ({info['uptime']})")
    runs = []
    try:
        shards = prepare_data(args, work)
        for seed in args.seeds:
            for row in args.rows:
                r = run_row(row, seed, args, work, shards)
                runs.append(r)
                print(
                    f"  {row:<12} seed {seed}: up {r['upload_bits_per_param']:.3f} down "
                    f"{r['download_bits_per_param']:.3f} bits/param, val loss {r['val_loss']:.4f} ({r['wall_s']:.0f}s)",
                    flush=True,
                )
    finally:
        if args.work_dir is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    table = summarize(runs, args.rows)
    info["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("json", "png")}
    wall = round(time.time() - started, 1)
    report = {"config": config, "machine": info, "rows": table, "targets": checks_for(table), "runs": runs}
    report["total_wall_s"] = wall
    print()
    print_table(table)
    for name, check in report["targets"].items():
        print(f"{name}: {check}")
    print(f"total {wall / 60:.1f} min")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    if args.png:
        title = (
            f"tiny_llama, {args.sites} sites x {args.syncs} syncs x {args.local_steps} steps (batch {args.batch}), "
            f"{args.outer} outer, seeds {args.seeds}"
        )
        plot(table, args.png, title)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
