"""Loading Hugging Face-format safetensors checkpoints (GPT-2 Conv1D layout, Llama names, sharded index)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from geofed_hpc.config import ModelConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.models import build_model

GPT = ModelConfig(name="g", vocab_size=128, context=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)
LLAMA = ModelConfig(
    name="l", arch="llama", vocab_size=128, context=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48
)


def hf_gpt2_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What `GPT2LMHeadModel.save_pretrained` writes: transformer.* names, Conv1D weights as [in, out]."""
    p = {n: t.detach().clone() for n, t in model.named_parameters()}
    out = {"transformer.wte.weight": p["wte.weight"], "transformer.wpe.weight": p["wpe.weight"]}
    for i in range(GPT.n_layers):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[h + theirs + ".weight"], out[h + theirs + ".bias"] = p[b + ours + ".weight"], p[b + ours + ".bias"]
        for ours, theirs in (
            ("attn.qkv", "attn.c_attn"),
            ("attn.proj", "attn.c_proj"),
            ("mlp.fc", "mlp.c_fc"),
            ("mlp.proj", "mlp.c_proj"),
        ):
            out[h + theirs + ".weight"] = p[b + ours + ".weight"].t().contiguous()
            out[h + theirs + ".bias"] = p[b + ours + ".bias"]
        out[h + "attn.bias"] = torch.tril(torch.ones(1, 1, 16, 16))  # the causal-mask buffer old exports carry
    out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = p["ln_f.weight"], p["ln_f.bias"]
    return out


def hf_llama_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM names; tied embeddings, so no lm_head.weight."""
    p = {n: t.detach().clone() for n, t in model.named_parameters()}
    out = {"model.embed_tokens.weight": p["wte.weight"], "model.norm.weight": p["norm.weight"]}
    for i in range(LLAMA.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        for x in "qkvo":
            out[f"{h}self_attn.{x}_proj.weight"] = p[f"{b}attn.{x}.weight"]
        for x in ("gate", "up", "down"):
            out[f"{h}mlp.{x}_proj.weight"] = p[f"{b}ffn.{x}.weight"]
        out[h + "input_layernorm.weight"] = p[b + "attn_norm.weight"]
        out[h + "post_attention_layernorm.weight"] = p[b + "ffn_norm.weight"]
    return out


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    assert sa.keys() == sb.keys()
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], rtol=0, atol=0, msg=name)
    x = torch.randint(0, a.cfg.vocab_size, (2, 16))
    torch.testing.assert_close(a.eval()(x)[0], b.eval()(x)[0], rtol=0, atol=0)


def test_gpt2_checkpoint_with_conv1d_layout(tmp_path: Path) -> None:
    source = build_model(GPT, seed=7)
    save_file(hf_gpt2_tensors(source), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 128}))
    loaded = build_model(ModelConfig(**{**GPT.__dict__, "init_from": str(tmp_path)}), seed=0)
    _same(source, loaded)


def test_sharded_llama_checkpoint_with_index(tmp_path: Path) -> None:
    source = build_model(LLAMA, seed=7)
    tensors = hf_llama_tensors(source)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = build_model(ModelConfig(**{**LLAMA.__dict__, "init_from": str(tmp_path)}), seed=0)
    _same(source, loaded)


def test_bf16_checkpoint_is_cast_to_the_model_dtype(tmp_path: Path) -> None:
    source = build_model(LLAMA, seed=1)
    file = tmp_path / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in hf_llama_tensors(source).items()}, str(file))
    loaded = build_model(ModelConfig(**{**LLAMA.__dict__, "init_from": str(file)}), seed=0)
    assert loaded.blocks[0].attn.q.weight.dtype == torch.float32
    torch.testing.assert_close(loaded.wte.weight, source.wte.weight.to(torch.bfloat16).float(), rtol=0, atol=0)


def _write(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> str:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    return str(tmp_path / "model.safetensors")


def test_bad_checkpoints_name_the_problem(tmp_path: Path) -> None:
    tensors = hf_llama_tensors(build_model(LLAMA, seed=1))

    def load(cfg: ModelConfig, t: dict[str, torch.Tensor], sub: str) -> None:
        (tmp_path / sub).mkdir()
        build_model(ModelConfig(**{**cfg.__dict__, "init_from": _write(tmp_path / sub, t)}), seed=0)

    with pytest.raises(ConfigError, match="set model.arch=llama"):
        load(GPT, tensors, "arch")
    bad = dict(tensors, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 32)})
    with pytest.raises(ConfigError, match=r"k_proj.weight.*shape \(32, 32\).*blocks.0.attn.k.weight"):
        load(LLAMA, bad, "shape")
    missing = {k: v for k, v in tensors.items() if "layers.1." not in k}
    with pytest.raises(ConfigError, match="lacks .* tensors"):
        load(LLAMA, missing, "missing")
    untied = dict(tensors, **{"lm_head.weight": torch.randn(128, 32)})
    with pytest.raises(ConfigError, match="model.tie_embeddings"):
        load(LLAMA, untied, "untied")
    with pytest.raises(ConfigError, match="does not exist"):
        build_model(ModelConfig(**{**LLAMA.__dict__, "init_from": str(tmp_path / "nowhere")}), seed=0)


def test_config_json_mismatch_names_our_field(tmp_path: Path) -> None:
    _write(tmp_path, hf_llama_tensors(build_model(LLAMA, seed=1)))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 32, "rope_theta": 500000.0}))
    with pytest.raises(ConfigError, match=r"model.rope_theta.*rope_theta=500000"):
        build_model(ModelConfig(**{**LLAMA.__dict__, "init_from": str(tmp_path)}), seed=0)
