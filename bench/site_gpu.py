"""GPU site check: nccl process group, automatic precision, the micro-batch probe and tokens/s of one site.

    python bench/site_gpu.py --json site_gpu.json                     # every visible GPU, model gpt2_medium
    python bench/site_gpu.py --model tiny --steps 3 --json x.json     # a quick run (CPU: gloo, fp32)

One process per GPU (torch.multiprocessing), FSDP2 over all of them when there are several. The micro-batch
is probed upward (catching CUDA out-of-memory, cache ignored: --fresh-probe) for a site batch of --batch
sequences; then --steps timed local steps. Baseline in the same run: the same steps at micro-batch 1.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from geofed_hpc.cli import compose_config
    from geofed_hpc.client.runtime import build_runtime
    from geofed_hpc.client.steps import Stepper, StepPlan
    from geofed_hpc.config import DataConfig, TrainConfig
    from geofed_hpc.data.corpus import default_cache_dir

    if args.fresh_probe and rank == 0:
        (default_cache_dir() / "microbatch.json").unlink(missing_ok=True)
    cfg, _ = compose_config([f"model={args.model}"])
    cfg = replace(
        cfg,
        data=DataConfig(source="bible", max_tokens=args.tokens, cache_dir=str(Path(out).parent / "cache")),
        train=TrainConfig(
            batch_size=args.batch, lr=1e-4, max_local_steps=1, threads=max(1, (os.cpu_count() or 2) // 4)
        ),
    )
    torch.set_num_threads(cfg.train.threads)
    t0 = time.perf_counter()
    rt = build_runtime(cfg, 0)
    setup_s = time.perf_counter() - t0
    result: dict[str, Any] = {
        "world": world,
        "device": torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "cpu",
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else "none",
        "precision": rt.precision.name,
        "micro_batch": rt.micro_batch,
        "batch": args.batch,
        "context": cfg.model.context,
        "params": sum(p.numel() for p in rt.model.parameters()),
        "setup_s": round(setup_s, 2),
    }

    def timed(stepper: Stepper) -> float:
        rt.group.stepper = stepper
        rt.group.step()  # warm-up
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            rt.group.step()
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        return args.steps * args.batch * cfg.model.context / (time.perf_counter() - start)

    result["tokens_per_s"] = round(timed(rt.group.stepper), 1)
    base = rt.group.stepper
    plan = StepPlan(args.batch, world, rank, 1)
    one = Stepper(base.model, base.optimizer, base.precision, plan, base.device, base.sharded, base.warmup_steps)
    result["tokens_per_s_micro1"] = round(timed(one), 1)
    if rt.device.type == "cuda":
        result["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(rt.device) / 2**30, 2)
    if rank == 0:
        Path(out).write_text(json.dumps(result, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("site_gpu.json"))
    p.add_argument("--model", default="gpt2_medium")
    p.add_argument("--batch", type=int, default=64, help="site batch in sequences (per local step)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tokens", type=int, default=400_000, help="Bible tokens to tokenize for the sampler")
    p.add_argument("--fresh-probe", action="store_true", help="drop the cached micro-batch first")
    args = p.parse_args()
    world = max(1, torch.cuda.device_count())
    from geofed_hpc.client.distributed import port_for

    port = port_for(str(os.getpid()))
    out = str(args.json.resolve())
    if world == 1:
        _worker(0, 1, port, args, out)
    else:
        mp.spawn(_worker, args=(world, port, args, out), nprocs=world, join=True)
    result = json.loads(args.json.read_text())
    for key, value in result.items():
        print(f"{key:<22}{value}")
    print(f"micro-batch {result['micro_batch']} vs 1: {result['tokens_per_s'] / result['tokens_per_s_micro1']:.2f}x")


if __name__ == "__main__":
    main()
