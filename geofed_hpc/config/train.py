"""What a site trains and on what: `model.*`, `data.*`, `train.*`, `paradigm.*`."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from geofed_hpc.config.fields import check, one_of, parse_duration


@dataclass
class ModelConfig:
    """A decoder-only causal language model's shape."""

    name: str = "tiny"
    arch: str = "gpt2"
    vocab_size: int = 50257
    context: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    dropout: float = 0.0
    tie_embeddings: bool = True
    # Llama only: grouped-query attention (0 = n_heads), RoPE base and Llama 3 frequency scaling (1 = off).
    n_kv_heads: int = 0
    rope_theta: float = 10000.0
    rope_scaling: float = 1.0
    rope_original_context: int = 8192
    norm_eps: float = 1e-5
    # A local Hugging Face-format .safetensors file or folder to start from (fine-tuning); "" = random init.
    init_from: str = ""

    def __post_init__(self) -> None:
        one_of(self.arch, ("gpt2", "llama"), "model.arch")
        for key in ("vocab_size", "context", "d_model", "n_layers", "n_heads", "d_ff", "rope_original_context"):
            check(getattr(self, key) >= 1, f"model.{key}", f"must be at least 1, got {getattr(self, key)}")
        check(
            self.d_model % self.n_heads == 0,
            "model.d_model",
            f"must be divisible by model.n_heads ({self.d_model} % {self.n_heads} != 0)",
        )
        check(0.0 <= self.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {self.dropout}")
        check(self.n_kv_heads >= 0, "model.n_kv_heads", f"must be 0 (= n_heads) or positive, got {self.n_kv_heads}")
        check(
            self.n_heads % self.kv_heads == 0,
            "model.n_kv_heads",
            f"must divide model.n_heads ({self.n_heads} % {self.kv_heads} != 0)",
        )
        check(self.arch == "llama" or self.kv_heads == self.n_heads, "model.n_kv_heads", "is for arch=llama only")
        check(self.arch != "llama" or self.head_dim % 2 == 0, "model.n_heads", "RoPE needs an even head size")
        check(self.rope_theta > 0, "model.rope_theta", f"must be positive, got {self.rope_theta}")
        check(self.rope_scaling >= 1.0, "model.rope_scaling", f"must be 1 (off) or more, got {self.rope_scaling}")
        check(self.norm_eps > 0, "model.norm_eps", f"must be positive, got {self.norm_eps}")

    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_kv_heads, or n_heads when it is 0)."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.d_model // self.n_heads


@dataclass
class DataConfig:
    """Training text and tokenizer."""

    source: str = "bible"
    tokenizer: str = "gpt2"
    cache_dir: str = ""
    val_fraction: float = 0.02
    max_tokens: int = 0
    val_batches: int = 8
    val_batch_size: int = 0

    def __post_init__(self) -> None:
        one_of(self.tokenizer, ("gpt2",), "data.tokenizer")
        check(0.0 < self.val_fraction < 0.5, "data.val_fraction", f"must be in (0, 0.5), got {self.val_fraction}")
        check(self.max_tokens >= 0, "data.max_tokens", "must be 0 (all) or positive")
        check(self.val_batches >= 1, "data.val_batches", "must be at least 1")
        check(self.val_batch_size >= 0, "data.val_batch_size", "must be 0 (train.batch_size) or positive")
        if self.source != "bible":
            check(
                Path(self.source).exists(),
                "data.source",
                f"{self.source!r} is neither 'bible' nor an existing .txt/.jsonl file",
            )


@dataclass
class TrainConfig:
    """Local training and the sync cadence (Algorithm 1: H local steps or T seconds)."""

    lr: float = 3e-3
    # Linear lr warmup over a site's first optimizer steps (its lifetime count, which survives requeues):
    # step n trains at lr x n / warmup_steps. 0: the full lr from the first step.
    warmup_steps: int = 0
    weight_decay: float = 0.0
    batch_size: int = 8
    sync_interval: timedelta = timedelta(seconds=30)
    max_local_steps: int = 0
    max_syncs: int = 0
    seed: int = 0
    threads: int = 1
    eval_every: int = 0
    # Wall-clock time between evaluations of the pulled global model: a sync evaluates when at least this long
    # has passed since the last evaluation began (0s: after every sync).
    eval_interval: timedelta = timedelta(0)
    keep_best: int = 10
    # Emulated slower hardware: after each optimizer step, sleep (slowdown - 1) x that step's compute time.
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        self.sync_interval = parse_duration(self.sync_interval, "train.sync_interval")
        self.eval_interval = parse_duration(self.eval_interval, "train.eval_interval")
        check(
            self.eval_every >= 0,
            "train.eval_every",
            f"must be 0 (only at each sync) or positive, got {self.eval_every}",
        )
        check(self.keep_best >= 0, "train.keep_best", f"must be 0 (keep none) or positive, got {self.keep_best}")
        check(self.lr > 0, "train.lr", f"must be positive, got {self.lr}")
        check(self.warmup_steps >= 0, "train.warmup_steps", f"must be 0 (none) or positive, got {self.warmup_steps}")
        check(self.batch_size >= 1, "train.batch_size", "must be at least 1")
        check(
            self.sync_interval.total_seconds() > 0 or self.max_local_steps > 0,
            "train.sync_interval",
            "set a positive sync interval or train.max_local_steps",
        )
        check(self.max_local_steps >= 0, "train.max_local_steps", "must be 0 (no cap) or positive")
        check(self.max_syncs >= 0, "train.max_syncs", "must be 0 (until stopped) or positive")
        check(self.threads >= 1, "train.threads", "must be at least 1")
        check(
            1.0 <= self.slowdown <= 1000.0,
            "train.slowdown",
            f"must be in 1..1000 (1: full speed, 4: a quarter of this machine's speed), got {self.slowdown}",
        )


PARADIGMS = ("identity", "lora", "hybrid_lora", "ravan", "zo")


@dataclass
class ParadigmConfig:
    """The reparametrization phi(theta) that sites train and exchange (Algorithm 1): identity (pretraining),
    lora (FedIT), hybrid_lora (base exchanged, private adapters), ravan (shared frozen A, B; heads H
    exchanged), zo (zeroth-order: a seed from the PS, one scalar per step back)."""

    name: str = "identity"
    # lora / hybrid_lora / ravan: the nn.Linear layers to adapt, by name or dotted suffix (attn.qkv matches
    # blocks.0.attn.qkv, blocks.1.attn.qkv, ...)
    targets: list[str] = field(default_factory=lambda: ["attn.qkv", "attn.proj"])
    rank: int = 4
    alpha: float = 8.0
    heads: int = 4  # ravan: heads H_i per layer
    base_steps: int = 2  # hybrid_lora: steps on the base weights per round, then
    adapter_steps: int = 2  # ... steps on the private adapters
    seed: int = 0  # adapter init; zo: the PS's seed for the random directions
    zo_eps: float = 1e-3  # zo: perturbation size of the two forward passes
    zo_lr: float = 1e-4  # zo: step size along each direction

    def __post_init__(self) -> None:
        one_of(self.name, PARADIGMS, "paradigm.name")
        self.targets = [str(t) for t in self.targets]
        if self.name in ("lora", "hybrid_lora", "ravan"):
            check(bool(self.targets), "paradigm.targets", "name at least one layer (e.g. [attn.qkv])")
        check(self.rank >= 1, "paradigm.rank", f"must be at least 1, got {self.rank}")
        check(self.alpha > 0, "paradigm.alpha", f"must be positive, got {self.alpha}")
        check(self.heads >= 1, "paradigm.heads", f"must be at least 1, got {self.heads}")
        for key in ("base_steps", "adapter_steps"):
            check(getattr(self, key) >= 0, f"paradigm.{key}", f"must be 0 or more, got {getattr(self, key)}")
        check(self.base_steps + self.adapter_steps >= 1, "paradigm.base_steps", "base + adapter steps must be >= 1")
        check(self.zo_eps > 0, "paradigm.zo_eps", f"must be positive, got {self.zo_eps}")
        check(self.zo_lr > 0, "paradigm.zo_lr", f"must be positive, got {self.zo_lr}")

    def describe(self) -> str:
        """The paradigm and the settings every replica must share, as one line (compared at Join)."""
        targets = "+".join(self.targets)
        if self.name == "lora":
            return f"lora(rank={self.rank}, alpha={self.alpha:g}, targets={targets})"
        if self.name == "hybrid_lora":
            return f"hybrid_lora(rank={self.rank}, alpha={self.alpha:g}, targets={targets})"
        if self.name == "ravan":
            return f"ravan(heads={self.heads}, rank={self.rank}, alpha={self.alpha:g}, targets={targets})"
        if self.name == "zo":
            return f"zo(eps={self.zo_eps:g}, lr={self.zo_lr:g})"
        return "identity"
