"""On a CUDA machine: nccl FSDP2 over two GPUs, bf16 autocast, the micro-batch probe and its mid-run retry."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

from geofed_hpc.config import ModelConfig
from tests.dist_util import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (this torch sees none)"),
]

LLAMA = ModelConfig(
    name="l", arch="llama", vocab_size=512, context=64, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256
)


def _batch(cfg: ModelConfig, b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, cfg.vocab_size, (b, cfg.context + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _stepper(cfg: ModelConfig, rank: int, world: int, device: torch.device, precision: str, micro: int) -> object:
    from geofed_hpc.client.fsdp import load_streamed, shard_model
    from geofed_hpc.client.precision import Precision
    from geofed_hpc.client.steps import Stepper, StepPlan, StepRules
    from geofed_hpc.models.init import initial_tensors
    from geofed_hpc.models.registry import build_meta, materialize

    model = build_meta(cfg)
    if world > 1:
        shard_model(model, Precision(precision, "cuda"))
    model = materialize(model, device)
    load_streamed(model, initial_tensors(model, 3, "cpu"), "init")  # the same values on every device
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = StepPlan(8, world, rank, micro)
    return Stepper(model, opt, Precision(precision, "cuda"), plan, device, world > 1, rules=StepRules(grad_clip=1.0))


def _nccl_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    try:
        from geofed_hpc.client.fsdp import full_state

        stepper = _stepper(LLAMA, rank, 2, device, "fp32", 2)
        losses = [stepper.step(*_batch(LLAMA, 8, s), count=s + 1) for s in range(3)]  # type: ignore[attr-defined]
        state = full_state(stepper.model)  # type: ignore[attr-defined]
        if rank == 0:
            np.savez(f"{out}/nccl.npz", losses=np.array(losses), **{k: v.numpy() for k, v in state.items()})
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs for a two-rank nccl group")
def test_two_rank_nccl_fsdp2_trains_like_one_gpu(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_nccl_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    one = _stepper(LLAMA, 0, 1, torch.device("cuda", 0), "fp32", 8)
    losses = [one.step(*_batch(LLAMA, 8, s), count=s + 1) for s in range(3)]  # type: ignore[attr-defined]
    got = np.load(tmp_path / "nccl.npz")
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-4)
    for name, param in one.model.named_parameters():  # type: ignore[attr-defined]
        np.testing.assert_allclose(got[name], param.detach().cpu().numpy(), rtol=1e-3, atol=1e-5, err_msg=name)


def test_bf16_autocast_is_chosen_and_trains_close_to_fp32() -> None:
    from geofed_hpc.client.precision import choose_precision

    device = torch.device("cuda", 0)
    if torch.cuda.get_device_capability(device) < (8, 0):
        pytest.skip("this GPU has no native bf16 (compute capability below 8.0)")
    assert choose_precision("auto", device).name == "bf16"
    bf16 = _stepper(LLAMA, 0, 1, device, "bf16", 4)
    fp32 = _stepper(LLAMA, 0, 1, device, "fp32", 4)
    x, y = _batch(LLAMA, 8, 0)
    with bf16.precision.autocast():  # type: ignore[attr-defined]
        logits, _ = bf16.model(x.to(device), y.to(device))  # type: ignore[attr-defined]
    assert logits.dtype == torch.bfloat16
    a = [bf16.step(*_batch(LLAMA, 8, s), count=s + 1) for s in range(3)]  # type: ignore[attr-defined]
    b = [fp32.step(*_batch(LLAMA, 8, s), count=s + 1) for s in range(3)]  # type: ignore[attr-defined]
    assert all(np.isfinite(a)) and np.allclose(a, b, rtol=3e-2)


def test_the_probe_finds_a_micro_batch_that_fits_and_a_mid_run_oom_probes_again_once() -> None:
    from geofed_hpc.client.microbatch import oom_guard, probe
    from geofed_hpc.client.precision import Precision

    device = torch.device("cuda", 0)
    big = ModelConfig(name="b", vocab_size=32000, context=1024, d_model=256, n_layers=2, n_heads=4, d_ff=1024)
    stepper = _stepper(big, 0, 1, device, "bf16", 1)
    model = stepper.model  # type: ignore[attr-defined]
    per_sequence = 3 * big.context * big.vocab_size * 4  # the logits, their float copy and gradient
    # Room for about 8 sequences: the probe must meet a real CUDA out-of-memory error on its way up.
    fraction = min(
        0.95,
        (torch.cuda.memory_allocated(device) + 8 * per_sequence)
        / torch.cuda.get_device_properties(device).total_memory,
    )
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:

        def trial(n: int) -> None:
            x = torch.randint(0, big.vocab_size, (n, big.context), device=device)
            with Precision("bf16", "cuda").autocast():
                _, loss = model(x, x)
            loss.backward()
            model.zero_grad(set_to_none=True)

        fits = oom_guard(trial)
        assert not fits(512)  # far too many: caught, memory released
        found = probe(fits, limit=256)
        assert 1 <= found < 256 and fits(found)
        calls: list[int] = []

        def reprobe(n: int) -> int:
            calls.append(n)
            return found

        stepper.reprobe = reprobe  # type: ignore[attr-defined]
        from geofed_hpc.client.steps import StepPlan

        stepper.plan = StepPlan(256, 1, 0, 256)  # type: ignore[attr-defined]
        x, y = _batch(big, 256, 1)
        loss = stepper.step(x, y, count=1)  # type: ignore[attr-defined]
        assert np.isfinite(loss) and calls == [256] and stepper.plan.micro_batch == found  # type: ignore[attr-defined]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
