"""Our models' weights as Hugging Face files: safetensors (sharded above 5 GB), config.json, generation_config.json."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from geofed_hpc.config import ModelConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.models.hf import map_name
from geofed_hpc.models.hfconfig import TORCH_DTYPES, hf_config

MAX_SHARD_BYTES = 5 * 10**9  # transformers' default: larger weights go into several files and an index
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def hf_names(cfg: ModelConfig) -> list[str]:
    """Every tensor name `transformers` expects for `cfg` (GPT2LMHeadModel or LlamaForCausalLM), in file order."""
    head = [] if cfg.tie_embeddings else ["lm_head.weight"]
    if cfg.arch == "gpt2":
        layer = ["ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"]
        blocks = [f"transformer.h.{i}.{m}.{p}" for i in range(cfg.n_layers) for m in layer for p in ("weight", "bias")]
        ends = ["transformer.ln_f.weight", "transformer.ln_f.bias"]
        return ["transformer.wte.weight", "transformer.wpe.weight", *blocks, *ends, *head]
    layer = [f"self_attn.{x}_proj" for x in "qkvo"] + [f"mlp.{x}_proj" for x in ("gate", "up", "down")]
    layer += ["input_layernorm", "post_attention_layernorm"]
    blocks = [f"model.layers.{i}.{m}.weight" for i in range(cfg.n_layers) for m in layer]
    return ["model.embed_tokens.weight", *blocks, "model.norm.weight", *head]


def _family(params: Mapping[str, np.ndarray]) -> str:
    if "wpe.weight" in params:
        return "gpt2"
    return "llama" if any(k.endswith(".attn.q.weight") for k in params) else "unknown"


def hf_tensors(cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: str, source: str) -> dict[str, torch.Tensor]:
    """Our parameters (plain model names, adapters merged) under the Hugging Face names, in `dtype`; a model of
    another family or shape than `cfg` is refused naming `source`."""
    family = _family(params)
    if family != cfg.arch:
        raise ConfigError(
            f"{source}: holds a {family} model but model.arch is {cfg.arch}; export it with that run's model "
            "(e.g. model=tiny_llama)"
        )
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name in hf_names(cfg):
        mapped = map_name(cfg.arch, name)
        assert mapped is not None, name
        ours, transpose = mapped
        if ours not in params:
            raise ConfigError(f"{source}: has no tensor {ours!r}, which model={cfg.name} needs; check model=")
        tensor = torch.from_numpy(np.ascontiguousarray(params[ours]))
        tensor = (tensor.t() if transpose else tensor).to(DTYPES[dtype]).contiguous()
        expected = _shape(cfg, ours)
        if expected is not None and tuple(params[ours].shape) != expected:
            raise ConfigError(
                f"{source}: tensor {ours!r} has shape {tuple(params[ours].shape)} but model={cfg.name} needs "
                f"{expected}; export with the model config of that run"
            )
        out[name] = tensor
        used.add(ours)
    extra = sorted(set(params) - used - {"lm_head.weight"})
    if extra:
        raise ConfigError(f"{source}: holds tensors model={cfg.name} lacks, e.g. {extra[:3]}; check model=")
    return out


def _shape(cfg: ModelConfig, ours: str) -> tuple[int, ...] | None:
    """The shape `cfg` gives the embeddings (the tensors whose size a wrong model config changes first)."""
    if ours == "wte.weight":
        return (cfg.vocab_size, cfg.d_model)
    if ours == "wpe.weight":
        return (cfg.context, cfg.d_model)
    return None


def file_mode() -> int:
    """The permission bits a new file gets here: 0666 less the umask (what open() gives config.json)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file, with the umask's mode like the files beside it (safetensors writes its files 0600)."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, file_mode())


def write_weights(tensors: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors and model.safetensors.index.json above the limit."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        _save(shards[0], folder / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save(shard, folder / file)
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_model(
    folder: Path,
    cfg: ModelConfig,
    params: Mapping[str, np.ndarray],
    dtype: str,
    bos_id: int,
    eos_id: int,
    source: str,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """The weights, config.json and generation_config.json of a `transformers` model equal to ours. Generation stops
    at the model's context (max_length: `transformers`' text-generation pipeline otherwise asks for 256 new tokens,
    past the positions a small model has). model=hf: its own architecture, written by transformers' save_pretrained
    (config.json as in model.path, bos and eos ids as there)."""
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"--dtype: must be one of {', '.join(TORCH_DTYPES)}; got {dtype!r}")
    if cfg.arch == "hf":
        write_hf_model(folder, cfg, params, DTYPES[dtype], source)
        return
    write_weights(hf_tensors(cfg, params, dtype, source), folder, max_shard_bytes)
    config = hf_config(cfg, dtype, bos_id, eos_id)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    max_length = cfg.max_positions or cfg.context  # config.json's n_positions / max_position_embeddings
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False, "max_length": max_length}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def write_hf_model(
    folder: Path, cfg: ModelConfig, params: Mapping[str, np.ndarray], dtype: torch.dtype, source: str
) -> None:
    """The model of model.path's architecture with `params` (plain names, adapters merged), saved by transformers'
    own save_pretrained (config.json, safetensors, generation_config.json): loadable unchanged by transformers."""
    from geofed_hpc.models.hfmodel import build_hf_meta, fill, materialize_hf, plain_class

    model = materialize_hf(build_hf_meta(cfg), "cpu")
    fill(model, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in params.items()}, source)
    model.__class__ = plain_class(model)
    plain: Any = model.to(dtype)
    plain.save_pretrained(str(folder))
    mode = file_mode()
    for file in folder.iterdir():
        if file.is_file():
            os.chmod(file, mode)
