"""Per-block activation checkpointing (full or selective) and torch.compile, applied before FSDP2 shards."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from geofed_hpc.errors import ConfigError
from geofed_hpc.models.registry import decoder_blocks

AC_MODES = ("none", "full", "selective")
_aten = torch.ops.aten
# selective: the outputs of these ops are kept; everything else in a block (norms, activations, RoPE, softmax
# glue) is recomputed in the backward pass.
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective() -> Any:
    return create_selective_checkpoint_contexts(_keep_products)


def _blocks(model: nn.Module) -> list[nn.Module]:
    return decoder_blocks(model)


def checkpoint_blocks(model: nn.Module, mode: str) -> int:
    """Recompute each decoder block (`model.blocks`, a model=hf model's layers) in the backward pass: `full` keeps
    only the block's input, `selective` also its matrix products and attention. The blocks keep their parameter
    names. Returns blocks wrapped."""
    if mode not in AC_MODES:
        raise ConfigError(f"train.activation_checkpointing: must be one of {', '.join(AC_MODES)}; got {mode!r}")
    if mode == "none":
        return 0
    blocks = _blocks(model)
    for block in blocks:
        block.forward = _checkpointed(block.forward, mode)  # type: ignore[method-assign]
    return len(blocks)


def _checkpointed(forward: Callable[..., Any], mode: str) -> Callable[..., Any]:
    context = _selective if mode == "selective" else None

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if context is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)

    return run


def compile_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot build kernels for `device` here (no C++ compiler on CPU, no Triton on CUDA)."""
    if device.type == "cuda":
        return None if importlib.util.find_spec("triton") else "Triton is not installed (pip install triton)"
    names = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    if any(name and shutil.which(name) for name in names):
        return None
    return "inductor builds CPU kernels with a C++ compiler and none is on PATH (g++, clang++ or $CXX)"


def compile_blocks(model: nn.Module, device: torch.device) -> int:
    """torch.compile every block in place (the names of its parameters stay). Identical blocks share one compiled
    graph; the first step compiles it. ConfigError when this machine cannot compile."""
    problem = compile_problem(device)
    if problem:
        raise ConfigError(f"train.compile: {problem}; set train.compile=false")
    blocks = _blocks(model)
    for block in blocks:
        block.compile()
    return len(blocks)
