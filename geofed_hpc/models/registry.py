"""Build the model class a ModelConfig's `arch` names (gpt2, llama, or hf: a transformers model from a folder), on any
device, deterministically."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from geofed_hpc.config import ModelConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.models.gpt import GPT
from geofed_hpc.models.llama import Llama

ARCHS: dict[str, Callable[[ModelConfig], nn.Module]] = {"gpt2": GPT, "llama": Llama}


def build_model(cfg: ModelConfig, seed: int, device: str | torch.device = "cpu", init: bool = True) -> nn.Module:
    """The `cfg.arch` model with deterministic init for `seed` (global RNG untouched), weights from
    `cfg.init_from` when set. device="meta" allocates nothing (shapes and parameter counts only); init=False
    allocates without initialising (for weights that are loaded next: saves seconds on large models)."""
    model = build_meta(cfg)
    if torch.device(device).type == "meta":
        return model
    model = materialize(model, device)
    if not init:
        return model
    if cfg.arch == "hf":
        from geofed_hpc.models.hfmodel import fill, hf_initial_tensors

        fill(model, hf_initial_tensors(model, seed, device), f"model.path={cfg.path}")
    elif cfg.init_from:
        from geofed_hpc.models.hf import load_hf_checkpoint

        load_hf_checkpoint(model, cfg.init_from)
    else:
        model.init_weights(seed)  # type: ignore[operator]
    return model


def build_meta(cfg: ModelConfig) -> nn.Module:
    """The `cfg.arch` model on the meta device: shapes only, nothing allocated (shard it, then `materialize`)."""
    if cfg.arch == "hf":
        from geofed_hpc.models.hfmodel import build_hf_meta

        return build_hf_meta(cfg)
    try:
        cls = ARCHS[cfg.arch]
    except KeyError:
        raise ConfigError(f"model.arch: no model for {cfg.arch!r}; known: {', '.join(ARCHS)}") from None
    with torch.device("meta"):
        return cls(cfg)


def materialize(model: nn.Module, device: str | torch.device) -> nn.Module:
    """Allocate a meta model's (or its shards') tensors on `device`, uninitialised; buffers recomputed."""
    if model.cfg.arch == "hf":  # type: ignore[union-attr]
        from geofed_hpc.models.hfmodel import materialize_hf

        return materialize_hf(model, device)
    model = model.to_empty(device=device)
    cfg = model.cfg
    if cfg.tie_embeddings and model.lm_head.weight is not model.wte.weight:  # type: ignore[union-attr]
        model.lm_head.weight = model.wte.weight  # type: ignore[union-attr]
    reset = getattr(model, "reset_buffers", None)
    if callable(reset):
        reset()
    return model


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks, in order: what FSDP2 shards one by one, activation checkpointing recomputes and
    torch.compile compiles (ours: `model.blocks`; a model=hf model's: the layers its `_no_split_modules` names)."""
    blocks = model.get_submodule("blocks") if "blocks" in model._modules else None
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    from geofed_hpc.models.hfmodel import decoder_layers

    return decoder_layers(model)


def num_params(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
