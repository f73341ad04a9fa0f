"""What a site process trains with: its rank, device, precision, (FSDP2) model, data, micro-batch and group."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from geofed_hpc.client.build import build_site_model, decay_groups
from geofed_hpc.client.devices import device_name
from geofed_hpc.client.distributed import SiteRanks, init_distributed, pick_device, site_ranks
from geofed_hpc.client.fsdp import local_numel
from geofed_hpc.client.group import SiteGroup
from geofed_hpc.client.microbatch import cache_key, cpu_micro_batch, oom_guard, probe, read_cache, write_cache
from geofed_hpc.client.precision import Precision, choose_precision
from geofed_hpc.client.schedule import LRSchedule
from geofed_hpc.client.steps import Stepper, StepPlan, StepRules
from geofed_hpc.config import RunConfig
from geofed_hpc.data import BatchSampler, eval_batches
from geofed_hpc.data.corpus import default_cache_dir
from geofed_hpc.data.shards import site_tokens
from geofed_hpc.data.squad import QAExample, QASampler, is_squad, qa_eval_batches, split_examples
from geofed_hpc.data.tokenizer import run_tokenizer
from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger
from geofed_hpc.models import build_model
from geofed_hpc.paradigms.site import SiteParadigm, site_paradigm

# Followers wait for rank 0 through a push, the pull's wait for the round and a checkpoint write.
COLLECTIVE_SLACK = timedelta(minutes=5)


@dataclass
class SiteRuntime:
    ranks: SiteRanks
    device: torch.device
    precision: Precision
    model: nn.Module
    optimizer: torch.optim.Optimizer
    sampler: BatchSampler | QASampler
    group: SiteGroup
    micro_batch: int
    initialized: bool
    cfg: RunConfig
    paradigm: SiteParadigm

    def initial_arrays(self) -> dict[str, np.ndarray]:
        """Freshly initialised weights (for a model built uninitialised whose checkpoint then failed to load)."""
        model = build_model(self.cfg.model, seed=self.cfg.train.seed)
        self.paradigm.prepare(model)
        model = self.paradigm.site_model(model)
        return {n: p.detach().numpy() for n, p in model.named_parameters()}

    def describe(self) -> dict[str, str | int]:
        """Device, GPU model, precision, micro-batch and ranks, as the job log and the metrics state them."""
        return {
            "site/device": str(self.device),
            "site/gpu": device_name(self.device) if self.device.type == "cuda" else "none",
            "site/precision": self.precision.name,
            "site/micro_batch": self.micro_batch,
            "site/world_size": self.ranks.world_size,
            "site/nodes": self.ranks.num_nodes,
        }


def collective_timeout(cfg: RunConfig) -> timedelta:
    """How long any collective may wait: followers sit in one while rank 0 pushes, pulls and checkpoints."""
    ps = cfg.ps
    return 2 * (ps.rpc_timeout + ps.retry_budget) + ps.round_timeout + ps.connect_timeout + COLLECTIVE_SLACK


def step_rules(cfg: RunConfig) -> StepRules:
    """What every optimizer step obeys, from train.*: schedule, gradient clipping, the NaN/Inf guard."""
    t = cfg.train
    schedule = LRSchedule(t.schedule, t.warmup_steps, t.total_steps, t.min_lr_ratio, t.decay_fraction)
    return StepRules(schedule, t.grad_clip, t.max_bad_steps, t.compile)


def build_runtime(cfg: RunConfig, site_index: int, init: bool = True) -> SiteRuntime:
    """Join the site's process group, build and shard the model, open this site's data, pick the micro-batch.

    init=False (rank 0 decides): a checkpoint is about to be loaded, so the weights are allocated, not drawn.
    train.device=cuda without a usable GPU stops here, before anything else, with the reason."""
    ranks = site_ranks()
    device = pick_device(ranks, cfg.train.device)
    init_distributed(ranks, device, collective_timeout(cfg))
    init = bool(_broadcast_int(int(init), device, ranks.world_size > 1))
    precision = choose_precision(cfg.train.precision, device)
    paradigm = site_paradigm(cfg.paradigm, cfg.train.max_local_steps)
    built = build_site_model(cfg, ranks, device, precision, paradigm, init)
    model, sharded = built.model, built.sharded
    sampler, val_batches, questions = _data(cfg, site_index)
    trainable = paradigm.trainable(model) or list(model.parameters())
    groups = decay_groups(model, trainable, cfg.train.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)  # type: ignore[arg-type]
    micro = _micro_batch(cfg, model, precision, ranks, device, built.n_params, sharded)
    plan = StepPlan(cfg.train.batch_size, ranks.world_size, ranks.rank, micro)
    stepper = Stepper(model, optimizer, precision, plan, device, sharded, rules=step_rules(cfg))
    if device.type == "cuda" and not sharded and cfg.train.micro_batch == "auto":
        stepper.reprobe = lambda n: _probe(cfg, model, precision, ranks, device, sharded, n - 1)
    group = SiteGroup(stepper, sampler, val_batches, ranks.rank, ranks.world_size, paradigm, questions)
    logger.info(
        "rank %d/%d on %s (%s, %d node%s): %s, %.1fM parameters%s, micro-batch %d x %d accumulation (site batch "
        "%d x %d tokens)%s%s",
        ranks.rank,
        ranks.world_size,
        device,
        device_name(device),
        ranks.num_nodes,
        "s" if ranks.num_nodes > 1 else "",
        precision.name,
        built.n_params / 1e6,
        f" (FSDP2: {local_numel(model) / 1e6:.1f}M on this rank)" if sharded else "",
        micro,
        len(plan.micro),
        cfg.train.batch_size,
        cfg.model.context,
        f", activation checkpointing {cfg.train.activation_checkpointing}" if built.checkpointed else "",
        ", blocks compiled" if built.compiled else "",
    )
    return SiteRuntime(ranks, device, precision, model, optimizer, sampler, group, micro, init, cfg, paradigm)


def _data(
    cfg: RunConfig, site_index: int
) -> tuple[BatchSampler | QASampler, list[tuple[torch.Tensor, torch.Tensor]], list[QAExample]]:
    """This site's sampler, the validation batches and (question answering) the validation questions; the site
    trains data shard site.first_shard + site_index of site.shards."""
    shard, shards = cfg.site.first_shard + site_index, cfg.site.shards
    seed, batch, context = cfg.train.seed * 1000 + shard, cfg.train.batch_size, cfg.model.context
    val_batch = cfg.data.val_batch_size or batch  # set, it fixes the validation windows whatever the training batch
    if is_squad(cfg.data.source):  # SQuAD v1.1 JSON: answer-only loss, exact match and F1 at each evaluation
        train_qa, val_qa = split_examples(cfg.data, shard, shards)
        return (
            QASampler(train_qa, batch, context, seed),
            qa_eval_batches(val_qa, val_batch, context, cfg.data.val_batches),
            val_qa,
        )
    run_tokenizer(cfg)  # data.tokenizer given (or the model's), and within model.vocab_size
    train, val = site_tokens(cfg.data, cfg.model.vocab_size, shard, shards)
    sampler = BatchSampler(train, batch, context, seed=seed)
    return sampler, eval_batches(val, val_batch, context, cfg.data.val_batches), []


def _micro_batch(
    cfg: RunConfig,
    model: nn.Module,
    precision: Precision,
    ranks: SiteRanks,
    device: torch.device,
    n_params: int,
    sharded: bool,
) -> int:
    limit = max(1, cfg.train.batch_size // ranks.world_size)
    if cfg.train.micro_batch != "auto":
        return min(int(cfg.train.micro_batch), limit)
    if device.type != "cuda":  # the smallest over the ranks: all ranks must run as many micro-batches
        return _min_int(cpu_micro_batch(cfg.model, n_params, ranks.world_size, limit), device, sharded)
    path = default_cache_dir() / "microbatch.json"
    key = cache_key(torch.cuda.get_device_name(device), cfg.model, precision.name, ranks.world_size)
    cached = read_cache(path, key) if ranks.is_main else None
    found = _broadcast_int(cached or 0, device, sharded)
    if found:
        return min(found, limit)
    return _probe(cfg, model, precision, ranks, device, sharded, limit)


def _probe(
    cfg: RunConfig,
    model: nn.Module,
    precision: Precision,
    ranks: SiteRanks,
    device: torch.device,
    sharded: bool,
    limit: int,
) -> int:
    """Probe the largest micro-batch up to `limit` that fits in GPU memory, and cache it."""
    if limit < 1:
        raise ConfigError(
            "micro-batch 1 does not fit in GPU memory: use more GPUs (site.gpus_per_node) or a smaller model"
        )
    micro = probe(lambda n: _agree(_try_size(model, precision, cfg, device, sharded, n), device, sharded), limit)
    if ranks.is_main:
        path = default_cache_dir() / "microbatch.json"
        key = cache_key(torch.cuda.get_device_name(device), cfg.model, precision.name, ranks.world_size)
        write_cache(path, key, micro, f"{torch.cuda.get_device_name(device)} {cfg.model.name} {precision.name}")
    return micro


def _try_size(
    model: nn.Module, precision: Precision, cfg: RunConfig, device: torch.device, sharded: bool, n: int
) -> bool:
    """Forward+backward of n random sequences with AdamW's state reserved; False on CUDA out-of-memory."""
    local = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters())

    def trial(size: int) -> None:
        reserve = torch.empty(local * 8, dtype=torch.uint8, device=device)  # AdamW's two float32 moments
        x = torch.randint(0, cfg.model.vocab_size, (size, cfg.model.context), device=device)
        with contextlib.nullcontext() if sharded else precision.autocast():
            _, loss = model(x, x)
        loss.backward()
        model.zero_grad(set_to_none=True)
        del reserve

    ok = oom_guard(trial)(n)
    model.zero_grad(set_to_none=True)
    return ok


def _agree(ok: bool, device: torch.device, sharded: bool) -> bool:
    if not sharded:
        return ok
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _min_int(value: int, device: torch.device, sharded: bool) -> int:
    if not sharded:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _broadcast_int(value: int, device: torch.device, sharded: bool) -> int:
    if not sharded:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return int(t.item())
