"""Paradigm benchmark: bytes exchanged per round and eval loss after a fixed number of rounds, per paradigm.

    python bench/paradigms.py --json paradigms.json         # 2 sites, 5 rounds of 4 steps, a 3.3M GPT-2 shape
    python bench/paradigms.py --only fsl_sage split --fsl server_update_interval=1   # fsl_sage's settings
    python bench/paradigms.py --only lora --set lora:rank=2 'lora:targets=[attn.qkv]'  # any paradigm's settings
    python bench/paradigms.py --only fsl_sage split --config codec=int4   # any setting, for every row

For each paradigm a local PS runs in this process and two sites run as their own processes (this script with --site,
exactly as a Slurm task runs ClientJob) on the same token shards, seeds and cadence. The fine-tuning paradigms
(identity as full fine-tuning, lora, hybrid_lora, ravan, zo) start from a pretrained model: identity trained
--pretrain-rounds rounds on the shipped Bible's Old Testament, exported with `geofed-hpc export hf` and loaded as
model.init_from (or --init-from a folder), and fine-tune on its New Testament; improvement_vs_full is a row's drop
in validation loss over full fine-tuning's. lora adapts the attention layers and the output layer at rank 1
(SETTINGS): the output layer of this model is tied to the token embedding, which holds 97% of its parameters, so its
adapter also acts on the embedding, and it is what lets a low-rank update follow the second domain's word
frequencies (attention alone reaches 0.14 of full fine-tuning's drop). fsl_sage and split train from a random init
on the shipped text, each with the server part's learning rate that served it best (SETTINGS). Bytes per round:
what the sites pushed plus what they pulled (split learning: with the activations up and the gradients or fitted
auxiliary models down; its evaluations apart, in eval_bytes_per_round), summed over both sites, averaged over the
rounds after the first full download (the bootstrap: a fresh site always takes the whole model once). bytes_vs_full
compares with the identity row of the same run. Eval loss: site 0's validation loss of the model it holds after the
last round (split learning: the composed model, the client part of the global phi and the server part).
bytes_to_target (random starts only): all bytes both ways, bootstrap included, until that loss first reaches
--target (fixed before any paradigm runs); bytes_by_round gives them after every round, for any other target.
Expectations: lora under 2% of the full bytes and at least 0.6 of full fine-tuning's drop, zo under 1 KB per step,
fsl_sage at most half the bytes of split to the target.
--json writes {"rows": [one per paradigm: "paradigm", "bytes_per_round", "bytes_up_per_round",
"bytes_down_per_round", "bytes_vs_full", "bytes_per_step", "eval_loss", "val_losses", "bytes_by_round",
"bytes_to_target", "improvement_vs_full", "start", ...], "targets": {...}, "rounds", "steps", "sites"}.
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
PARADIGMS = ("identity", "lora", "hybrid_lora", "ravan", "zo", "fsl_sage", "split")
FINE_TUNING = ("identity", "lora", "hybrid_lora", "ravan", "zo")  # from the pretrained model, on the second domain
SPLIT = ("fsl_sage", "split")  # evaluated as the composed model: the client part of the global phi + the server part
LR = {"identity": 3e-3, "lora": 2e-2, "hybrid_lora": 3e-3, "ravan": 2e-2, "zo": 3e-3, "fsl_sage": 3e-3, "split": 3e-3}
SETTINGS = {  # --fsl's and --set's replace a key given here
    "lora": ["targets=[attn.qkv,attn.proj,lm_head]", "rank=1", "alpha=2"],
    # the server part's learning rate, each the best of 0.003, 0.01 and 0.03 for its bytes to the target
    "fsl_sage": ["server_lr=0.03"],
    "split": ["server_lr=0.01"],
}
OLD_BOOKS = 39  # the shipped Bible's books before the New Testament
TARGET = 9.0  # the validation loss bytes_to_target counts to, fixed before any paradigm runs (--target)


def site_main(cfg_file: str, index: str, address: str) -> None:
    from geofed_hpc.client.job import ClientJob

    ClientJob(json.loads(Path(cfg_file).read_text()), int(index), address)()


def run_paradigm(
    name: str, work: Path, shards: Path, args: argparse.Namespace, start: Path | None = None, rounds: int = 0
) -> dict[str, Any]:
    """One row: `name` on `shards` from `start` (a Hugging Face folder, as model.init_from) or a random init."""
    from geofed_hpc.cli import compose_config
    from geofed_hpc.config import to_dict
    from geofed_hpc.ps.app import ParameterServer

    folder = work / (name if rounds == 0 else "pretrain")
    rounds = rounds or args.rounds
    overrides = [
        f"paradigm={name}",
        "model=tiny",
        f"model.context={args.context}",
        "site.num_sites=2",
        f"run_dir={folder}",
        "wandb_mode=disabled",
        f"data.source={shards}",
        "data.val_batches=4",
        f"train.max_syncs={rounds}",
        f"train.max_local_steps={args.steps}",
        "train.sync_interval=10m",
        f"train.lr={args.lr.get(name, LR[name])}",
        "ps.port=0",
        "ps.round_timeout=10m",
        f"ps.state_dir={folder / 'ps'}",
        *(f"paradigm.{kv}" for kv in args.paradigm_set.get(name, [])),
        *([f"model.init_from={start}"] if start else []),
        *args.config,
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
    rows = [site_rows(folder, i) for i in range(2)]
    later = [r[2:] for r in rows]  # row 0: the first evaluation; row 1: the first sync, after the bootstrap download
    up = sum(sum(_up(r) for r in site) // len(site) for site in later)
    down = sum(sum(_down(r) for r in site) // len(site) for site in later)
    total = up + down
    losses = [float(r.get("val/loss", float("nan"))) for r in rows[0]]
    traffic = [sum(_up(r) + _down(r) for site in rows for r in site[1 : k + 1]) for k in range(len(rows[0]))]
    # from a random start only: a fine-tuning row starts below any target a random start is measured against
    reached = next((k for k, loss in enumerate(losses) if loss <= args.target), None) if start is None else None
    out: dict[str, Any] = {
        "paradigm": name,
        "describe": cfg.paradigm.describe(),
        "bytes_per_round": total,
        "bytes_up_per_round": up,
        "bytes_down_per_round": down,
        "bytes_per_step": total / args.steps,
        "eval_loss": round(losses[-1], 4),
        "val_losses": [round(v, 4) for v in losses],
        "bytes_by_round": traffic,  # all bytes both ways up to each val_losses entry: any target reads off these
        "target": args.target,
        "bytes_to_target": traffic[reached] if reached is not None else None,
        "rounds_to_target": reached,
        "start": str(start) if start else "random",
        "seconds": round(time.time() - t0, 1),
    }
    if name in SPLIT:  # the activations' share (the rest: the client part and auxiliary model through the PS)
        out["act_bytes_per_round"] = sum(
            sum(int(r.get("split/bytes_up", 0)) + int(r.get("split/bytes_down", 0)) for r in site) // len(site)
            for site in later
        )
        out["eval_bytes_per_round"] = sum(
            sum(int(r.get("split/eval_bytes", 0)) for r in site) // len(site) for site in later
        )
    return out


def domains(work: Path) -> tuple[Path, Path, Path]:
    """Token shards of the shipped text: all of it (split learning, from a random init), its Old Testament (the
    pretraining) and its New Testament (the second domain the fine-tuning paradigms train on)."""
    from geofed_hpc.config import DataConfig
    from geofed_hpc.data.prepare import prepare_shards
    from geofed_hpc.data.sources import bible_documents, bible_path

    books = bible_documents(bible_path(), bible_path().read_text(encoding="utf-8"))
    out = []
    for name, part in (("shipped", None), ("old", books[:OLD_BOOKS]), ("new", books[OLD_BOOKS:])):
        source = "bible"
        if part is not None:
            text = work / "text" / name
            text.mkdir(parents=True, exist_ok=True)
            for i, book in enumerate(part):
                (text / f"{i:02d}.txt").write_text(book, encoding="utf-8")
            source = str(text)
        data = DataConfig(tokenizer="gpt2", source=source, max_tokens=200_000, cache_dir=str(work / "cache"))
        prepare_shards(data, work / f"shards-{name}", 2)
        out.append(work / f"shards-{name}")
    return out[0], out[1], out[2]


def pretrain(work: Path, shards: Path, args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """A short identity pretraining, exported as a user would (`geofed-hpc export hf`): the fine-tuning start."""
    row = run_paradigm("identity", work, shards, args, rounds=args.pretrain_rounds)
    start = work / "pretrained"
    cli = Path(sys.executable).with_name("geofed-hpc")
    subprocess.run([str(cli), "export", "hf", str(work / "pretrain"), str(start), "--force"], check=True, cwd=ROOT)
    return start, row


def site_rows(folder: Path, index: int) -> list[dict[str, Any]]:
    """A site's rows in sync order: the first evaluation (index 0), then one per sync."""
    from geofed_hpc.metrics import read_jsonl

    rows = [r for r in read_jsonl(folder / "metrics" / f"local-{index}.metrics.jsonl") if "sync/index" in r]
    return sorted(rows, key=lambda r: int(r["sync/index"]))


