"""Adapters added to a model's nn.Linear layers in place: LoRA (A, B) and RAVAN (shared A_i, B_i, heads H_i).

An output layer whose weight is the token embedding's (tied) is adapted on both of its ends: the adapter's tensors
live on the embedding module (`wte.lora_a`, ...) and act on the lookup too, so the adapted model is exactly the
plain model with the merged weight W + delta W, the way the export writes it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from geofed_hpc.config import ParadigmConfig
from geofed_hpc.config.train import ATTENTION_TARGET, DEFAULT_TARGETS
from geofed_hpc.errors import ConfigError

ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: mod for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}


def _pattern_names(names: list[str]) -> list[str]:
    """Layer names with everything up to their block index dropped (blocks.3.attn.qkv -> attn.qkv,
    model.layers.3.self_attn.q_proj -> self_attn.q_proj), for error messages."""
    out = []
    for name in names:
        short = re.sub(r"^(.*?\.)?\d+\.", "", name)
        if short not in out:
            out.append(short)
    return out


def attention_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear inside each decoder block's attention module (a child whose class name says Attention, or
    that is called self_attn, attn, attention or self_attention): the `attention` target."""
    from geofed_hpc.models.registry import decoder_blocks

    names = {id(m): n for n, m in model.named_modules()}
    found: dict[str, nn.Linear] = {}
    for block in decoder_blocks(model):
        for child_name, child in block.named_children():
            if "Attention" in type(child).__name__ or child_name in ATTENTION_NAMES:
                found.update({names[id(m)]: m for m in child.modules() if isinstance(m, nn.Linear)})
    return found


def _matches(name: str, target: str) -> bool:
    if any(ch in target for ch in "*?["):
        return fnmatch.fnmatchcase(name, target)
    return name == target or name.endswith("." + target)


def select_targets(model: nn.Module, targets: list[str]) -> dict[str, nn.Linear]:
    """The nn.Linear layers named by `targets` (a full name, a dotted suffix, a glob pattern, or `attention`: every
    linear layer of each decoder block's attention); every target must match. No targets: the model family's
    attention layers (DEFAULT_TARGETS)."""
    layers = linear_layers(model)
    arch = getattr(getattr(model, "cfg", None), "arch", "gpt2")
    targets = targets or DEFAULT_TARGETS.get(arch, [])
    chosen: dict[str, nn.Linear] = {}
    for target in targets:
        if target == ATTENTION_TARGET:
            hits = attention_layers(model)
        else:
            hits = {n: m for n, m in layers.items() if _matches(n, target)}
        if not hits:
            raise ConfigError(
                f"paradigm.targets: {target!r} matches no linear layer of this model; "
                f"available: {', '.join(_pattern_names(list(layers)))}"
            )
        chosen.update(hits)
    return chosen


def _owner(model: nn.Module, name: str, layer: nn.Linear) -> tuple[str, nn.Module, nn.Embedding | None]:
    """Where a target's adapter tensors live: on the layer, or (a tied output layer) on the embedding it shares its
    weight with, which the adapter then also acts on."""
    for other, mod in model.named_modules():
        if isinstance(mod, nn.Embedding) and mod.weight is layer.weight:
            return other, mod, mod
    return name, layer, None


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _check_rank(name: str, layer: nn.Linear, rank: int) -> None:
    limit = min(layer.in_features, layer.out_features)
    if rank > limit:
        raise ConfigError(
            f"paradigm.rank={rank} is larger than layer {name} ({layer.out_features} x {layer.in_features}) allows: "
            f"use at most {limit}"
        )


def _param(layer: nn.Linear, shape: tuple[int, ...], fill: Any, trainable: bool) -> nn.Parameter:
    weight = layer.weight
    data = torch.empty(shape, dtype=torch.float32, device=weight.device)
    if fill is None:
        data.zero_()
    else:
        data.copy_(fill)
    return nn.Parameter(data, requires_grad=trainable)


