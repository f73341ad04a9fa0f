"""Local steps of one site on this machine: tokens/s and peak RSS per process, per model and variant.

    python bench/site_step.py --json bench/results/site_step.json            # tiny_llama and gpt2_medium
    python bench/site_step.py --models tiny_llama --steps 3 --json x.json   # a quick run
    python bench/site_step.py --models hf_llama,hf_gpt2 --json x.json       # model=hf against tiny_llama, gpt2_medium

hf_llama is model=hf with the config.json of tiny_llama (LlamaForCausalLM of transformers, the same shape, written by
our exporter's config writer, no weights: transformers' init), hf_gpt2 the same for gpt2_medium (GPT2LMHeadModel);
each runs in the same invocation as its native model, the baseline.

Variants (each in fresh processes, so that ru_maxrss is the variant's own peak), all with the site's real parts
(model built on the meta device and initialised tensor by tensor, AdamW groups, Stepper with its rules):
  single   one process, the whole site batch in one micro-batch (the baseline of this run)
  ac_full  the same with train.activation_checkpointing=full
  fsdp2    two ranks (gloo), FSDP2 with meta-device init, half the batch each (the largest rank's RSS)
  compile  the same as single with train.compile=true (the first, compiling step is not timed)
All variants use the machine's two cores: two threads for one process, one each for two ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("single", "ac_full", "fsdp2", "compile")
# model=hf twins of our models: the same architecture and shape through transformers, from a folder made here.
HF_TWINS = {"hf_llama": "tiny_llama", "hf_gpt2": "gpt2_medium"}
HF_FOLDER = "GEOFED_BENCH_HF_FOLDER"  # where main() wrote the twin's config.json (one folder per twin)


def write_twin(native: str, folder: Path, context: int) -> None:
    """config.json of `native`'s shape as transformers' model (what `export hf` writes for it, positions for
    `context`), no weights."""
    from geofed_hpc.cli import compose_config
    from geofed_hpc.models.hfconfig import hf_config

    model = compose_config([f"model={native}", f"model.context={context}"])[0].model
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(model, "fp32", 50256, 50256), indent=1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(model: str, variant: str, context: int, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    """One rank of one variant: build, train `warmup` + `steps` local steps, report its throughput and peak RSS."""
    import torch

    from geofed_hpc.cli import compose_config
    from geofed_hpc.client.build import build_site_model, decay_groups
    from geofed_hpc.client.distributed import init_distributed, pick_device, site_ranks
    from geofed_hpc.client.precision import choose_precision
    from geofed_hpc.client.runtime import collective_timeout, step_rules
    from geofed_hpc.client.steps import Stepper, StepPlan
    from geofed_hpc.paradigms.site import site_paradigm

    ranks = site_ranks()
    threads = max(1, 2 // ranks.world_size)
    twin = [f"model.path={os.environ[HF_FOLDER]}/{model}"] if model in HF_TWINS else []
    overrides = [
        f"model={'hf' if twin else model}",
        *twin,
        f"model.context={context}",
        f"train.batch_size={batch}",
        f"train.micro_batch={batch // ranks.world_size}",
        f"train.threads={threads}",
        "train.lr=1e-4",
        "train.precision=fp32",
        f"train.activation_checkpointing={'full' if variant == 'ac_full' else 'none'}",
        f"train.compile={'true' if variant == 'compile' else 'false'}",
    ]
    cfg, _ = compose_config(overrides)
    torch.set_num_threads(threads)
    device = pick_device(ranks, "cpu")
    init_distributed(ranks, device, collective_timeout(cfg))
    precision = choose_precision("fp32", device)
    paradigm = site_paradigm(cfg.paradigm, 0)
    built = build_site_model(cfg, ranks, device, precision, paradigm, init=True)
    optimizer = torch.optim.AdamW(decay_groups(built.model, list(built.model.parameters()), 0.0), lr=1e-4)  # type: ignore[arg-type]
    plan = StepPlan(batch, ranks.world_size, ranks.rank, batch // ranks.world_size)
    stepper = Stepper(built.model, optimizer, precision, plan, device, built.sharded, rules=step_rules(cfg))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, cfg.model.vocab_size, (batch, context + 1), generator=g) for _ in range(warmup + steps)]
    for i in range(warmup):
        stepper.step(seqs[i][:, :-1], seqs[i][:, 1:], count=i + 1)
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        stepper.step(seqs[i][:, :-1], seqs[i][:, 1:], count=i + 1)
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"rank": ranks.rank, "tokens_per_s": steps * batch * context / seconds, "peak_rss_mb": peak_mb}


def run_variant(model: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    world = 2 if variant == "fsdp2" else 1
    port = str(_free_port())
    warmup = 2 if variant == "compile" else 1  # compile: the first step compiles, the second may recompile
    cmd = [sys.executable, __file__, "--worker", model, variant, str(args.context), str(args.batch)]
    cmd += [str(args.steps), str(warmup)]
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS=str(max(1, 2 // world)))
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"{model} {variant}: a rank failed (exit {p.returncode})")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return {
        "model": model,
        "variant": variant,
        "tokens_per_s": round(min(o["tokens_per_s"] for o in outs), 1),
        "peak_rss_mb": round(max(o["peak_rss_mb"] for o in outs), 1),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'model':<13}{'variant':<10}{'tokens/s':>10}{'vs single':>11}{'peak RSS MB':>13}{'vs single':>11}"]
    single = {r["model"]: r for r in rows if r["variant"] == "single"}
    for r in rows:
        base = single.get(r["model"])
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        rss = f"{r['peak_rss_mb'] / base['peak_rss_mb']:.2f}x" if base else "-"
        lines.append(f"{r['model']:<13}{r['variant']:<10}{r['tokens_per_s']:>10.1f}{speed:>11}")
        lines[-1] += f"{r['peak_rss_mb']:>13.0f}{rss:>11}"
    same = {(r["model"], r["variant"]): r for r in rows}
    twins = [
        (r, same[(HF_TWINS[r["model"]], r["variant"])])
        for r in rows
        if (HF_TWINS.get(r["model"]), r["variant"]) in same
    ]
    if twins:
        lines.append(f"\n{'model=hf':<13}{'variant':<10}{'tokens/s vs native':>20}{'peak RSS vs native':>20}")
        for hf, native in twins:
            speed, rss = hf["tokens_per_s"] / native["tokens_per_s"], hf["peak_rss_mb"] / native["peak_rss_mb"]
            lines.append(f"{hf['model']:<13}{hf['variant']:<10}{speed:>19.2f}x{rss:>19.2f}x")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        model, variant, context, batch, steps, warmup = sys.argv[2:8]
        print(json.dumps(worker(model, variant, int(context), int(batch), int(steps), int(warmup))), flush=True)
        os._exit(0)  # FSDP2 still holds the process group: leave without interpreter teardown
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--models", default="tiny_llama,gpt2_medium")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch", type=int, default=12, help="site batch in sequences (one micro-batch per rank)")
    p.add_argument("--steps", type=int, default=2, help="timed local steps after the warm-up")
    args = p.parse_args()
    models = args.models.split(",")
    for twin, native in HF_TWINS.items():  # model=hf is measured against its native model, in this run
        if twin in models and native not in models:
            models.insert(models.index(twin), native)
    folder = Path(tempfile.mkdtemp(prefix="site-step-hf-"))
    os.environ[HF_FOLDER] = str(folder)
    for twin in set(models) & set(HF_TWINS):
        write_twin(HF_TWINS[twin], folder / twin, args.context)
    rows = []
    started = time.time()
    for model in models:
        for variant in args.variants.split(","):
            t0 = time.time()
            rows.append(run_variant(model, variant, args))
            print(f"{model} {variant}: {rows[-1]} ({time.time() - t0:.0f}s)", flush=True)
    result = {
        "settings": {"context": args.context, "batch": args.batch, "steps": args.steps, "precision": "fp32"},
        "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "seconds": round(time.time() - started)},
        "rows": rows,
    }
    shutil.rmtree(folder, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(table(rows))
    print(f"load average {result['machine']['load_average']}, {result['machine']['seconds']} s")


if __name__ == "__main__":
    main()