def _up(row: dict[str, Any]) -> int:
    """Bytes a site sent in a sync: its push, and for split learning its activations and targets."""
    return int(row.get("sync/bytes_sent", 0)) + int(row.get("split/bytes_up", 0))


def _down(row: dict[str, Any]) -> int:
    """Bytes a site received in a sync: its pull, and for split learning the gradients or fitted auxiliary model."""
    return int(row.get("sync/bytes_received", 0)) + int(row.get("split/bytes_down", 0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("paradigms.json"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="local steps per round (train.max_local_steps)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument(
        "--target", type=float, default=TARGET, help="validation loss for bytes_to_target (default %(default)s)"
    )
    p.add_argument(
        "--pretrain-rounds", type=int, default=15, help="identity rounds before fine-tuning (0: a random start)"
    )
    p.add_argument("--init-from", type=Path, default=None, help="the fine-tuning start (default: pretrain one)")
    p.add_argument("--lr", nargs="*", default=[], metavar="PARADIGM=LR", help="learning rates other than LR's")
    p.add_argument("--fsl", nargs="*", default=[], metavar="KEY=VALUE", help="fsl_sage's paradigm settings")
    p.add_argument(
        "--set", nargs="*", default=[], metavar="PARADIGM:KEY=VALUE", help="any paradigm's settings (lora:rank=2)"
    )
    p.add_argument(
        "--config", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every row (codec=int4)"
    )
    p.add_argument("--only", nargs="*", default=list(PARADIGMS), choices=PARADIGMS)
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--site", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.lr = {k: float(v) for k, v in (kv.split("=", 1) for kv in args.lr)}
    chosen = {name: dict(kv.split("=", 1) for kv in items) for name, items in SETTINGS.items()}
    for item in [f"fsl_sage:{kv}" for kv in args.fsl] + args.set:
        name, _, kv = item.partition(":")
        if name not in PARADIGMS or "=" not in kv:
            p.error(f"--set {item}: expected PARADIGM:KEY=VALUE with PARADIGM one of {', '.join(PARADIGMS)}")
        key, value = kv.split("=", 1)
        chosen.setdefault(name, {})[key] = value
    args.paradigm_set = {name: [f"{k}={v}" for k, v in kv.items()] for name, kv in chosen.items()}
    if args.site:
        site_main(*args.site)
        return

    work = args.work or Path(tempfile.mkdtemp(prefix="paradigms-"))
    shipped, old, new = domains(work)
    start = args.init_from.resolve() if args.init_from else None
    if start is None and any(n in FINE_TUNING for n in args.only) and args.pretrain_rounds > 0:
        start, pre = pretrain(work, old, args)
        print(f"pretrained: identity, {args.pretrain_rounds} rounds on the Old Testament, val loss {pre['eval_loss']}")
    names = ["identity", *[n for n in args.only if n != "identity"]]  # the baseline always runs
    results = [
        run_paradigm(name, work, new, args, start)
        if name in FINE_TUNING and start
        else run_paradigm(name, work, shipped, args)
        for name in names
    ]
    full = results[0]["bytes_per_round"]
    for r in results:
        r["bytes_vs_full"] = round(r["bytes_per_round"] / full, 6)
    if start:  # each fine-tuning row's drop in validation loss over full fine-tuning's
        drop = results[0]["val_losses"][0] - results[0]["eval_loss"]
        for r in results:
            if r["paradigm"] in FINE_TUNING:
                r["improvement_vs_full"] = round((r["val_losses"][0] - r["eval_loss"]) / drop, 4)
    targets = {
        "lora_bytes_vs_full_max": 0.02,
        "lora_improvement_vs_full_min": 0.6,
        "zo_bytes_per_step_max": 1024,
        "fsl_sage_bytes_to_target_vs_split_max": 0.5,
    }
    report = {"rows": results, "targets": targets, "rounds": args.rounds, "steps": args.steps, "sites": 2}
    args.json.parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in the checkout
    args.json.write_text(json.dumps(report, indent=1))
    print(
        f"{'paradigm':<13}{'bytes/round':>14}{'up':>13}{'down':>13}{'vs full':>10}{'bytes/step':>12}{'eval loss':>11}"
        f"{'to target':>14}{'vs full drop':>14}"
    )
    for r in results:
        to_target = f"{r['bytes_to_target']:,}" if r["bytes_to_target"] is not None else "not reached"
        to_target = "" if r["start"] != "random" else to_target
        print(
            f"{r['paradigm']:<13}{r['bytes_per_round']:>14,}{r['bytes_up_per_round']:>13,}{r['bytes_down_per_round']:>13,}"
            f"{r['bytes_vs_full']:>10.4%}{r['bytes_per_step']:>12,.0f}{r['eval_loss']:>11.4f}{to_target:>14}"
            f"{r['improvement_vs_full'] if 'improvement_vs_full' in r else '':>14}"
        )
    lora = next((r for r in results if r["paradigm"] == "lora"), None)
    zo = next((r for r in results if r["paradigm"] == "zo"), None)
    if lora:
        print(f"lora: {lora['bytes_vs_full']:.3%} of the full bytes (target < 2%)")
        if "improvement_vs_full" in lora:
            print(f"lora: {lora['improvement_vs_full']:.3f} of full fine-tuning's loss drop (target >= 0.6)")
    if zo:
        print(f"zo: {zo['bytes_per_step']:.0f} bytes per step (target < 1024)")
    fsl, split = (next((r for r in results if r["paradigm"] == n), None) for n in SPLIT)
    if fsl and split and fsl["bytes_to_target"] and split["bytes_to_target"]:
        ratio = fsl["bytes_to_target"] / split["bytes_to_target"]
        print(f"fsl_sage: {ratio:.3f}x the bytes of split to val loss {args.target} (target <= 0.5x)")
    elif fsl and split:
        print(f"fsl_sage / split: val loss {args.target} not reached by both within the budget")
    where = "fine-tuning from the pretrained model on the New Testament; " if start else ""
    print(f"{args.rounds} rounds x {args.steps} steps, 2 sites; {where}wrote {args.json}")


if __name__ == "__main__":
    main()
