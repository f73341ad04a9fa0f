"""A model's initial tensors as a stream, one full tensor at a time: random (models/init.py) or a Hugging Face
checkpoint (read tensor by tensor from its safetensors files), for loading into shards without the whole model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from geofed_hpc.config import ModelConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.models.hf import _IGNORED, _RULES, _check_config, checkpoint_files, map_name
from geofed_hpc.models.init import initial_tensors


def hf_tensors(cfg: ModelConfig, path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(our parameter name, full tensor) for every tensor of the Hugging Face checkpoint at `path`, as stored
    (transposed where GPT-2's Conv1D needs it). A tied output layer is checked against the embedding, not yielded.
    ConfigError names the file and tensor of anything that does not fit `cfg` (as load_hf_checkpoint does)."""
    path = Path(path).expanduser()
    files = checkpoint_files(path)
    _check_config(cfg, path if path.is_dir() else path.parent)
    held: dict[str, tuple[torch.Tensor, Path]] = {}  # tied: the head and the embedding, until both were read
    checked = False
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
                mapped = map_name(cfg.arch, hf_name)
                if mapped is None:
                    if _IGNORED.fullmatch(hf_name):
                        continue
                    other = next((a for a in _RULES if a != cfg.arch and map_name(a, hf_name)), None)
                    hint = f"it looks like a {other} checkpoint: set model.arch={other}" if other else "unknown name"
                    raise ConfigError(
                        f"model.init_from: {file} holds {hf_name!r} which model.arch={cfg.arch} lacks ({hint})"
                    )
                name, transpose = mapped
                tensor = f.get_tensor(hf_name)
                tensor = tensor.t().contiguous() if transpose else tensor
                if cfg.tie_embeddings and name in ("lm_head.weight", "wte.weight") and not checked:
                    held[name] = (tensor, file)
                    if len(held) == 2:
                        _check_tied(held)
                        held, checked = {}, True
                if name != "lm_head.weight" or not cfg.tie_embeddings:
                    yield name, tensor


def _check_tied(held: dict[str, tuple[torch.Tensor, Path]]) -> None:
    (head, file), (wte, _) = held["lm_head.weight"], held["wte.weight"]
    if head.shape != wte.shape or not torch.equal(head.to(wte.dtype), wte):
        raise ConfigError(
            f"model.tie_embeddings: is true but {file} holds an lm_head.weight different from the token "
            "embedding; set model.tie_embeddings=false"
        )


def initial_stream(model: nn.Module, seed: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a fresh `model` starts from: `model.init_from`'s checkpoint, else its seeded random init."""
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    if cfg.init_from:
        return hf_tensors(cfg, cfg.init_from)
    return initial_tensors(model, seed, device)
