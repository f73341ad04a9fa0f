"""Initial weights one tensor at a time, each from a generator seeded by (seed, name): the same values whatever
the order, the device's shards or the model's other tensors, so a sharded model can be initialised in place."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

STD = 0.02


@dataclass(frozen=True)
class InitRule:
    """How one parameter starts: N(0, std), all ones or all zeros."""

    kind: str  # normal | ones | zeros
    std: float = 0.0


def generator_for(seed: int, name: str, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator of its own for one named tensor (CUDA's generator on a GPU: fast, and the same on every rank)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def standard_rules(model: nn.Module, residual: tuple[str, ...], n_layers: int) -> dict[str, InitRule]:
    """GPT-2's scheme for every parameter (tied ones once, under their first name): N(0, 0.02) matrices and
    embeddings, residual output projections (names ending in `residual`) N(0, 0.02 / sqrt(2 n_layers)), zero
    biases, unit norm weights (and zero norm biases)."""
    names = {id(p): n for n, p in model.named_parameters()}
    rules: dict[str, InitRule] = {}
    resid = STD / math.sqrt(2 * n_layers)
    for prefix, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            name = names[id(param)]
            if name in rules:
                continue  # a tied weight, already ruled under its first name
            full = f"{prefix}.{leaf}" if prefix else leaf
            if isinstance(module, (nn.Linear, nn.Embedding)) and leaf == "weight":
                rules[name] = InitRule("normal", resid if full.endswith(residual) else STD)
            elif leaf == "bias":
                rules[name] = InitRule("zeros")
            elif leaf == "weight":  # LayerNorm, RMSNorm
                rules[name] = InitRule("ones")
    missing = sorted(set(names.values()) - set(rules))
    if missing:
        raise ValueError(f"no init rule for {missing[:5]}")
    return rules


def initial_tensor(
    rule: InitRule, shape: tuple[int, ...], seed: int, name: str, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The full float32 initial value of one parameter (on meta: its shape only, nothing drawn)."""
    if torch.device(device).type == "meta":
        return torch.empty(shape, device="meta")
    if rule.kind == "ones":
        return torch.ones(shape, device=device)
    if rule.kind == "zeros":
        return torch.zeros(shape, device=device)
    out = torch.empty(shape, device=device)
    return out.normal_(0.0, rule.std, generator=generator_for(seed, name, out.device))


def initial_tensors(
    model: nn.Module, seed: int, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full initial value) of every parameter of `model` (a GPT or Llama, maybe sharded or on meta), one
    at a time: peak memory is the largest parameter, not the model."""
    rules: dict[str, InitRule] = model.init_rules()  # type: ignore[operator]
    for name, param in model.named_parameters():
        yield name, initial_tensor(rules[name], tuple(param.shape), seed, name, device)


@torch.no_grad()
def init_in_place(model: nn.Module, seed: int) -> None:
    """Initialise an unsharded model's parameters where they are (nothing to do on meta)."""
    params = dict(model.named_parameters())
    if any(p.is_meta for p in params.values()):
        return
    device = next(iter(params.values())).device
    for name, value in initial_tensors(model, seed, device):
        params[name].copy_(value)
