"""Convergence under unequal site speeds: ours (async, wall-clock cadence, int8) against synchronous FedAvg,
DiLoCo, FedNova and centralized training, as validation loss against wall-clock seconds.

    python bench/convergence.py --json docs/convergence.json --png docs/convergence.png   # ~15 min on 2 cores
    python bench/convergence.py --minutes 0.5 --methods ours,fedavg --json /tmp/c.json     # a quick look
    python bench/convergence.py --speeds 1,1,4 --codec int4 --sync-interval 20s --json /tmp/c.json
    python bench/convergence.py --merge /tmp/ours.json /tmp/fedavg.json --json /tmp/m.json   # runs of unequal budget

Three sites (one per entry of --speeds) train a small Llama-style model (conf/model/tiny_llama.yaml, 3.3M
parameters) on disjoint shards of the shipped King James Bible, as real site processes (ClientJob, the job class
a Slurm site runs) talking real gRPC to a real ParameterServer on 127.0.0.1. A site of speed s is throttled with
train.slowdown = max(speeds)/s: after each step it sleeps (slowdown-1)x that step's compute time, so the speed
ratio holds under any load. Every federated method gets the same wall-clock budget (--minutes), counted from
the moment all site processes are released at once:

  ours         ps.aggregation=async (eta 1/sqrt(sites)), ps.weighting=tokens (a delta counts its tokens over the
               mean of recent deltas'), one push every --sync-interval, --codec deltas
  fedavg       ps.aggregation=sync, H local steps on every site (no wall-clock cut), --baseline-codec
  diloco       as fedavg, outer Nesterov momentum (ps.outer_optimizer=nesterov, global lr 0.7, momentum 0.9)
  fednova      ps.aggregation=sync with the wall-clock cut (unequal local steps), ps.outer_optimizer=fednova
  centralized  one process on the union of the data, full speed, for sum(speeds)/max(speeds) x the budget
               (the same compute-seconds as all sites together), at the sites' batches together (--batch x
               sites: the global batch of a data-parallel job on the sites' processors in one place; see
               --central-batch); it syncs to a one-site PS with fp32 deltas only so that its curve is
               measured the same way

H is the slowest site's median steps per sync in ours' run (or --local-steps; or, without ours, the steps it
manages in one sync interval by a short timing here). Every site evaluates the global model it pulls on the same
held-out tail of the corpus (--val-batches batches of --batch sequences, whatever a method's training batch), at
most once per --eval-interval (train.eval_interval, 10 s for every method); the curve of a method is each newer
version's loss at the time it was evaluated. The target loss is fixed before any federated method runs: the
centralized run's validation loss at half its budget (or --target). Nothing is tuned on the validation set: the
inner learning rate is the project's default, 3e-3 (on the development set 2e-3 and 6e-3 did no better at either
batch, nor 4e-3 at the centralized one), DiLoCo's and FedNova's outer settings the published ones, and ours' and
FedAvg's eta (--ours-global-lr 1/sqrt(sites), --fedavg-global-lr 1), ours' weighting and sync interval were chosen
with --eval-on dev, on held-out tokens disjoint from the validation batches (docs/convergence-history.md).

A method that does not reach the target within the budget reports null, and ours' speedup over FedAvg is then
only bounded. To measure it, run ours and FedAvg with the same --target and a budget long enough for each, then
join the two JSON files with --merge (docs/convergence.md, "Time to the target").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("centralized", "ours", "fedavg", "diloco", "fednova")
WORKER = "--site-worker"
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 90.0


# ------------------------------------------------------------------ one site process
def site_worker(cfg_file: str, index: str, address: str, go: str) -> int:
    """A site process: import everything first, say so, wait for the common start, then run the real job."""
    from geofed_hpc.client import trainer  # noqa: F401 - torch and the trainer, imported before the start
    from geofed_hpc.client.job import ClientJob

    cfg = json.loads(Path(cfg_file).read_text())
    Path(f"{go}.ready-{index}").touch()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not Path(go).exists():
        if time.monotonic() > deadline:
            print(f"no start signal ({go}) within {READY_TIMEOUT_S:g}s", file=sys.stderr)
            return 2
        time.sleep(0.02)
    result = ClientJob(cfg, int(index), address)()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# ------------------------------------------------------------------ configs
def model_config(name: str) -> Any:
    from geofed_hpc.config import ModelConfig, from_dict

    path = ROOT / "conf" / "model" / f"{name}.yaml"
    if not path.is_file():
        choices = ", ".join(sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml")))
        raise SystemExit(f"--model: no conf/model/{name}.yaml; choose one of {choices}")
    return from_dict(ModelConfig, yaml.safe_load(path.read_text()))


def method_config(method: str, args: argparse.Namespace, steps: int, run_dir: Path, shards: Path) -> Any:
    """The RunConfig the PS of `method` runs with (sites take it too, plus their own train.slowdown)."""
    from geofed_hpc.config import CodecConfig, DataConfig, PSConfig, RunConfig, SiteConfig, TrainConfig

    interval, cut = args.sync_interval, 0
    ps: dict[str, Any] = {"aggregation": "sync", "outer_optimizer": "plain", "global_lr": 1.0}
    codec = args.baseline_codec
    if method == "ours":
        ps.update(aggregation="async", global_lr=args.ours_global_lr, weighting=args.ours_weighting)
        codec = args.codec
    elif method in ("fedavg", "diloco"):
        interval, cut = "0s", steps
        if method == "fedavg":
            ps["global_lr"] = args.fedavg_global_lr
        else:
            ps.update(outer_optimizer="nesterov", global_lr=0.7, momentum=0.9)
    elif method == "fednova":
        ps["outer_optimizer"] = "fednova"
    elif method == "centralized":
        codec = "fp32"
    return RunConfig(
        federation=f"convergence-{method}",
        run_dir=str(run_dir),
        wandb_mode="disabled",
        verbosity=0,
        site=SiteConfig(name="site", num_sites=1 if method == "centralized" else len(args.speeds)),
        model=model_config(args.model),
        ps=PSConfig(host="127.0.0.1", port=0, insecure=True, **ps),
        codec=CodecConfig(name=codec),
        data=DataConfig(source=str(shards), val_batches=args.val_batches, val_batch_size=args.batch),
        train=TrainConfig(
            lr=args.lr,
            warmup_steps=args.warmup_steps,
            batch_size=args.central_batch if method == "centralized" else args.batch,
            sync_interval=interval,
            eval_interval=args.eval_interval,
            max_local_steps=cut,
            max_syncs=args.max_syncs,
            seed=args.seed,
            threads=1,
        ),
    )


def prepare_data(args: argparse.Namespace, work: Path) -> Path:
    """Disjoint train shards, site i holding shards i, i+n, i+2n, ... (interleaved over the whole text unless
    --shards-per-site 1), and the one validation tail every method evaluates on."""
    from geofed_hpc.config import DataConfig
    from geofed_hpc.data.prepare import prepare_shards

    out = work / "data"
    count = len(args.speeds) * args.shards_per_site
    prepare_shards(DataConfig(tokenizer="gpt2", source="bible", cache_dir=args.cache_dir), out, count)
    return dev_split(out, args) if args.eval_on == "dev" else out


def dev_split(data: Path, args: argparse.Namespace) -> Path:
    """A copy of the data whose evaluation set is the validation tail past the tokens the validation batches
    read: a development set to choose settings on, disjoint from the tokens results are read on."""
    from geofed_hpc.data.prepare import write_part
    from geofed_hpc.data.shards import open_site_shards, read_index, write_index

    index = read_index(data)
    assert index.val is not None
    _, val = open_site_shards(data, 0, 1, index.tokenizer, index.vocab_size)  # checks every checksum
    used = args.val_batches * args.batch * (model_config(args.model).context + 1)
    if val.size - used < used:
        raise SystemExit(
            f"--eval-on dev: the validation tail holds {val.size} tokens; {used} are the validation set, and the "
            f"{max(0, val.size - used)} after them are too few for a development set as large; lower --val-batches "
            "or --batch"
        )
    out = data.parent / "data-dev"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(data, out)
    index.val = write_part(val, used, val.size, out / index.val.file)
    write_index(out, index)
    print(f"  evaluating on the development set: validation tokens {used}..{val.size} ({val.size - used})", flush=True)
    return out


# ------------------------------------------------------------------ one method
def run_method(method: str, args: argparse.Namespace, steps: int, work: Path, shards: Path) -> dict[str, Any]:
    """Start the PS and the sites, release them together, stop them after the budget; read their metrics."""
    from geofed_hpc.config import to_dict
    from geofed_hpc.ps.app import ParameterServer

    run_dir = work / method
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cfg = method_config(method, args, steps, run_dir, shards)
    central = method == "centralized"
    slowdowns = [1.0] if central else [max(args.speeds) / s for s in args.speeds]
    budget = args.minutes * 60 * (sum(args.speeds) / max(args.speeds) if central else 1.0)
    load_before = os.getloadavg()
    server = ParameterServer(cfg)
    go = run_dir / "go"
    procs: list[subprocess.Popen] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", WANDB_SILENT="true", PYTHONPATH=str(ROOT))
    try:
        for i, slowdown in enumerate(slowdowns):
            site = replace(cfg, train=replace(cfg.train, slowdown=slowdown))
            cfg_file = run_dir / f"site-{i}.json"
            cfg_file.write_text(json.dumps(to_dict(site)))
            with open(run_dir / f"site-{i}.log", "ab") as log:
                cmd = [sys.executable, str(Path(__file__).resolve()), WORKER, str(cfg_file), str(i), server.address]
                cmd.append(str(go))
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        _wait_ready(procs, go, run_dir)
        go.touch()
        t_go = time.time()
        print(f"  {method}: {len(procs)} site(s), slow-downs {slowdowns}, budget {budget:.0f}s", flush=True)
        while time.time() < t_go + budget:
            if all(p.poll() is not None for p in procs):
                break
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # the site finishes its step or push, checkpoints and leaves
        _reap(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        server.stop(grace=timedelta(seconds=5))
    failed = [i for i, p in enumerate(procs) if p.returncode not in (0, 128 + signal.SIGTERM, -signal.SIGTERM)]
    if failed:
        log = (run_dir / f"site-{failed[0]}.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"{method}: site {failed[0]} failed (exit {procs[failed[0]].returncode}):\n{log}")
    result = summarize(method, run_dir / "metrics", t_go, budget)
    result.update(slowdowns=slowdowns, budget_s=round(budget, 1), batch=cfg.train.batch_size)
    result.update(load_before=load_before, load_after=os.getloadavg())
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def _wait_ready(procs: list[subprocess.Popen], go: Path, run_dir: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not all(Path(f"{go}.ready-{i}").exists() for i in range(len(procs))):
        dead = [i for i, p in enumerate(procs) if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            which = dead[0] if dead else 0
            log = (run_dir / f"site-{which}.log").read_text(errors="replace")[-3000:]
            raise SystemExit(f"site {which} did not get ready:\n{log}")
        time.sleep(0.1)


def _reap(procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=30)


def summarize(method: str, metrics_dir: Path, t_go: float, budget: float) -> dict[str, Any]:
    """The method's curve (each newer global version's loss when first evaluated, within the budget) and totals."""
    from geofed_hpc.metrics import read_jsonl

    evals: list[tuple[float, int, float, str]] = []
    tokens: dict[str, list[tuple[float, int]]] = {}
    sent: dict[str, int] = {}
    steps: dict[str, list[int]] = {}
    stale: dict[str, list[int]] = {}
    for path in sorted(metrics_dir.glob("*.metrics.jsonl")):
        site = path.name.split(".")[0]
        tokens[site], sent[site], steps[site], stale[site] = [(0.0, 0)], 0, [], []
        for r in read_jsonl(path):
            t = float(r["time"]) - t_go
            if t > budget:
                continue
            if "val/loss" in r and "sync/version" in r:
                evals.append((t, int(r["sync/version"]), float(r["val/loss"]), site))
            if "train/tokens" in r:
                tokens[site].append((t, int(r["train/tokens"])))
            if "sync/local_steps" in r and "train/loss" in r:
                steps[site].append(int(r["sync/local_steps"]))
                if "sync/staleness" in r:  # versions the global model moved between this site's pull and push
                    stale[site].append(int(r["sync/staleness"]))
            sent[site] += int(r.get("sync/bytes_sent", 0) or 0)
    curve: list[dict[str, float]] = []
    newest = -1
    for t, version, loss, _ in sorted(evals):
        if version > newest:
            newest = version
            total = sum(max((n for tt, n in seq if tt <= t), default=0) for seq in tokens.values())
            curve.append({"t": round(t, 2), "version": version, "loss": loss, "tokens": total})
    if not curve:
        raise SystemExit(f"{method}: no validation loss was recorded; see the site logs (--keep)")
    return {
        "method": method,
        "final_val_loss": curve[-1]["loss"],
        "tokens": sum(seq[-1][1] for seq in tokens.values()),
        "bytes_sent": None if method == "centralized" else sum(sent.values()),
        "versions": newest,
        "steps_per_sync": {s: (statistics.median(v) if v else 0) for s, v in sorted(steps.items())},
        "staleness_per_sync": {s: (statistics.median(v) if v else 0) for s, v in sorted(stale.items())},
        "curve": curve,
    }


# ------------------------------------------------------------------ measures
def interpolate(curve: list[dict[str, float]], key: str, at: float) -> float | None:
    """The loss at `at` (seconds or tokens) by linear interpolation between curve points; None past the end."""
    pts = [(c[key], c["loss"]) for c in curve]
    if not pts or at > pts[-1][0]:
        return None
    if at <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= at <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (at - x0) / (x1 - x0)
    return pts[-1][1]


def time_to(curve: list[dict[str, float]], target: float | None) -> float | None:
    if target is None:
        return None
    return next((c["t"] for c in curve if c["loss"] <= target), None)


def local_steps(args: argparse.Namespace, ours: dict[str, Any] | None) -> int:
    """H for the fixed-step methods: the slowest site's median steps per sync in ours' run, or a timing here."""
    if args.local_steps:
        return args.local_steps
    if ours is not None:
        slowest = min(range(len(args.speeds)), key=lambda i: args.speeds[i])
        return max(1, round(ours["steps_per_sync"].get(f"site-{slowest}", 1)))
    return max(1, round(args.interval_s / (step_seconds(args) * max(args.speeds) / min(args.speeds))))


def step_seconds(args: argparse.Namespace) -> float:
    """Median seconds of one full-speed training step of the model here (one thread)."""
    import torch

    from geofed_hpc.models import build_model

    torch.set_num_threads(1)
    cfg = model_config(args.model)
    model = build_model(cfg, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.context))
    times = []
    for i in range(8):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x, x)[1].backward()
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "platform": platform.platform(),
        "torch": metadata.version("torch"),
        "uptime": uptime,
    }


# ------------------------------------------------------------------ output
def print_table(rows: list[dict[str, Any]], target: float | None, checks: dict[str, Any]) -> None:
    print(f"\ntarget validation loss: {target:.4f}" if target is not None else "\nno target loss")
    head = f"{'method':<13}{'final val loss':>15}{'time to target':>16}{'tokens':>11}{'sent':>12}{'versions':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        ttt = f"{r['time_to_target_s']:.1f} s" if r["time_to_target_s"] is not None else "never"
        sent = f"{r['bytes_sent'] / 2**20:.1f} MiB" if r["bytes_sent"] is not None else "-"
        line = f"{r['method']:<13}{r['final_val_loss']:>15.4f}{ttt:>16}{r['tokens'] / 1e6:>10.2f}M{sent:>12}"
        print(line + f"{r['versions']:>10}")
    for name, check in checks.items():
        print(f"{name}: {check}")


def plot(rows: list[dict[str, Any]], target: float | None, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for r in rows:
        c = r["curve"]
        # the loss of the newest global model evaluated so far: it holds until the next evaluation
        label = f"{r['method']} (batch {r['batch']})" if r["method"] == "centralized" and "batch" in r else r["method"]
        style = {"marker": "o", "markersize": 2.5, "linewidth": 1.4, "label": label, "drawstyle": "steps-post"}
        left.plot([p["t"] for p in c], [p["loss"] for p in c], **style)
        right.plot([p["tokens"] / 1e6 for p in c], [p["loss"] for p in c], **style)
    for ax in (left, right):
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8, label="target")
        ax.grid(alpha=0.3)
    after = [p["loss"] for r in rows for p in r["curve"][1:]]
    if after:  # the drop from the initial loss dwarfs everything after it: start the axis at the first updates
        top = max(r["curve"][1]["loss"] for r in rows if len(r["curve"]) > 1)
        left.set_ylim(min(after + ([target] if target else [])) - 0.1, top + 0.2)
    left.set_xlabel("wall-clock seconds")
    right.set_xlabel("tokens trained, all sites (millions)")
    left.set_ylabel("validation loss of the global model")
    left.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def checks_for(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets: ours >= 1.5x sooner than FedAvg; within 3% of centralized at equal tokens."""
    out: dict[str, Any] = {}
    ours, fedavg, central = rows.get("ours"), rows.get("fedavg"), rows.get("centralized")
    if ours and fedavg:
        a, b = ours["time_to_target_s"], fedavg["time_to_target_s"]
        budget = fedavg["budget_s"]
        if a is None:
            out["speedup_vs_fedavg"] = {"value": None, "met": False, "why": "ours never reached the target"}
        elif b is None:
            out["speedup_vs_fedavg"] = {"value": None, "at_least": round(budget / a, 2), "met": budget / a >= 1.5}
        else:
            out["speedup_vs_fedavg"] = {"value": round(b / a, 2), "met": b / a >= 1.5}
    if ours:  # a second view: how soon ours reaches the loss each baseline ended its budget with
        sooner = {}
        for name in ("fedavg", "diloco", "fednova"):
            if name in rows:
                loss = rows[name]["final_val_loss"]
                theirs, mine = time_to(rows[name]["curve"], loss), time_to(ours["curve"], loss)
                ratio = round(theirs / mine, 2) if theirs and mine else None
                sooner[name] = {"loss": round(loss, 4), "baseline_s": theirs, "ours_s": mine, "speedup": ratio}
        if sooner:
            out["speedup_to_each_baseline_final_loss"] = sooner
    if ours and central:
        at = min(ours["tokens"], central["curve"][-1]["tokens"])  # past its end: centralized's final loss
        ref = interpolate(central["curve"], "tokens", at)
        assert ref is not None
        gap = ours["final_val_loss"] / ref - 1
        out["gap_vs_centralized_at_equal_tokens"] = {
            "value": round(gap, 4),
            "centralized_loss": round(ref, 4),
            "centralized_batch": central.get("batch"),
            "at_tokens": at,
            "met": gap <= 0.03,
        }
    return out


