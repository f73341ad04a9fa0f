"""A site's model: built on the meta device, checked against the device's memory, wrapped per block (activation
checkpointing, compile), sharded with FSDP2, then allocated and initialised (or loaded) tensor by tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from geofed_hpc.client.blocks import checkpoint_blocks, compile_blocks
from geofed_hpc.client.devices import device_memory, device_name
from geofed_hpc.client.fsdp import load_streamed, shard_model
from geofed_hpc.client.precision import Precision
from geofed_hpc.client.ranks import SiteRanks
from geofed_hpc.config import RunConfig
from geofed_hpc.config.train import SPLIT_PARADIGMS
from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger
from geofed_hpc.models import build_model, num_params
from geofed_hpc.models.registry import build_meta, materialize
from geofed_hpc.models.stream import initial_stream
from geofed_hpc.paradigms.site import SiteParadigm

# Paradigms whose adapters are drawn when they are added: their models are built whole, then sharded.
WITH_ADAPTERS = ("lora", "hybrid_lora", "ravan")
BYTES_PER_PARAM = 4  # float32 weights
BYTES_PER_TRAINED = 12  # float32 gradient + AdamW's two float32 moments
GIB = 2**30


@dataclass
class SiteModel:
    """The built model, its parameter count (tied ones once), whether FSDP2 shards it, and how it was wrapped."""

    model: nn.Module
    n_params: int
    sharded: bool
    checkpointed: int = 0
    compiled: int = 0


def static_bytes(n_params: int, n_trained: int, world_size: int) -> int:
    """Bytes per rank of float32 weights, gradients and AdamW state, sharded over `world_size` ranks."""
    return (BYTES_PER_PARAM * n_params + BYTES_PER_TRAINED * n_trained) // max(1, world_size)


def check_fits(cfg: RunConfig, model: nn.Module, ranks: SiteRanks, device: torch.device) -> None:
    """Refuse, with the numbers, a model whose weights, gradients and optimizer state alone exceed what each rank
    has (before anything is allocated)."""
    n = num_params(model)
    trained = 0 if cfg.paradigm.name == "zo" else sum(p.numel() for p in model.parameters() if p.requires_grad)
    need = static_bytes(n, trained, ranks.world_size)
    have = device_memory(device, ranks.local_world_size)
    if need <= have:
        return
    where = f"{device} ({device_name(device)})" if device.type == "cuda" else "this node's CPU memory (available)"
    raise ConfigError(
        f"model={cfg.model.name}: {n / 1e9:.2f}B parameters need {need / GIB:.1f} GiB per rank for float32 weights, "
        f"gradients and AdamW state ({BYTES_PER_PARAM} B x {n:,} + {BYTES_PER_TRAINED} B x {trained:,} trained, "
        f"over {ranks.world_size} rank{'s' if ranks.world_size > 1 else ''}), but {where} has {have / GIB:.1f} GiB "
        "per rank: shard it over more GPUs (site.gpus_per_node, site.tasks_per_node, site.nodes) or pick a "
        "smaller model"
    )


def build_site_model(
    cfg: RunConfig, ranks: SiteRanks, device: torch.device, precision: Precision, paradigm: SiteParadigm, init: bool
) -> SiteModel:
    """The site's model on `device`: sharded over the site's ranks when there are several. init=False: allocated,
    not initialised (a checkpoint is loaded next)."""
    sharded = ranks.world_size > 1
    if sharded and (paradigm.custom_step or paradigm.one_process):
        raise ConfigError(f"paradigm={cfg.paradigm.name} runs one process per site: set site.tasks_per_node=1")
    meta = build_meta(cfg.model)
    paradigm.prepare(meta)  # adapters and frozen weights (on meta: shapes only), before the checks and sharding
    check_fits(cfg, meta, ranks, device)
    n_params = num_params(meta)
    if cfg.paradigm.name in WITH_ADAPTERS + SPLIT_PARADIGMS:  # adapters (split: the auxiliary model) are drawn
        model = build_model(cfg.model, seed=cfg.train.seed, init=init)  # as they are added: the whole model first
        paradigm.prepare(model)
        model = paradigm.site_model(model)  # split learning: the client part
        n_params = num_params(model)
        built = _wrap(cfg, model, device)
        built.model = shard_model(model, precision) if sharded else model.to(device)
        built.n_params, built.sharded = n_params, sharded
        return built
    built = _wrap(cfg, meta, device)
    if sharded:
        shard_model(meta, precision)
    model = materialize(meta, device)  # this rank's shards only
    if init:
        what = f"model.init_from={cfg.model.init_from}" if cfg.model.init_from else "the initial weights"
        loaded = load_streamed(model, initial_stream(model, cfg.train.seed, device), what)
        logger.debug("initialised %d tensors one at a time (%s)", loaded, what)
    built.model, built.n_params, built.sharded = model, n_params, sharded
    return built


def _wrap(cfg: RunConfig, model: nn.Module, device: torch.device) -> SiteModel:
    """Activation checkpointing, then torch.compile, per block (before FSDP2 wraps the blocks)."""
    checkpointed = checkpoint_blocks(model, cfg.train.activation_checkpointing)
    compiled = compile_blocks(model, device) if cfg.train.compile else 0
    return SiteModel(model, 0, False, checkpointed, compiled)


def decay_groups(model: nn.Module, trainable: list[nn.Parameter], weight_decay: float) -> list[dict[str, object]]:
    """AdamW parameter groups: weight decay on matrices (2-D and more) that are not embeddings; none on norms,
    biases and embeddings (a tied output layer is the embedding)."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay = [p for p in trainable if p.ndim >= 2 and id(p) not in embedded]
    chosen = {id(p) for p in decay}
    rest = [p for p in trainable if id(p) not in chosen]
    groups: list[dict[str, object]] = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if rest:
        groups.append({"params": rest, "weight_decay": 0.0})
    return groups