def add_lora(model: nn.Module, cfg: ParadigmConfig) -> list[str]:
    """y = W x + b + (alpha / rank) B A x on each target; A (rank x in) small random, B (out x rank) zero,
    so the adapted model starts as the base. Returns the names of the modules holding the adapters."""
    chosen = select_targets(model, cfg.targets)
    scale = cfg.alpha / cfg.rank
    owners = []
    for name, layer in chosen.items():
        _check_rank(name, layer, cfg.rank)
        owner_name, owner, embedding = _owner(model, name, layer)
        a = torch.randn(cfg.rank, layer.in_features, generator=_generator(cfg.seed, owner_name))
        owner.lora_a = _param(layer, (cfg.rank, layer.in_features), a / math.sqrt(layer.in_features), True)
        owner.lora_b = _param(layer, (layer.out_features, cfg.rank), None, True)

        def hook(
            mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor, s: float = scale, own: nn.Module = owner
        ) -> torch.Tensor:
            a, b = own.get_parameter("lora_a"), own.get_parameter("lora_b")
            return out + (args[0].to(a.dtype) @ a.t() @ b.t()).to(out.dtype) * s

        layer.register_forward_hook(hook)
        if embedding is not None:  # the lookup of row i of W + s B A: W[i] + s B[i] A

            def lookup(
                mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor, s: float = scale
            ) -> torch.Tensor:
                a, b = mod.get_parameter("lora_a"), mod.get_parameter("lora_b")
                return out + (F.embedding(args[0], b) @ a).to(out.dtype) * s

            embedding.register_forward_hook(lookup)
        owners.append(owner_name)
    return owners


def add_ravan(model: nn.Module, cfg: ParadigmConfig) -> list[str]:
    """y = W x + b + (alpha / rank) sum_i A_i H_i B_i x on each target: A_i (out x rank) and B_i (rank x in)
    frozen random, the heads H_i (rank x rank) trainable and zero at the start."""
    chosen = select_targets(model, cfg.targets)
    scale = cfg.alpha / cfg.rank
    owners = []
    for name, layer in chosen.items():
        _check_rank(name, layer, cfg.rank)
        owner_name, owner, embedding = _owner(model, name, layer)
        gen = _generator(cfg.seed, owner_name)
        for i in range(cfg.heads):
            a = torch.randn(layer.out_features, cfg.rank, generator=gen) / math.sqrt(cfg.rank)
            b = torch.randn(cfg.rank, layer.in_features, generator=gen) / math.sqrt(layer.in_features)
            setattr(owner, f"ravan_a{i}", _param(layer, a.shape, a, False))
            setattr(owner, f"ravan_b{i}", _param(layer, b.shape, b, False))
            setattr(owner, f"ravan_h{i}", _param(layer, (cfg.rank, cfg.rank), None, True))

        def factors(mod: nn.Module, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return tuple(mod.get_parameter(f"ravan_{part}{i}") for part in "ahb")  # type: ignore[return-value]

        def hook(
            mod: nn.Module,
            args: tuple[torch.Tensor, ...],
            out: torch.Tensor,
            s: float = scale,
            k: int = cfg.heads,
            own: nn.Module = owner,
        ) -> torch.Tensor:
            x = args[0].to(torch.float32)
            extra = sum(x @ b.t() @ h.t() @ a.t() for a, h, b in (factors(own, i) for i in range(k)))
            return out + extra.to(out.dtype) * s  # type: ignore[union-attr]

        layer.register_forward_hook(hook)
        if embedding is not None:  # the lookup of row i of W + s sum_j A_j H_j B_j

            def lookup(
                mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor, s: float = scale, k: int = cfg.heads
            ) -> torch.Tensor:
                extra = sum(F.embedding(args[0], a) @ h @ b for a, h, b in (factors(mod, i) for i in range(k)))
                return out + extra.to(out.dtype) * s  # type: ignore[union-attr]

            embedding.register_forward_hook(lookup)
        owners.append(owner_name)
    return owners
