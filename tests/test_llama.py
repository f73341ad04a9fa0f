"""Llama 3 model, the model registry and exact parameter counts of the published configurations."""

from __future__ import annotations

import math

import pytest
import torch

from geofed_hpc.cli import compose_config
from geofed_hpc.config import ModelConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.models import GPT, Llama, LlamaBlock, build_model, num_params
from geofed_hpc.models.llama import rope_frequencies, rotate

TINY = ModelConfig(
    name="t", arch="llama", vocab_size=256, context=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96
)


def _batch(cfg: ModelConfig, b: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, cfg.vocab_size, (b, cfg.context + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def test_published_parameter_counts_on_the_meta_device() -> None:
    # GPT-2 Medium, tied head, learned positions for context 1024. Hugging Face's gpt2-medium reports
    # num_parameters() == 354,823,168 (the "355M" of the model card). By hand:
    #   wte 50257*1024 = 51,463,168; wpe 1024*1024 = 1,048,576; ln_f 2*1024 = 2,048
    #   per block: ln 2*2*1024 = 4,096; qkv 1024*3072+3072 = 3,148,800; attn proj 1024*1024+1024 = 1,049,600;
    #              fc 1024*4096+4096 = 4,198,400; mlp proj 4096*1024+1024 = 4,195,328 -> 12,596,224; x24 = 302,309,376
    #   total 51,463,168 + 1,048,576 + 302,309,376 + 2,048 = 354,823,168
    gpt2_medium, _ = compose_config(["model=gpt2_medium"])
    # Llama 3.2 1B (meta-llama/Llama-3.2-1B, tied embeddings) is 1,235,814,400 parameters. By hand:
    #   embed 128256*2048 = 262,668,288; final norm 2,048
    #   per layer: q 2048*2048 + k 2048*512 + v 2048*512 + o 2048*2048 = 10,485,760;
    #              gate/up/down 3*2048*8192 = 50,331,648; 2 norms 4,096 -> 60,821,504; x16 = 973,144,064
    #   total 262,668,288 + 973,144,064 + 2,048 = 1,235,814,400
    llama3_1b, _ = compose_config(["model=llama3_1b"])
    g = build_model(gpt2_medium.model, seed=0, device="meta")
    m = build_model(llama3_1b.model, seed=0, device="meta")
    assert isinstance(g, GPT) and isinstance(m, Llama)
    assert num_params(g) == 354_823_168
    assert num_params(m) == 1_235_814_400
    assert all(p.device.type == "meta" for p in m.parameters())
    assert llama3_1b.model.kv_heads == 8 and llama3_1b.model.rope_theta == 500000.0


@pytest.mark.parametrize(("option", "cls"), [("tiny", GPT), ("tiny_llama", Llama)])
def test_registry_builds_the_class_the_config_names(option: str, cls: type) -> None:
    cfg, _ = compose_config([f"model={option}"])
    model = build_model(cfg.model, seed=0)
    assert type(model) is cls
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == cfg.model.n_layers
    x, y = _batch(cfg.model, b=2)
    _, loss = model(x, y)
    assert loss is not None and abs(loss.item() - math.log(cfg.model.vocab_size)) < 0.2


def test_forward_shapes_structure_and_gqa_sizes() -> None:
    model = build_model(TINY, seed=0)
    assert all(isinstance(b, LlamaBlock) for b in model.blocks)
    attn = model.blocks[0].attn
    assert attn.q.weight.shape == (32, 32) and attn.k.weight.shape == (16, 32) and attn.v.weight.shape == (16, 32)
    assert all(p.ndim == 1 for n, p in model.named_parameters() if "norm" in n)
    assert not any(n.endswith("bias") for n, _ in model.named_parameters())
    x, y = _batch(TINY)
    logits, loss = model(x, y)
    assert logits.shape == (4, 16, 256) and loss is not None and torch.isfinite(loss)


def test_causal_and_deterministic() -> None:
    a, b = build_model(TINY, seed=3).eval(), build_model(TINY, seed=3).eval()
    x, _ = _batch(TINY)
    changed = x.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % TINY.vocab_size
    with torch.no_grad():
        la, lb, lc = a(x)[0], b(x)[0], a(changed)[0]
    assert torch.equal(la, lb)
    torch.testing.assert_close(la[:, :9], lc[:, :9])
    assert not torch.allclose(la[:, 9:], lc[:, 9:])


def test_rope_scores_depend_only_on_relative_position() -> None:
    inv = rope_frequencies(TINY)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(i: int, j: int) -> float:
        ang_i, ang_j = i * inv, j * inv
        return float((rotate(q, ang_i.cos(), ang_i.sin()) * rotate(k, ang_j.cos(), ang_j.sin())).sum())

    assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)


def test_llama3_frequency_scaling() -> None:
    base = ModelConfig(**{**TINY.__dict__, "d_model": 256, "n_heads": 2, "n_kv_heads": 1, "rope_theta": 500000.0})
    scaled = ModelConfig(**{**base.__dict__, "rope_scaling": 32.0})
    plain, inv = rope_frequencies(base), rope_frequencies(scaled)
    wavelen = 2 * math.pi / plain
    high = wavelen < 8192 / 4  # short wavelengths are kept
    low = wavelen > 8192  # long wavelengths are divided by the factor
    assert high.any() and low.any()
    torch.testing.assert_close(inv[high], plain[high])
    torch.testing.assert_close(inv[low], plain[low] / 32)
    mid = ~high & ~low
    assert torch.all(inv[mid] < plain[mid]) and torch.all(inv[mid] > plain[mid] / 32)


def test_tied_and_untied_embeddings() -> None:
    tied = build_model(TINY, seed=0)
    untied = build_model(ModelConfig(**{**TINY.__dict__, "tie_embeddings": False}), seed=0)
    assert tied.lm_head.weight is tied.wte.weight
    assert num_params(untied) - num_params(tied) == TINY.vocab_size * TINY.d_model


def test_adam_steps_reduce_loss() -> None:
    model = build_model(TINY, seed=0)
    x, y = _batch(TINY)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        _, loss = model(x, y)
        assert loss is not None
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"n_kv_heads": 3}, "model.n_kv_heads"),
        ({"rope_theta": 0.0}, "model.rope_theta"),
        ({"norm_eps": 0.0}, "model.norm_eps"),
        ({"rope_scaling": 0.5}, "model.rope_scaling"),
        ({"arch": "gpt2"}, "model.n_kv_heads"),
        ({"arch": "mamba"}, "model.arch"),
    ],
)
def test_bad_llama_config_names_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{**TINY.__dict__, **changes})


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_uninitialised_build_for_loading_keeps_ties_and_buffers(arch: str) -> None:
    cfg = ModelConfig(**{**TINY.__dict__, "arch": arch, "n_kv_heads": 0 if arch == "gpt2" else 2})
    ref, empty = build_model(cfg, seed=0), build_model(cfg, seed=0, init=False)
    assert empty.lm_head.weight is empty.wte.weight and num_params(empty) == num_params(ref)
    empty.load_state_dict(ref.state_dict())
    x, _ = _batch(cfg)
    with torch.no_grad():
        torch.testing.assert_close(empty(x)[0], ref(x)[0], rtol=0, atol=0)
