"""Site parallelism: ranks from submitit/Slurm/torchrun, precision choice, micro-batch probe, FSDP2 parity."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

from geofed_hpc.client.distributed import holders, port_for, site_ranks, wait_released
from geofed_hpc.client.job import global_rank
from geofed_hpc.client.microbatch import (
    cache_key,
    cpu_micro_batch,
    estimate_bytes_per_sample,
    oom_guard,
    probe,
    read_cache,
    split_batch,
    write_cache,
)
from geofed_hpc.client.precision import choose_precision
from geofed_hpc.config import ModelConfig
from geofed_hpc.errors import ConfigError
from tests.dist_util import run_ranks

CFG = ModelConfig(name="t", vocab_size=128, context=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)
LLAMA = ModelConfig(
    name="l", arch="llama", vocab_size=128, context=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48
)


JOB_VARIABLES = (
    "SUBMITIT_EXECUTOR", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_NUM_NODES",
    "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID",
)  # fmt: skip


def _no_job(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in JOB_VARIABLES:
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(
    ("nodes", "head"),
    [("gpu[007-009,012],cpu1", "gpu007"), ("node17", "node17"), ("a01,b02", "a01"), ("n[3-4]-ib", "n3-ib")],
)
def test_master_address_is_the_first_host_of_the_slurm_node_list(
    monkeypatch: pytest.MonkeyPatch, nodes: str, head: str
) -> None:
    _no_job(monkeypatch)
    for key, value in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": nodes}.items():
        monkeypatch.setenv(key, value)
    assert site_ranks().master_addr == head
    monkeypatch.delenv("SUBMITIT_EXECUTOR")  # inside an allocation, without submitit: the same node list
    assert site_ranks().master_addr == head


def test_an_unreadable_node_list_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_job(monkeypatch)
    for key, value in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[007-"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"SLURM_JOB_NODELIST: cannot read a host name from 'gpu\[007-'"):
        site_ranks()
    monkeypatch.delenv("SUBMITIT_EXECUTOR")
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        site_ranks()


def test_ranks_from_submitit_slurm_torchrun_and_none(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_job(monkeypatch)
    single = site_ranks()
    assert (single.rank, single.world_size, single.master_addr, single.is_main) == (0, 1, "127.0.0.1", True)
    assert (single.local_world_size, single.num_nodes, global_rank()) == (1, 1, 0)

    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1"}
    for key, value in {**slurm, "SLURM_JOB_NODELIST": "gpu[007-010]", "SLURM_JOB_NUM_NODES": "4"}.items():
        monkeypatch.setenv(key, value)
    ranks = site_ranks()
    assert (ranks.rank, ranks.local_rank, ranks.world_size, ranks.job_id) == (5, 1, 8, "4242")
    assert ranks.master_addr == "gpu007" and ranks.master_port == port_for("4242") and not ranks.is_main
    assert (ranks.local_world_size, ranks.num_nodes, global_rank()) == (2, 4, 5)
    assert 20000 <= ranks.master_port <= 60000
    monkeypatch.setenv("SLURM_PROCID", "0")  # every task of the job meets at the same port; another job elsewhere
    assert site_ranks().master_port == ranks.master_port and site_ranks().is_main
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    assert site_ranks().master_port != ranks.master_port
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.9")
    assert (site_ranks().master_addr, site_ranks().master_port) == ("10.0.0.9", 29999)
    monkeypatch.delenv("MASTER_ADDR")

    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")  # submitit's LocalExecutor: one node, loopback
    local = {"SUBMITIT_LOCAL_JOB_ID": "77", "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_GLOBALID": "1"}
    for key, value in {**local, "SUBMITIT_LOCAL_LOCALID": "1"}.items():
        monkeypatch.setenv(key, value)
    ranks = site_ranks()
    assert (ranks.rank, ranks.world_size, ranks.master_addr) == (1, 2, "127.0.0.1")
    assert (ranks.local_world_size, ranks.num_nodes, global_rank()) == (2, 1, 1)

    monkeypatch.delenv("SUBMITIT_EXECUTOR")  # torchrun: its variables
    for key, value in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "node-a")
    ranks = site_ranks()
    assert (ranks.rank, ranks.local_rank, ranks.world_size, ranks.master_addr, ranks.master_port) == (
        3, 1, 4, "node-a", 29999
    )  # fmt: skip
    assert (ranks.local_world_size, ranks.num_nodes, global_rank()) == (2, 2, 3)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="rank 3 is outside"):
        site_ranks()


def test_precision_choice_and_fallbacks(caplog: pytest.LogCaptureFixture) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert choose_precision("auto", cpu).name == "fp32"
    assert choose_precision("bf16", cpu).name == "bf16"
    assert choose_precision("auto", gpu, capability=(9, 0)).name == "bf16"  # H100
    assert choose_precision("auto", gpu, capability=(7, 0)).name == "fp16"  # V100
    assert choose_precision("fp32", gpu, capability=(7, 0)).name == "fp32"
    fp16 = choose_precision("fp16", gpu, capability=(8, 6))
    assert fp16.needs_scaler and fp16.dtype == torch.float16
    with caplog.at_level(logging.WARNING, logger="geofed_hpc"):
        fallback = choose_precision("bf16", gpu, capability=(7, 0))
        assert choose_precision("fp16", cpu).name == "fp32"
    assert fallback.name == "fp16" and fallback.needs_scaler
    assert "no native bf16" in caplog.text and "fp16 is not supported on cpu" in caplog.text
    with pytest.raises(ConfigError, match="train.precision"):
        choose_precision("fp8", cpu)


def test_split_batch_gives_every_rank_its_share() -> None:
    rows = [split_batch(12, 3, r, 3) for r in range(3)]
    assert [r[0] for r in rows] == [slice(0, 4), slice(4, 8), slice(8, 12)]
    assert [r[1] for r in rows] == [[3, 1]] * 3
    assert split_batch(8, 1, 0, 8) == (slice(0, 8), [8])
    with pytest.raises(ConfigError, match="train.batch_size: 10 sequences do not split evenly over the site's 4"):
        split_batch(10, 4, 0, 1)


def test_probe_finds_the_largest_fitting_size_with_a_margin() -> None:
    tried: list[int] = []

    def step(n: int) -> None:
        tried.append(n)
        if n > 37:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (pretend 37 sequences fill the GPU)")

    assert probe(oom_guard(step), limit=256) == int(37 * 0.85)
    assert tried[:7] == [1, 2, 4, 8, 16, 32, 64] and 37 in tried
    assert probe(oom_guard(step), limit=24) == 24  # the whole site batch fits: no margin needed
    with pytest.raises(ConfigError, match="micro-batch 1 does not fit"):
        probe(lambda n: False, limit=8)

    def bug(n: int) -> None:
        raise ValueError("a real bug, not out-of-memory")

    with pytest.raises(ValueError, match="a real bug"):
        probe(oom_guard(bug), limit=8)


def test_probe_cache_is_keyed_by_gpu_model_and_shape(tmp_path: Path) -> None:
    path = tmp_path / "mb.json"
    key = cache_key("NVIDIA H100 80GB HBM3", CFG, "bf16", 2)
    assert read_cache(path, key) is None
    write_cache(path, key, 12, "H100 t bf16")
    assert read_cache(path, key) == 12
    renamed = ModelConfig(**{**CFG.__dict__, "name": "other", "init_from": "/x"})
    assert cache_key("NVIDIA H100 80GB HBM3", renamed, "bf16", 2) == key
    assert cache_key("Tesla V100-SXM2-32GB", CFG, "bf16", 2) != key
    assert cache_key("NVIDIA H100 80GB HBM3", CFG, "fp16", 2) != key
    path.write_text("garbage")
    assert read_cache(path, key) is None


def test_cpu_budget_estimate() -> None:
    per = estimate_bytes_per_sample(CFG)
    assert cpu_micro_batch(CFG, n_params=10_000, world_size=1, limit=64, budget=10_000 * 16 + 5 * per) == 5
    assert cpu_micro_batch(CFG, n_params=10_000, world_size=1, limit=4, budget=10**12) == 4
    assert cpu_micro_batch(CFG, n_params=10**9, world_size=1, limit=64, budget=10**9) == 1
    assert 1 <= cpu_micro_batch(CFG, n_params=10_000, world_size=2, limit=64) <= 64


def test_wait_released_waits_until_another_thread_lets_go_of_the_tensor() -> None:
    """What a gloo worker does after a collective returned (it still holds the tensor), played by a thread."""
    tensor = torch.zeros(4)
    before = holders(tensor)
    holder = [tensor]  # the collective's reference
    gone = threading.Event()

    def worker() -> None:
        time.sleep(0.2)  # still busy with the finished collective when the caller moves on
        holder.clear()
        gone.set()

    threading.Thread(target=worker).start()
    wait_released(tensor, before)
    assert holders(tensor) == before  # released when the wait returned (its event may be set a moment later)
    assert gone.wait(timeout=60)
    holder.append(tensor)  # never dropped: the wait ends at its timeout, the reference is still there
    wait_released(tensor, before, timeout=timedelta(milliseconds=50))
    assert len(holder) == 1 and holder[0] is tensor


def _batch(cfg: ModelConfig, b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, cfg.vocab_size, (b, cfg.context + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _train(cfg: ModelConfig, rank: int, world: int, micro: int, steps: int, sharded: bool) -> tuple[dict, list[float]]:
    from geofed_hpc.client.fsdp import full_state, shard_model
    from geofed_hpc.client.precision import Precision
    from geofed_hpc.client.steps import Stepper, StepPlan
    from geofed_hpc.models import build_model

    model = build_model(cfg, seed=3)
    if sharded:
        shard_model(model, Precision("fp32"))
    # SGD: parity of gradients shows in the weights (Adam would blow float noise in zero-gradient entries,
    # e.g. the key biases, up to lr-sized steps).
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    plan = StepPlan(6, world, rank, micro)
    stepper = Stepper(model, opt, Precision("fp32"), plan, torch.device("cpu"), sharded, warmup_steps=2)
    losses = [stepper.step(*_batch(cfg, 6, seed), count=seed + 1) for seed in range(steps)]
    return full_state(model), losses


def _parity_rank(rank: int, out: str) -> None:
    from geofed_hpc.client.fsdp import full_optimizer_state, full_state, load_full_state, shard_model
    from geofed_hpc.client.precision import Precision
    from geofed_hpc.models import build_model

    for cfg in (CFG, LLAMA):
        for micro in (3, 2):  # 3: one micro-batch per rank; 2: accumulation over a 2 + 1 split
            state, losses = _train(cfg, rank, 2, micro, steps=3, sharded=True)
            if rank == 0:
                np.savez(
                    f"{out}/{cfg.arch}-{micro}.npz", losses=np.array(losses), **{k: v.numpy() for k, v in state.items()}
                )
    # Full state round trip through rank 0, and the optimizer's full state on rank 0 only.
    model = shard_model(build_model(CFG, seed=1), Precision("fp32"))
    source = {k: v + 1 for k, v in full_state(model).items()}  # every rank gathers; only rank 0 gets tensors
    load_full_state(model, source)
    back = full_state(model)
    opt = torch.optim.AdamW(model.parameters())
    _, loss = model(*_batch(CFG, 2, rank))
    loss.backward()
    opt.step()
    optim = full_optimizer_state(model, opt)
    if rank == 0:
        assert back.keys() == source.keys() and all(torch.equal(back[k], source[k]) for k in source)
        assert optim["state"]["wte.weight"]["exp_avg"].shape == (CFG.vocab_size, CFG.d_model)
    else:
        assert back == {} and optim == {}


@pytest.mark.slow
def test_two_rank_fsdp2_matches_one_process(tmp_path: Path) -> None:
    run_ranks(_parity_rank, 2, str(tmp_path))
    torch.set_num_threads(1)
    for cfg in (CFG, LLAMA):
        single, single_losses = _train(cfg, 0, 1, micro=6, steps=3, sharded=False)
        for micro in (3, 2):
            got = np.load(tmp_path / f"{cfg.arch}-{micro}.npz")
            np.testing.assert_allclose(got["losses"], single_losses, rtol=1e-5)
            assert sorted(k for k in got.files if k != "losses") == sorted(single)
            for name, value in single.items():
                np.testing.assert_allclose(got[name], value.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
