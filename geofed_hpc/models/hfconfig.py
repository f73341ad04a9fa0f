"""Hugging Face config.json for our models: written for an export, read (both RoPE layouts) for model.init_from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from geofed_hpc.config import ModelConfig
from geofed_hpc.config.model import read_hf_config
from geofed_hpc.errors import ConfigError

# config.json keys -> ours, per architecture (RoPE is read apart: it comes in two layouts).
CONFIG_KEYS = {
    "gpt2": {"vocab_size": "vocab_size", "n_embd": "d_model", "n_layer": "n_layers", "n_head": "n_heads"},
    "llama": {
        "vocab_size": "vocab_size",
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "num_key_value_heads": "kv_heads",
        "intermediate_size": "d_ff",
        "rms_norm_eps": "norm_eps",
        "tie_word_embeddings": "tie_embeddings",
    },
}
# Our RoPE fields and where the two config.json layouts keep them (inside rope_parameters / rope_scaling).
ROPE_FIELDS = {
    "rope_theta": "rope_theta",
    "rope_scaling": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_context": "original_max_position_embeddings",
}
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# Our float fields that a config.json may write as an integer (rope_theta: 500000).
FLOAT_FIELDS = {"norm_eps", "rope_theta", "rope_scaling", "rope_low_freq_factor", "rope_high_freq_factor"}


def read_rope(hf: dict[str, Any], where: str) -> dict[str, tuple[str, Any]]:
    """Our RoPE fields from a Llama config.json, as {field: (what the file says, as `key=value`, value)}:
    transformers 5's `rope_parameters`, or the older top-level `rope_theta` with `rope_scaling`. Unscaled RoPE
    reads as factor 1."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        prefix, scaling, theta = "rope_parameters.", params, params.get("rope_theta")
    else:
        prefix, scaling, theta = "rope_scaling.", hf.get("rope_scaling") or {}, hf.get("rope_theta")
    out: dict[str, tuple[str, Any]] = {}
    if theta is not None:
        out["rope_theta"] = (f"{prefix if prefix == 'rope_parameters.' else ''}rope_theta={theta!r}", theta)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    if kind == "default":
        out["rope_scaling"] = (f"{prefix}rope_type='default' (no scaling)", 1.0)
    elif kind == "llama3":
        for ours, key in ROPE_FIELDS.items():
            if ours != "rope_theta" and key in scaling:
                out[ours] = (f"{prefix}{key}={scaling[key]!r}", scaling[key])
    else:
        raise ConfigError(
            f"model.init_from: {where} uses RoPE scaling {kind!r}, which this model does not implement "
            "(default, llama3)"
        )
    return out


def check_config(cfg: ModelConfig, hf: dict[str, Any], where: str) -> None:
    """Refuse a checkpoint whose config.json disagrees with `cfg`, naming our field and the file's key."""
    pairs = [(ours, f"{key}={hf[key]!r}", hf[key]) for key, ours in CONFIG_KEYS[cfg.arch].items() if key in hf]
    if cfg.arch == "llama":
        pairs += [(ours, said, value) for ours, (said, value) in read_rope(hf, where).items()]
    for ours, said, theirs in pairs:
        mine = getattr(cfg, ours)
        if isinstance(mine, float) and isinstance(theirs, (int, float)):
            same = abs(mine - float(theirs)) <= 1e-9 * abs(mine)
        else:
            same = mine == theirs
        if not same:
            field = "n_kv_heads" if ours == "kv_heads" else ours
            raise ConfigError(
                f"model.{field}: is {mine!r} but the checkpoint's {where} has {said}; "
                "use the model config that matches the checkpoint"
            )


def hf_config(cfg: ModelConfig, dtype: str, bos_id: int, eos_id: int) -> dict[str, Any]:
    """config.json for `transformers` (GPT2LMHeadModel or LlamaForCausalLM) describing `cfg`."""
    common = {
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "dtype": TORCH_DTYPES[dtype],
        "torch_dtype": TORCH_DTYPES[dtype],  # the key transformers 4 reads
        "use_cache": True,
    }
    if cfg.arch == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_positions": cfg.context,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.d_ff,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout,
            "scale_attn_weights": True,
            **common,
        }
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling > 1:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta}
        rope.update({key: getattr(cfg, ours) for ours, key in ROPE_FIELDS.items() if ours != "rope_theta"})
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions or cfg.context,
        "rms_norm_eps": cfg.norm_eps,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": cfg.dropout,
        "rope_parameters": rope,  # transformers 5's layout; the two below are the older one's
        "rope_theta": cfg.rope_theta,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_scaling > 1 else None,
        **common,
    }


def model_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Our model.* fields from the config.json of a GPT2LMHeadModel or LlamaForCausalLM (what hf_config writes, read
    back), for running an exported folder; ConfigError naming `where` for another model or a missing key."""
    arch = hf.get("model_type")
    if arch not in CONFIG_KEYS:
        raise ConfigError(f"{where}: model_type {arch!r} is not one of ours (gpt2, llama)")
    try:
        named = {key: "n_kv_heads" if ours == "kv_heads" else ours for key, ours in CONFIG_KEYS[arch].items()}
        fields: dict[str, Any] = {ours: hf[key] for key, ours in named.items() if key in hf}
        if arch == "gpt2":
            if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
                raise ConfigError(f"{where}: activation_function {hf['activation_function']!r} is not GPT-2's gelu_new")
            fields.update(
                context=hf["n_positions"],
                d_ff=hf.get("n_inner") or 4 * hf["n_embd"],
                norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                tie_embeddings=hf.get("tie_word_embeddings", True),
            )
        else:
            fields.update({ours: value for ours, (_, value) in read_rope(hf, where).items()})
            fields.update(context=hf["max_position_embeddings"], tie_embeddings=hf.get("tie_word_embeddings", False))
    except KeyError as exc:
        raise ConfigError(f"{where}: has no {exc.args[0]!r}, which a {arch} config.json holds") from None
    floats = {k: float(v) for k, v in fields.items() if k in FLOAT_FIELDS and isinstance(v, int)}
    return {**fields, **floats, "arch": arch, "dropout": 0.0, "init_from": "", "tokenizer": ""}


def checkpoint_files(path: Path) -> list[Path]:
    """The .safetensors files of a checkpoint: the file itself, the index's shards, or every file in the folder."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ConfigError(f"model.init_from: {path} is not a .safetensors file or a folder holding them")
        return [path]
    if not path.is_dir():
        raise ConfigError(f"model.init_from: {path} does not exist; give a .safetensors file or a folder")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"model.init_from: {index} is not a safetensors index ({exc})") from exc
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.init_from: no .safetensors files in {path}")
    return files


def check_folder_config(cfg: ModelConfig, folder: Path) -> None:
    """The config.json beside a checkpoint (when there is one) against `cfg`."""
    file = folder / "config.json"
    if not file.is_file():
        return
    check_config(cfg, read_hf_config(file, "model.init_from: "), str(file))
