"""What a site process trains with: its rank, device, precision, (FSDP2) model, data, micro-batch and group."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from geofed_hpc.client.distributed import SiteRanks, init_distributed, pick_device, site_ranks
from geofed_hpc.client.fsdp import shard_model
from geofed_hpc.client.group import SiteGroup
from geofed_hpc.client.microbatch import cache_key, cpu_micro_batch, oom_guard, probe, read_cache, write_cache
from geofed_hpc.client.precision import Precision, choose_precision
from geofed_hpc.client.steps import Stepper, StepPlan
from geofed_hpc.config import RunConfig
from geofed_hpc.data import BatchSampler, eval_batches
from geofed_hpc.data.corpus import default_cache_dir
from geofed_hpc.data.shards import site_tokens
from geofed_hpc.data.squad import QAExample, QASampler, is_squad, qa_eval_batches, split_examples
from geofed_hpc.data.tokenizer import run_tokenizer
from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger
from geofed_hpc.models import build_model, num_params
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
        return {n: p.detach().numpy() for n, p in model.named_parameters()}


def collective_timeout(cfg: RunConfig) -> timedelta:
    """How long any collective may wait: followers sit in one while rank 0 pushes, pulls and checkpoints."""
    ps = cfg.ps
    return 2 * (ps.rpc_timeout + ps.retry_budget) + ps.round_timeout + ps.connect_timeout + COLLECTIVE_SLACK


def build_runtime(cfg: RunConfig, site_index: int, init: bool = True) -> SiteRuntime:
    """Join the site's process group, build and shard the model, open this site's data, pick the micro-batch.

    init=False (rank 0 decides): a checkpoint is about to be loaded, so the weights are allocated, not drawn.
    Precision, micro-batch and device come from train.precision / train.micro_batch / train.device when the
    config has them (auto, auto, auto otherwise)."""
    ranks = site_ranks()
    device = pick_device(ranks, str(getattr(cfg.train, "device", "auto")))
    init_distributed(ranks, device, collective_timeout(cfg))
    init = bool(_broadcast_int(int(init), device, ranks.world_size > 1))
    precision = choose_precision(str(getattr(cfg.train, "precision", "auto")), device)
    sampler, val_batches, questions = _data(cfg, site_index)
    model = build_model(cfg.model, seed=cfg.train.seed, init=init)
    paradigm = site_paradigm(cfg.paradigm, cfg.train.max_local_steps)
    paradigm.prepare(model)  # adapters and frozen weights, before sharding and the optimizer
    n_params = num_params(model)
    sharded = ranks.world_size > 1
    if sharded and paradigm.custom_step:
        raise ConfigError(f"paradigm={cfg.paradigm.name} runs one process per site: set site.tasks_per_node=1")
    model = shard_model(model, precision) if sharded else model.to(device)
    trainable = paradigm.trainable(model) or list(model.parameters())
    optimizer = torch.optim.AdamW(trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    micro = _micro_batch(cfg, model, precision, ranks, device, n_params, sharded)
    plan = StepPlan(cfg.train.batch_size, ranks.world_size, ranks.rank, micro)
    stepper = Stepper(model, optimizer, precision, plan, device, sharded, cfg.train.warmup_steps)
    group = SiteGroup(stepper, sampler, val_batches, ranks.rank, ranks.world_size, paradigm, questions)
    accumulation = len(plan.micro)
    logger.info(
        "rank %d/%d on %s: %s, %.1fM parameters%s, micro-batch %d x %d accumulation (site batch %d x %d tokens)",
        ranks.rank,
        ranks.world_size,
        device,
        precision.name,
        n_params / 1e6,
        " (FSDP2)" if sharded else "",
        micro,
        accumulation,
        cfg.train.batch_size,
        cfg.model.context,
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
    requested = int(getattr(cfg.train, "micro_batch", 0))
    if requested > 0:
        return min(requested, limit)
    if device.type != "cuda":  # the smallest over the ranks: all ranks must run as many micro-batches
        return _min_int(cpu_micro_batch(cfg.model, n_params, ranks.world_size, limit), device, sharded)
    path = default_cache_dir() / "microbatch.json"
    key = cache_key(torch.cuda.get_device_name(device), cfg.model, precision.name, ranks.world_size)
    cached = read_cache(path, key) if ranks.is_main else None
    found = _broadcast_int(cached or 0, device, sharded)
    if found:
        return min(found, limit)
    micro = probe(lambda n: _agree(_try_size(model, precision, cfg, device, sharded, n), device, sharded), limit)
    if ranks.is_main:
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
