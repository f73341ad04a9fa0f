"""model.init_from reads both config.json RoPE layouts, refuses a mismatch naming the field, and RoPE frequencies are
computed as `transformers` computes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from geofed_hpc.cli import compose_config
from geofed_hpc.config import ModelConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.models import build_model
from geofed_hpc.models.export import write_model
from geofed_hpc.models.hfconfig import hf_config
from geofed_hpc.models.llama import rope_frequencies

LLAMA = ModelConfig(
    name="l", arch="llama", vocab_size=128, context=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
    rope_theta=500000.0, rope_scaling=32.0, rope_original_context=64, rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
)  # fmt: skip
ROPE = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("option", ["llama3_1b", "tiny_llama"])
def test_rope_frequencies_are_transformers_bit_for_bit(option: str) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = compose_config([f"model={option}"])[0].model
    written = hf_config(cfg, "fp32", 0, 1)
    hf = LlamaConfig(**{k: v for k, v in written.items() if k not in ("rope_theta", "rope_scaling")})
    theirs = LlamaRotaryEmbedding(hf).inv_freq  # what the model itself uses (on the CPU)
    assert (cfg.rope_scaling > 1) == (hf.rope_parameters["rope_type"] == "llama3")
    assert torch.equal(rope_frequencies(cfg), theirs)


def checkpoint(folder: Path, config: dict, cfg: ModelConfig = LLAMA) -> ModelConfig:
    """`cfg`'s weights as an export writes them, with `config` as its config.json; the config to load it with."""
    folder.mkdir()
    params = {k: v.detach().numpy() for k, v in build_model(cfg, seed=1).named_parameters()}
    write_model(folder, cfg, params, "fp32", 0, 1, "test")
    (folder / "config.json").write_text(json.dumps(config))
    return ModelConfig(**{**cfg.__dict__, "init_from": str(folder)})


def test_init_from_reads_both_rope_layouts(tmp_path: Path) -> None:
    new = hf_config(LLAMA, "fp32", 0, 1)
    new = {k: v for k, v in new.items() if k not in ("rope_theta", "rope_scaling")}  # as transformers 5 writes
    old = {k: v for k, v in hf_config(LLAMA, "fp32", 0, 1).items() if k != "rope_parameters"}  # transformers 4
    old["rope_scaling"] = {"rope_type": "llama3", **ROPE}
    x = torch.randint(0, 128, (1, 16))
    reference = build_model(LLAMA, seed=1).eval()(x)[0]
    for name, config in (("new", new), ("old", old)):
        loaded = build_model(checkpoint(tmp_path / name, config), seed=0).eval()
        assert torch.equal(loaded(x)[0], reference)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **ROPE, "low_freq_factor": 2.0}},
         r"model.rope_low_freq_factor: is 1.0 but .* has rope_parameters.low_freq_factor=2.0"),
        ({"rope_scaling": {"type": "llama3", **ROPE, "factor": 8.0}, "rope_theta": 500000.0},
         r"model.rope_scaling: is 32.0 but .* has rope_scaling.factor=8.0"),
        ({"rope_scaling": {"rope_type": "llama3", **ROPE, "original_max_position_embeddings": 8192}},
         r"model.rope_original_context: is 64 but .*original_max_position_embeddings=8192"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
         r"model.rope_scaling: is 32.0 but .* has rope_parameters.rope_type='default' \(no scaling\)"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0}},
         r"model.init_from: .* RoPE scaling 'yarn'"),
        ({"rope_theta": 10000.0}, r"model.rope_theta: is 500000.0 but .* has rope_theta=10000.0"),
    ],
)  # fmt: skip
def test_a_rope_mismatch_is_refused_naming_the_field(tmp_path: Path, change: dict, message: str) -> None:
    config = {k: v for k, v in hf_config(LLAMA, "fp32", 0, 1).items() if k not in ("rope_parameters", "rope_scaling")}
    config.pop("rope_theta")
    with pytest.raises(ConfigError, match=message):
        build_model(checkpoint(tmp_path / "c", {**config, **change}), seed=0)
