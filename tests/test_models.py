"""The GPT-2 style causal LM: shapes, init, learning, determinism, weight tying, context limit."""

from __future__ import annotations

import math

import pytest
import torch

from geofed_hpc.config import ModelConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.models import GPT, Block, build_model, num_params

TINY = ModelConfig(name="test", vocab_size=256, context=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)


def _batch(cfg: ModelConfig, b: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, cfg.vocab_size, (b, cfg.context + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def test_forward_shapes_and_structure() -> None:
    model = build_model(TINY, seed=0)
    x, y = _batch(TINY)
    logits, loss = model(x, y)
    assert logits.shape == (4, TINY.context, TINY.vocab_size)
    assert loss is not None and loss.shape == () and torch.isfinite(loss)
    logits2, no_loss = model(x[:, :5])
    assert logits2.shape == (4, 5, TINY.vocab_size) and no_loss is None
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == TINY.n_layers
    assert all(isinstance(b, Block) for b in model.blocks)


def test_causal_prefix_logits_do_not_see_the_future() -> None:
    model = build_model(TINY, seed=1).eval()
    x, _ = _batch(TINY)
    changed = x.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, _ = model(x)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_initial_loss_near_uniform() -> None:
    model = build_model(TINY, seed=0)
    x, y = _batch(TINY, b=8)
    with torch.no_grad():
        _, loss = model(x, y)
    assert loss is not None
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.1


def test_init_statistics() -> None:
    cfg = ModelConfig(name="stats", vocab_size=512, context=16, d_model=128, n_layers=4, n_heads=4, d_ff=512)
    model = build_model(cfg, seed=0)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.08)
    assert torch.count_nonzero(model.blocks[0].attn.qkv.bias) == 0
    assert torch.equal(model.ln_f.weight, torch.ones(128))


def test_adam_steps_reduce_loss_on_fixed_batch() -> None:
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


def test_same_seed_same_params_and_global_rng_untouched() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = build_model(TINY, seed=5), build_model(TINY, seed=5), build_model(TINY, seed=6)
    assert torch.equal(torch.get_rng_state(), before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["wte.weight"], sc["wte.weight"])


def test_tied_weights_share_storage() -> None:
    tied = build_model(TINY, seed=0)
    assert tied.lm_head.weight is tied.wte.weight
    assert tied.lm_head.weight.data_ptr() == tied.wte.weight.data_ptr()
    untied = build_model(ModelConfig(**{**TINY.__dict__, "tie_embeddings": False}), seed=0)
    assert untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()
    assert num_params(untied) - num_params(tied) == TINY.vocab_size * TINY.d_model
    # A gradient step moves the shared matrix once, through both uses.
    x, y = _batch(TINY)
    _, loss = tied(x, y)
    assert loss is not None
    loss.backward()
    assert tied.wte.weight.grad is not None and tied.lm_head.weight.grad is tied.wte.weight.grad


def test_sequence_longer_than_context_errors() -> None:
    model = GPT(TINY)
    too_long = torch.zeros(1, TINY.context + 1, dtype=torch.long)
    with pytest.raises(ConfigError, match="model.context=16"):
        model(too_long)


def test_dropout_only_in_training() -> None:
    cfg = ModelConfig(**{**TINY.__dict__, "dropout": 0.5})
    model = build_model(cfg, seed=0)
    x, _ = _batch(cfg)
    with torch.no_grad():
        model.eval()
        assert torch.equal(model(x)[0], model(x)[0])
        model.train()
        assert not torch.equal(model(x)[0], model(x)[0])
