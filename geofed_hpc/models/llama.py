"""A Llama 3 style causal decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU), written here (no hub)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from geofed_hpc.config import ModelConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.models.init import InitRule, init_in_place, standard_rules


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] for RoPE base rope_theta, with Llama 3 scaling when rope_scaling > 1,
    computed in float32 step by step as `transformers` does, so that long contexts agree to the last bit."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    if cfg.rope_scaling > 1.0:
        factor, low, high = cfg.rope_scaling, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old = cfg.rope_original_context
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE in the half-split layout (Hugging Face's rotate_half): x [b, h, t, d], cos/sin [t, d/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = rotate(self.q(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)
        k = rotate(self.k(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2), cos, sin)
        v = self.v(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if self.n_kv != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """x + attn(attn_norm(x)), then x + ffn(ffn_norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin))
        return x + self.drop(self.ffn(self.ffn_norm(x)))


class Llama(nn.Module):
    """Token embedding (wte), `cfg.n_layers` LlamaBlocks (self.blocks), final RMSNorm, LM head (tied or not)."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList([LlamaBlock(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)
        self.init_weights()

    def init_weights(self, seed: int = 0) -> None:
        """N(0, 0.02) weights, output projections scaled by 1/sqrt(2 * n_layers), unit norms, each tensor from its
        own generator seeded by (seed, name) (models/init.py); RoPE recomputed. Nothing to do on meta."""
        init_in_place(self, seed)
        if not self.inv_freq.is_meta:
            self.reset_buffers()

    def init_rules(self) -> dict[str, InitRule]:
        """How each parameter starts (models/init.py draws it)."""
        return standard_rules(self, (".attn.o.weight", ".ffn.down.weight"), self.cfg.n_layers)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the RoPE frequencies (after `to_empty`, which leaves buffers unset)."""
        self.inv_freq.copy_(rope_frequencies(self.cfg).to(self.inv_freq.device))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, T, vocab] and, given targets [B, T], the mean cross-entropy (targets of -1 are ignored)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be [batch, sequence] token ids, got shape {tuple(idx.shape)}")
        t = idx.size(1)
        if t > self.cfg.context:
            raise ConfigError(
                f"sequence length {t} exceeds model.context={self.cfg.context}; "
                "feed shorter windows or raise model.context"
            )
        angles = torch.outer(torch.arange(t, device=idx.device, dtype=torch.float32), self.inv_freq.float())
        cos, sin = angles.cos(), angles.sin()
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss
