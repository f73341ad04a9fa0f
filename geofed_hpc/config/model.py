"""The model a federation trains: `model.*` (a decoder-only causal language model's shape)."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt

from geofed_hpc.config.fields import Duration, check
from geofed_hpc.config.section import section

Size = Annotated[StrictInt, Field(ge=1)]


@section("model.train")
class ModelTrain:
    """Run settings that fit the model (a cluster preset's cadence and length). conf/train/demo.yaml takes each one
    that is set instead of its own value; a `train.KEY=...` given on the command line still wins. Unset (null, as for
    model=tiny): the demo's value."""

    sync_interval: Duration | None = None
    """train.sync_interval for this model, e.g. 30m for a billion parameters on a few GPUs."""
    max_syncs: Annotated[StrictInt, Field(ge=0)] | None = None
    """train.max_syncs: the syncs the run is planned for (with sync_interval, its length)."""
    lr: Annotated[StrictFloat, Field(gt=0)] | None = None
    """train.lr: the AdamW learning rate that fits the model's size."""
    warmup_steps: Annotated[StrictInt, Field(ge=0)] | None = None
    """train.warmup_steps."""
    eval_interval: Duration | None = None
    """train.eval_interval: evaluations of the global model no more often than this."""


@section("model")
class ModelConfig:
    """A decoder-only causal language model's shape."""

    name: str = "tiny"
    """The shape's name (model=tiny, llama3_1b, ...)."""
    arch: Literal["gpt2", "llama"] = "gpt2"
    """gpt2: learned positions, LayerNorm, GELU; llama: RoPE, RMSNorm, SwiGLU, grouped-query attention."""
    vocab_size: Size = 50257
    """Tokens in the vocabulary."""
    context: Size = 64
    """Tokens per training sequence."""
    d_model: Size = 64
    """Width of the residual stream (a multiple of n_heads)."""
    n_layers: Size = 2
    """Transformer blocks."""
    n_heads: Size = 4
    """Attention heads per block."""
    d_ff: Size = 256
    """Hidden width of each block's MLP."""
    dropout: Annotated[StrictFloat, Field(ge=0, lt=1)] = 0.0
    """Dropout probability while training."""
    tie_embeddings: StrictBool = True
    """The output layer shares the token embedding's weights."""
    n_kv_heads: Annotated[StrictInt, Field(ge=0)] = 0
    """Llama: key/value heads of grouped-query attention, dividing n_heads (0: n_heads)."""
    rope_theta: Annotated[StrictFloat, Field(gt=0)] = 10000.0
    """Llama: the RoPE base."""
    rope_scaling: Annotated[StrictFloat, Field(ge=1)] = 1.0
    """Llama 3 RoPE frequency scaling factor (1: off)."""
    rope_original_context: Size = 8192
    """Llama 3 RoPE scaling: the context the model was pretrained at."""
    rope_low_freq_factor: Annotated[StrictFloat, Field(gt=0)] = 1.0
    """Llama 3 RoPE scaling: wavelengths above rope_original_context / this are divided by rope_scaling."""
    rope_high_freq_factor: Annotated[StrictFloat, Field(gt=0)] = 4.0
    """Llama 3 RoPE scaling: wavelengths below rope_original_context / this are kept; those between are blended."""
    max_positions: Annotated[StrictInt, Field(ge=0)] = 0
    """Llama: the longest sequence the model is meant for, as an export's config.json states it
    (max_position_embeddings; 0: model.context). GPT-2's is model.context, the rows of its position table."""
    norm_eps: Annotated[StrictFloat, Field(gt=0)] = 1e-5
    """Epsilon of the normalization layers."""
    init_from: str = ""
    """A local Hugging Face-format .safetensors file or folder to start from (fine-tuning; "": random init)."""
    tokenizer: str = "gpt2"
    """The tokenizer this model's vocabulary belongs to, used when data.tokenizer is empty: gpt2 (shipped), a
    tokenizer.json path, or "" when none is shipped (llama3_1b: give the Llama 3 tokenizer.json)."""
    train: ModelTrain = field(default_factory=ModelTrain)
    """Run settings that fit this model (model.train.sync_interval, ...), taken where train.* is not given."""

    def __post_init__(self) -> None:
        check(
            self.d_model % self.n_heads == 0,
            "model.d_model",
            f"must be divisible by model.n_heads ({self.d_model} % {self.n_heads} != 0)",
        )
        check(
            self.n_heads % self.kv_heads == 0,
            "model.n_kv_heads",
            f"must divide model.n_heads ({self.n_heads} % {self.kv_heads} != 0)",
        )
        check(self.arch == "llama" or self.kv_heads == self.n_heads, "model.n_kv_heads", "is for arch=llama only")
        check(self.arch != "llama" or self.head_dim % 2 == 0, "model.n_heads", "RoPE needs an even head size")
        gpt2_positions = self.arch == "llama" or self.max_positions in (0, self.context)
        check(gpt2_positions, "model.max_positions", "is for arch=llama (GPT-2's is model.context)")
        check(
            self.rope_high_freq_factor > self.rope_low_freq_factor,
            "model.rope_high_freq_factor",
            f"must be larger than model.rope_low_freq_factor ({self.rope_low_freq_factor:g})",
        )

    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_kv_heads, or n_heads when it is 0)."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.d_model // self.n_heads

    def param_count(self) -> int:
        """The parameters models/ builds for this shape (tied weights once), counted without torch (login nodes)."""
        d, ff, vocab = self.d_model, self.d_ff, self.vocab_size
        head = 0 if self.tie_embeddings else vocab * d
        if self.arch == "gpt2":  # LayerNorms, Linears with biases, learned positions
            block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * ff + ff) + (ff * d + d)
            return vocab * d + self.context * d + self.n_layers * block + 2 * d + head
        q, kv = self.n_heads * self.head_dim, self.kv_heads * self.head_dim
        block = d + d * q + 2 * d * kv + q * d + d + 3 * d * ff  # RMSNorms, attention, SwiGLU; no biases
        return vocab * d + self.n_layers * block + d + head
