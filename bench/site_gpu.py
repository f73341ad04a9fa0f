"""GPU site check: device and precision choice, the micro-batch probe, tokens/s and model FLOPs utilisation (MFU).

    python bench/site_gpu.py --json site_gpu.json                    # llama3_1b on every visible GPU (< 8 min)
    python bench/site_gpu.py --set train.compile=true --json c.json  # any train.* / model.* override
    python bench/site_gpu.py --model tiny --steps 3 --batch 4 --json x.json   # a quick run (CPU: gloo, fp32)

One process per GPU (torch.multiprocessing), FSDP2 over all of them when there are several, the model built on
the meta device and initialised shard by shard, exactly as a site job does (client/runtime.py). The micro-batch
is probed upward (catching CUDA out-of-memory; the cache is ignored with --fresh-probe) for a site batch of
--batch sequences, then --steps timed local steps. Baseline in the same run: a few steps at micro-batch 1.
MFU = model FLOPs per second / the GPUs' peak dense bf16 (or fp16/fp32) FLOPs; model FLOPs per token are
6 N + 12 L d T (N the parameters that multiply, i.e. without an untied embedding lookup; L layers, width d,
context T: the PaLM count).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

# Peak dense tensor-core TFLOPS per GPU (bf16/fp16; fp32 without TF32), by a substring of the device name.
PEAK_TFLOPS = {
    "H200": 989.0,
    "GH200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A40": 150.0,
    "A10": 125.0,
    "L4": 121.0,
    "V100": 125.0,
    "T4": 65.0,
}


def peak_tflops(name: str, precision: str, given: float) -> float:
    """The device's peak for `precision`, or `given` (--peak-tflops); 0 when unknown (MFU not computed)."""
    if given:
        return given
    for key, value in PEAK_TFLOPS.items():  # the longer, more specific names come first
        if key in name:
            return value if precision != "fp32" else value / 16
    return 0.0


def flops_per_token(cfg: Any, n_params: int) -> float:
    """6 N + 12 L d T (PaLM, appendix B), N the parameters that multiply: all but the embedding lookup (a tied
    output layer shares it and does multiply, so then N is every parameter)."""
    lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    return 6 * (n_params - lookup) + 12 * cfg.n_layers * cfg.d_model * cfg.context


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from geofed_hpc.cli import compose_config
    from geofed_hpc.client.devices import device_name
    from geofed_hpc.client.runtime import build_runtime
    from geofed_hpc.client.steps import Stepper, StepPlan
    from geofed_hpc.data.corpus import default_cache_dir

    if args.fresh_probe and rank == 0:
        (default_cache_dir() / "microbatch.json").unlink(missing_ok=True)
    overrides = [
        f"model={args.model}",
        "data.source=bible",
        f"data.max_tokens={args.tokens}",
        f"data.cache_dir={Path(out).parent / 'cache'}",
        f"train.batch_size={args.batch}",
        "train.lr=1e-4",
        "train.max_local_steps=1",
        f"train.threads={max(1, (os.cpu_count() or 2) // (4 * world))}",
        *args.set,
    ]
    cfg, _ = compose_config(overrides)
    torch.set_num_threads(cfg.train.threads)
    t0 = time.perf_counter()
    rt = build_runtime(cfg, 0)
    setup_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in rt.model.parameters())
    name = device_name(rt.device)
    result: dict[str, Any] = {
        "model": args.model,
        "world": world,
        "device": name,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else "none",
        "precision": rt.precision.name,
        "micro_batch": rt.micro_batch,
        "batch": args.batch,
        "context": cfg.model.context,
        "params": n_params,
        "setup_s": round(setup_s, 2),
        "overrides": args.set,
    }

    def timed(stepper: Stepper, steps: int) -> float:
        rt.group.stepper = stepper
        rt.group.step()  # warm-up (and compilation, with train.compile=true)
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            rt.group.step()
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        return steps * args.batch * cfg.model.context / (time.perf_counter() - start)

    tokens_per_s = timed(rt.group.stepper, args.steps)
    result["tokens_per_s"] = round(tokens_per_s, 1)
    peak = peak_tflops(name, rt.precision.name, args.peak_tflops) * 1e12 * world
    achieved = tokens_per_s * flops_per_token(cfg.model, n_params)
    result["model_tflops"] = round(achieved / 1e12, 2)
    result["mfu"] = round(achieved / peak, 4) if peak else None
    base = rt.group.stepper
    plan = StepPlan(args.batch, world, rank, 1)
    one = Stepper(base.model, base.optimizer, base.precision, plan, base.device, base.sharded, rules=base.rules)
    result["tokens_per_s_micro1"] = round(timed(one, args.baseline_steps), 1)
    if rt.device.type == "cuda":
        result["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(rt.device) / 2**30, 2)
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": [result]}, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("site_gpu.json"))
    p.add_argument("--model", default="llama3_1b")
    p.add_argument("--batch", type=int, default=32, help="site batch in sequences (per local step)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--baseline-steps", type=int, default=2, help="timed steps at micro-batch 1")
    p.add_argument("--tokens", type=int, default=400_000, help="Bible tokens to tokenize for the sampler")
    p.add_argument("--fresh-probe", action="store_true", help="drop the cached micro-batch first")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="per-GPU peak, when the GPU is not in the table")
    p.add_argument("--set", action="append", default=[], help="a config override, e.g. train.compile=true")
    args = p.parse_args()
    world = max(1, torch.cuda.device_count())
    from geofed_hpc.client.distributed import port_for

    port = port_for(str(os.getpid()))
    out = str(args.json.resolve())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    if world == 1:
        _worker(0, 1, port, args, out)
    else:
        mp.spawn(_worker, args=(world, port, args, out), nprocs=world, join=True)
    result = json.loads(args.json.read_text())["rows"][0]
    for key, value in result.items():
        print(f"{key:<22}{value}")
    mfu = f"{100 * result['mfu']:.1f}%" if result["mfu"] is not None else "n/a (unknown peak: --peak-tflops)"
    print(f"{result['model']}: {result['tokens_per_s']:.0f} tokens/s, MFU {mfu}")
    print(f"micro-batch {result['micro_batch']} vs 1: {result['tokens_per_s'] / result['tokens_per_s_micro1']:.2f}x")


if __name__ == "__main__":
    main()