# ------------------------------------------------------------------ main
def parse(argv: list[str] | None) -> argparse.Namespace:
    from geofed_hpc.config import WIRE_CODECS, parse_duration
    from geofed_hpc.errors import ConfigError

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=None, help="where the rows go (default docs/convergence.json)")
    p.add_argument("--png", type=Path, default=None, help="validation loss against seconds and tokens")
    p.add_argument("--minutes", type=float, default=2.5, help="wall-clock budget of each federated method")
    p.add_argument("--speeds", default="1,2,4", help="relative compute speed of each site (one site per entry)")
    p.add_argument("--codec", default="int8", choices=[*WIRE_CODECS, "adaptive"], help="ours' delta codec")
    p.add_argument("--baseline-codec", default="fp32", choices=WIRE_CODECS, help="FedAvg/DiLoCo/FedNova deltas")
    p.add_argument("--sync-interval", default="10s", help="wall-clock cadence of ours and FedNova (e.g. 10s)")
    p.add_argument(
        "--eval-interval",
        default="10s",
        help="every method's sites evaluate the global model they pull at most this often (train.eval_interval)",
    )
    p.add_argument("--local-steps", type=int, default=0, help="H of FedAvg/DiLoCo (0: measured, see above)")
    p.add_argument(
        "--max-syncs", type=int, default=0, help="each site stops after this many syncs (0: at the budget's end)"
    )
    p.add_argument("--methods", default=",".join(METHODS), help=f"a subset of {','.join(METHODS)}")
    p.add_argument("--target", type=float, default=None, help="target loss (default: centralized at half budget)")
    p.add_argument("--model", default="tiny_llama", help="a conf/model/*.yaml option")
    p.add_argument("--batch", type=int, default=8, help="sequences per step of each site (and per validation batch)")
    p.add_argument(
        "--central-batch",
        type=int,
        default=0,
        help="sequences per step of the centralized run (default: --batch x sites, the global batch of the "
        "data-parallel job the sites' processors would run in one place; --batch: one process at the sites' batch)",
    )
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate (the project's default)")
    p.add_argument("--warmup-steps", type=int, default=0, help="every site's linear lr warmup (train.warmup_steps)")
    p.add_argument("--val-batches", type=int, default=8, help="held-out batches each evaluation reads")
    p.add_argument("--shards-per-site", type=int, default=8, help="1: each site one contiguous part of the text")
    p.add_argument(
        "--ours-global-lr",
        type=float,
        default=None,
        help="ours' eta: each delta x eta/sqrt(1+tau) (default 1/sqrt(sites), chosen on the development set)",
    )
    p.add_argument(
        "--ours-weighting",
        choices=("uniform", "tokens"),
        default="tokens",
        help="ours' ps.weighting (tokens, chosen on the development set: each delta x its tokens over recent "
        "deltas' mean; uniform: each counts the same)",
    )
    p.add_argument("--fedavg-global-lr", type=float, default=1.0, help="FedAvg's eta (Theta += eta x mean delta)")
    p.add_argument(
        "--eval-on",
        choices=("val", "dev"),
        default="val",
        help="val: the validation set results are read on; dev: held-out tokens after it, to choose settings on",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default="", help="token cache (default $GEOFED_CACHE or ~/.cache/geofed_hpc)")
    p.add_argument("--work-dir", type=Path, default=None, help="run folders (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep each method's run folder (logs, checkpoints)")
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="run nothing: join the rows of earlier runs' JSON files (one method each at most, the same target), "
        "for example ours and a FedAvg given a longer budget to reach the target in, and recompute the checks",
    )
    args = p.parse_args(argv)
    if args.merge and args.json is None:
        p.error("--merge: give --json OUT (the merged report would otherwise replace docs/convergence.json)")
    args.json = args.json or Path("docs/convergence.json")
    if args.batch < 1 or args.central_batch < 0:
        p.error("--batch must be positive, --central-batch positive or 0 (the default: --batch x sites)")
    try:
        args.speeds = [float(s) for s in args.speeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--speeds: expected numbers like 1,2,4, got {args.speeds!r}")
    if not args.speeds or min(args.speeds) <= 0 or len(args.speeds) > 16:
        p.error("--speeds: give 1 to 16 positive speeds, one per site")
    if max(args.speeds) / min(args.speeds) > 1000:
        p.error("--speeds: the slowest site may be at most 1000x slower than the fastest")
    args.central_batch = args.central_batch or args.batch * len(args.speeds)
    if args.ours_global_lr is None:  # each delta arrives K-1 versions stale (x 1/sqrt(K)): then x 1/K, a mean
        args.ours_global_lr = 1 / len(args.speeds) ** 0.5
    if args.ours_global_lr <= 0 or args.fedavg_global_lr <= 0:
        p.error("--ours-global-lr and --fedavg-global-lr must be positive")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown or not args.methods:
        p.error(f"--methods: unknown {unknown}; choose from {','.join(METHODS)}")
    args.methods = [m for m in METHODS if m in args.methods]  # centralized first: the target is fixed before
    try:
        args.interval_s = parse_duration(args.sync_interval, "--sync-interval").total_seconds()
        parse_duration(args.eval_interval, "--eval-interval")
    except ConfigError as exc:
        p.error(str(exc))
    if args.interval_s <= 0 or args.minutes <= 0:
        p.error("--sync-interval and --minutes must be positive")
    if args.max_syncs < 0:
        p.error("--max-syncs must be 0 or more")
    return args


def merge(paths: list[Path]) -> dict[str, Any]:
    """One report from the rows of several: every file must have the same target; a method may come once."""
    reports = []
    for path in paths:
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--merge: cannot read {path}: {exc}") from exc
        if not isinstance(reports[-1], dict) or not {"rows", "target_val_loss"} <= reports[-1].keys():
            raise SystemExit(f"--merge: {path} is not a report of this benchmark (no rows / target_val_loss)")
    target = reports[0]["target_val_loss"]
    rows: dict[str, dict[str, Any]] = {}
    for path, report in zip(paths, reports, strict=True):
        if report["target_val_loss"] != target:
            raise SystemExit(
                f"--merge: {path} has target {report['target_val_loss']}, {paths[0]} has {target}; "
                "rerun with the same --target"
            )
        for row in report["rows"]:
            if row["method"] in rows:
                raise SystemExit(f"--merge: method {row['method']} is in more than one file ({path} again)")
            rows[row["method"]] = row | {"source": str(path)}
    rows = {m: rows[m] for m in METHODS if m in rows}
    for r in rows.values():
        r["time_to_target_s"] = time_to(r["curve"], target)
    sources = [
        {"file": str(p), "config": r.get("config"), "machine": r.get("machine")}
        for p, r in zip(paths, reports, strict=True)
    ]
    return {
        "merged_from": sources,
        "target_val_loss": target,
        "rows": list(rows.values()),
        "targets": checks_for(rows),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.merge:
        report = merge(args.merge)
        budgets = ", ".join(f"{r['method']} {r['budget_s'] / 60:g} min" for r in report["rows"])
        write_report(report, args, f"merged runs: {budgets}")
        return 0
    started = time.time()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="geofed-convergence-"))
    work.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(f"convergence: {', '.join(args.methods)} on {info['cpus']} CPUs ({info['uptime']})", flush=True)
    try:
        shards = prepare_data(args, work)
        rows: dict[str, dict[str, Any]] = {}
        target = args.target
        steps = args.local_steps
        for method in args.methods:
            if method in ("fedavg", "diloco") and not steps:
                steps = local_steps(args, rows.get("ours"))
                print(f"  H = {steps} local steps per round for fedavg and diloco", flush=True)
            rows[method] = run_method(method, args, steps, work, shards)
            if method == "centralized" and target is None:
                target = interpolate(rows[method]["curve"], "t", rows[method]["budget_s"] / 2)
                said = f"{target:.4f}" if target is not None else "none (no evaluation after half its budget)"
                print(f"  target validation loss (centralized at half its budget): {said}", flush=True)
    finally:
        if args.work_dir is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for r in rows.values():
        r["time_to_target_s"] = time_to(r["curve"], target)
    checks = checks_for(rows)
    info["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    wall = time.time() - started
    checks["total_wall_s"] = {"value": round(wall, 1), "met": wall < 20 * 60}
    keys = ("method", "final_val_loss", "time_to_target_s", "tokens", "bytes_sent")
    table = [{k: r[k] for k in keys} | {k: v for k, v in r.items() if k not in keys} for r in rows.values()]
    skip = ("json", "png", "merge")
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in skip}
    config["local_steps"] = steps
    report = {"config": config, "machine": info, "target_val_loss": target, "rows": table, "targets": checks}
    speeds = ":".join(f"{s:g}" for s in args.speeds)
    write_report(report, args, f"sites at speeds {speeds}, {args.minutes:g} min per federated method")
    return 0


def write_report(report: dict[str, Any], args: argparse.Namespace, title: str) -> None:
    """Print the table, write the JSON to --json and, with --png, the plot."""
    print_table(report["rows"], report["target_val_loss"], report["targets"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    if args.png:
        plot(report["rows"], report["target_val_loss"], args.png, title)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == WORKER:
        sys.exit(site_worker(*sys.argv[2:]))
    sys.exit(main())
