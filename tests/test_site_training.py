"""What every local step obeys: lr schedules, weight decay groups, gradient clipping (also under two-rank FSDP2),
the NaN/Inf guard, per-block activation checkpointing and compile, the mid-run out-of-memory retry, devices."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from geofed_hpc.cli import compose_config
from geofed_hpc.client.blocks import checkpoint_blocks, compile_blocks, compile_problem
from geofed_hpc.client.build import check_fits, decay_groups
from geofed_hpc.client.devices import check_device, cuda_problem, pick_device
from geofed_hpc.client.precision import Precision
from geofed_hpc.client.ranks import SiteRanks
from geofed_hpc.client.schedule import LRSchedule, warmup_factor
from geofed_hpc.client.steps import Stepper, StepPlan, StepRules
from geofed_hpc.config import ModelConfig, TrainConfig
from geofed_hpc.errors import ConfigError, GeofedError
from geofed_hpc.models import build_model
from tests.dist_util import run_ranks

GPT = ModelConfig(name="t", vocab_size=128, context=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)
LLAMA = ModelConfig(
    name="l", arch="llama", vocab_size=128, context=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48
)
CPU = torch.device("cpu")


def _batch(cfg: ModelConfig, b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, cfg.vocab_size, (b, cfg.context + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def test_schedules_warm_up_then_hold_decay_cosine_or_wsd_and_stay_at_the_end() -> None:
    constant = LRSchedule("constant", warmup=4)
    assert [constant.factor(n) for n in (1, 2, 4, 5, 1000)] == [warmup_factor(n, 4) for n in (1, 2, 4, 5, 1000)]
    cosine = LRSchedule("cosine", warmup=10, total=110, min_ratio=0.1)
    assert cosine.factor(5) == 0.5 and cosine.factor(10) == 1.0
    assert cosine.factor(60) == pytest.approx(0.55)  # halfway: the mean of 1 and the floor
    assert cosine.factor(110) == pytest.approx(0.1) and cosine.factor(500) == pytest.approx(0.1)
    assert all(cosine.factor(n) >= cosine.factor(n + 1) for n in range(10, 200))
    wsd = LRSchedule("wsd", warmup=10, total=100, min_ratio=0.0, decay_fraction=0.2)
    assert [wsd.factor(n) for n in (10, 50, 80)] == [1.0, 1.0, 1.0]  # stable until the last 20 steps
    assert wsd.factor(90) == pytest.approx(0.5) and wsd.factor(100) == 0.0 and wsd.factor(1000) == 0.0
    with pytest.raises(ValueError, match="total steps"):
        LRSchedule("cosine", warmup=10, total=10)


def test_bad_training_settings_name_the_field() -> None:
    for kwargs, message in (
        ({"schedule": "cosine"}, "train.total_steps: schedule=cosine needs the site's planned optimizer steps"),
        ({"schedule": "wsd", "total_steps": 50, "warmup_steps": 80}, "train.total_steps: 50 is not more than"),
        ({"grad_clip": 0.0}, "train.grad_clip: must be positive (null: no clipping), got 0"),
        ({"grad_clip": -1.5}, "train.grad_clip: must be positive (null: no clipping), got -1.5"),
        ({"micro_batch": 0}, "train.micro_batch: expected auto or a whole number of sequences (1 or more), got 0"),
        ({"activation_checkpointing": "some"}, "train.activation_checkpointing: must be one of none, full, selective"),
        ({"device": "tpu"}, "train.device: must be one of auto, cpu, cuda; got 'tpu'"),
        ({"max_bad_steps": 0}, "train.max_bad_steps: must be at least 1, got 0"),
    ):
        with pytest.raises(ConfigError) as info:
            TrainConfig(**kwargs)  # type: ignore[arg-type]
        assert str(info.value).startswith(message) and "\n" not in str(info.value)
    cfg, _ = compose_config(["train.micro_batch=6", "train.grad_clip=1", "train.schedule=wsd", "train.total_steps=9"])
    assert (cfg.train.micro_batch, cfg.train.grad_clip, cfg.train.schedule) == (6, 1.0, "wsd")


def test_weight_decay_skips_norms_biases_and_embeddings() -> None:
    for cfg in (GPT, ModelConfig(**{**LLAMA.__dict__, "tie_embeddings": False})):
        model = build_model(cfg, seed=0)
        names = {id(p): n for n, p in model.named_parameters()}
        decay, rest = decay_groups(model, list(model.parameters()), 0.1)
        decayed = {names[id(p)] for p in decay["params"]}  # type: ignore[attr-defined]
        skipped = {names[id(p)] for p in rest["params"]}  # type: ignore[attr-defined]
        assert (decay["weight_decay"], rest["weight_decay"]) == (0.1, 0.0)
        assert decayed | skipped == set(names.values()) and not decayed & skipped
        assert all(n.startswith("blocks.") or n == "lm_head.weight" for n in decayed)
        assert all(n.endswith(("bias", "norm.weight", "ln1.weight", "ln2.weight", "ln_f.weight")) or "wte" in n or
                   "wpe" in n for n in skipped)  # fmt: skip
        assert ("lm_head.weight" in decayed) == (not cfg.tie_embeddings) and "wte.weight" in skipped


def _stepper(model: nn.Module, rules: StepRules, micro: int = 4) -> Stepper:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Stepper(model, opt, Precision("fp32"), StepPlan(4, 1, 0, micro), CPU, False, rules=rules)


class Flaky(nn.Module):
    """A model whose loss is NaN on the calls listed in `bad` (1-based)."""

    def __init__(self, inner: nn.Module, bad: set[int]) -> None:
        super().__init__()
        self.inner, self.bad, self.calls = inner, bad, 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        logits, loss = self.inner(x, y)
        return logits, loss * math.nan if self.calls in self.bad else loss


def test_a_nan_loss_skips_the_step_and_too_many_in_a_row_stop_the_site() -> None:
    model = Flaky(build_model(GPT, seed=0), bad={2, 4, 5, 6})
    stepper = _stepper(model, StepRules(max_bad_steps=3))
    assert math.isfinite(stepper.step(*_batch(GPT, 4, 1), count=1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert math.isnan(stepper.step(*_batch(GPT, 4, 2), count=2))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # skipped: nothing changed
    assert (stepper.skipped, stepper.bad_run) == (1, 1)
    assert math.isfinite(stepper.step(*_batch(GPT, 4, 3), count=3)) and stepper.bad_run == 0
    stepper.step(*_batch(GPT, 4, 4), count=4)
    stepper.step(*_batch(GPT, 4, 5), count=5)
    with pytest.raises(GeofedError, match=r"NaN/Inf in 3 steps in a row \(the last at site step 6"):
        stepper.step(*_batch(GPT, 4, 6), count=6)
    assert stepper.skipped == 4


def test_grad_clip_scales_the_global_norm_down_to_the_limit() -> None:
    free = _stepper(build_model(GPT, seed=0), StepRules())
    clipped = _stepper(build_model(GPT, seed=0), StepRules(grad_clip=0.01))
    x, y = _batch(GPT, 4, 0)
    free.step(x, y, count=1)
    clipped.step(x, y, count=1)
    assert clipped.grad_norm == pytest.approx(free.grad_norm) and free.grad_norm > 0.01  # the norm before clipping
    norm = torch.nn.utils.get_total_norm([p.grad for p in clipped.model.parameters() if p.grad is not None])
    assert float(norm) == pytest.approx(0.01, rel=1e-4)


def _clip_rank(rank: int, out: str) -> None:
    from geofed_hpc.client.fsdp import full_state, shard_model

    for cfg in (GPT, LLAMA):
        model = shard_model(build_model(cfg, seed=3), Precision("fp32"))
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        stepper = Stepper(model, opt, Precision("fp32"), StepPlan(6, 2, rank, 2), CPU, True, rules=CLIP)
        norms = []
        for s in range(3):
            stepper.step(*_batch(cfg, 6, s), count=s + 1)
            norms.append(stepper.grad_norm)
        state = full_state(model)
        if rank == 0:
            np.savez(f"{out}/{cfg.arch}.npz", norms=np.array(norms), **{k: v.numpy() for k, v in state.items()})


CLIP = StepRules(grad_clip=0.05)


@pytest.mark.slow
def test_grad_clipping_under_two_rank_fsdp2_gives_the_one_process_update(tmp_path: Path) -> None:
    run_ranks(_clip_rank, 2, str(tmp_path))
    torch.set_num_threads(1)
    for cfg in (GPT, LLAMA):
        model = build_model(cfg, seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        one = Stepper(model, opt, Precision("fp32"), StepPlan(6, 1, 0, 6), CPU, False, rules=CLIP)
        norms = []
        for s in range(3):
            one.step(*_batch(cfg, 6, s), count=s + 1)
            norms.append(one.grad_norm)
        got = np.load(tmp_path / f"{cfg.arch}.npz")
        assert min(norms) > 0.05  # every step was clipped
        np.testing.assert_allclose(got["norms"], norms, rtol=1e-5)  # the global norm over both ranks' shards
        for name, value in model.named_parameters():
            np.testing.assert_allclose(got[name], value.detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt2", "llama"])
def test_activation_checkpointing_keeps_the_names_and_the_gradients(cfg: ModelConfig) -> None:
    x, y = _batch(cfg, 2, 0)
    grads = {}
    for mode in ("none", "full", "selective"):
        model = build_model(cfg, seed=1)
        assert checkpoint_blocks(model, mode) == (0 if mode == "none" else cfg.n_layers)
        _, loss = model(x, y)
        loss.backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["full"].keys() == grads["none"].keys() == grads["selective"].keys()
    for mode in ("full", "selective"):
        for name, g in grads["none"].items():
            torch.testing.assert_close(grads[mode][name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_ones_on_this_cpu() -> None:
    assert compile_problem(CPU) is None  # gcc is here: inductor builds its CPU kernels
    x, y = _batch(LLAMA, 2, 0)
    losses = []
    for compiled in (False, True):
        model = build_model(LLAMA, seed=1)
        names = [n for n, _ in model.named_parameters()]
        if compiled:
            assert compile_blocks(model, CPU) == LLAMA.n_layers
        assert [n for n, _ in model.named_parameters()] == names  # compiled in place: names unchanged
        _, loss = model(x, y)
        loss.backward()
        losses.append(float(loss.detach()))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_compile_without_a_compiler_is_refused_saying_how(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    assert "C++ compiler" in (compile_problem(CPU) or "")
    with pytest.raises(ConfigError, match=r"^train.compile: inductor builds CPU kernels .* set train.compile=false"):
        compile_blocks(build_model(GPT, seed=0), CPU)


class OutOfMemoryAbove(nn.Module):
    """A model that runs out of (pretend) GPU memory on micro-batches larger than `fits`."""

    def __init__(self, inner: nn.Module, fits: int) -> None:
        super().__init__()
        self.inner, self.fits = inner, fits

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.size(0) > self.fits:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (pretend: {x.size(0)} > {self.fits} sequences)")
        return self.inner(x, y)


def test_an_out_of_memory_error_mid_run_probes_again_smaller_once(caplog: pytest.LogCaptureFixture) -> None:
    model = OutOfMemoryAbove(build_model(GPT, seed=0), fits=2)
    stepper = _stepper(model, StepRules(), micro=4)
    asked: list[int] = []
    stepper.reprobe = lambda n: asked.append(n) or 2  # type: ignore[func-returns-value]
    with caplog.at_level("WARNING", logger="geofed_hpc"):
        assert math.isfinite(stepper.step(*_batch(GPT, 4, 0), count=1))
    assert asked == [4] and stepper.plan.micro_batch == 2 and stepper.reprobe is None
    assert "out of GPU memory at micro-batch 4 mid-run; probed again: micro-batch 2" in caplog.text
    model.fits = 1  # once only: a second out-of-memory error stops the site, naming the micro-batch
    with pytest.raises(GeofedError, match="out of GPU memory at micro-batch 2 mid-run; set train.micro_batch below 2"):
        stepper.step(*_batch(GPT, 4, 1), count=2)


def test_cuda_on_this_cpu_only_torch_is_refused_with_the_reason() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    problem = cuda_problem()
    assert problem is not None and "\n" not in problem
    expected = "CPU-only build" if torch.version.cuda is None else "sees no GPU"
    with pytest.raises(ConfigError, match=f"^train.device=cuda: .*{expected}"):
        check_device("cuda")
    assert pick_device(0, "auto") == CPU and pick_device(0, "cpu") == CPU


def test_a_model_too_large_for_the_devices_is_refused_with_the_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("geofed_hpc.client.build.device_memory", lambda device, local: 80 * 2**30)
    cfg, _ = compose_config(["model=llama3_8b"])
    from geofed_hpc.models.registry import build_meta

    meta = build_meta(cfg.model)
    with pytest.raises(ConfigError) as info:
        check_fits(cfg, meta, SiteRanks(world_size=1), CPU)
    text = str(info.value)
    assert text.startswith("model=llama3_8b: 8.03B parameters need 119.7 GiB per rank") and "80.0 GiB" in text
    assert "site.gpus_per_node" in text
    check_fits(cfg, meta, SiteRanks(world_size=2, local_world_size=2), CPU)  # two ranks: 59.8 GiB each, fits
