"""A model's initial tensors as a stream, one full tensor at a time: random (models/init.py) or a Hugging Face
checkpoint (read tensor by tensor from its safetensors files), for loading into shards without the whole model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from geofed_hpc.config import ModelConfig
from geofed_hpc.models.hf import read_hf_tensors
from geofed_hpc.models.init import initial_tensors


def hf_tensors(cfg: ModelConfig, path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(our parameter name, full tensor) of the Hugging Face checkpoint at `path`, one at a time."""
    return ((name, tensor) for name, tensor, _ in read_hf_tensors(cfg, path))


def initial_stream(model: nn.Module, seed: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a fresh `model` starts from: `model.init_from`'s checkpoint, else its seeded random init."""
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    if cfg.arch == "hf":  # its folder's weights, else transformers' own init for the seed
        from geofed_hpc.models.hfmodel import hf_initial_tensors

        return hf_initial_tensors(model, seed, device)
    if cfg.init_from:
        return hf_tensors(cfg, cfg.init_from)
    return initial_tensors(model, seed, device)
