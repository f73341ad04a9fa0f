"""The model a federation trains: `model.*` (a decoder-only causal language model's shape)."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt

from geofed_hpc.config.fields import Duration, check
from geofed_hpc.config.section import section
from geofed_hpc.errors import ConfigError

Size = Annotated[StrictInt, Field(ge=1)]
# model=hf: our shape fields and the config.json keys that give them, first found wins (the names transformers'
# configs use for the same thing differ by family).
HF_SHAPE_KEYS: dict[str, tuple[str, ...]] = {
    "d_model": ("hidden_size", "n_embd", "d_model"),
    "n_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "n_heads": ("num_attention_heads", "n_head", "num_heads"),
    "n_kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "d_ff": ("intermediate_size", "n_inner", "ffn_dim"),
    "max_positions": ("max_position_embeddings", "n_positions"),
}
HF_EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")


def read_hf_config(file: Path, field: str = "") -> dict[str, Any]:
    """A Hugging Face config.json as a dict; ConfigError (starting with `field`) when it is not one."""
    try:
        hf = json.loads(file.read_text())
    except ValueError as exc:
        raise ConfigError(f"{field}{file} is not valid JSON ({exc})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{field}{file} is not a Hugging Face config (not a JSON object)")
    return hf


def hf_folder_config(path: str) -> tuple[Path, dict[str, Any]]:
    """(the folder, its config.json) that model.path names; ConfigError saying what is missing."""
    if not path:
        raise ConfigError(
            "model.path: model=hf needs the folder of a Hugging Face model (its config.json, and its tokenizer and "
            "safetensors weights when it has them): model.path=DIR"
        )
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"model.path: {folder} is not a folder; give the folder of a Hugging Face model")
    file = folder / "config.json"
    if not file.is_file():
        raise ConfigError(
            f"model.path: {folder} has no config.json, so it is not a Hugging Face model folder (save_pretrained "
            "writes one; a download from the Hub has one)"
        )
    return folder, read_hf_config(file, "model.path: ")


def hf_weight_files(folder: Path) -> list[Path]:
    """The .safetensors files of a Hugging Face folder (the index's shards, else every one in it; [] for none)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"model.path: {index} is not a safetensors index ({exc})") from None
        return [folder / name for name in sorted(set(weight_map.values()))]
    return sorted(folder.glob("*.safetensors"))


def safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from a .safetensors file's header (read without torch)."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise ConfigError(f"model.path: {file} is not a readable safetensors file ({exc})") from None
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


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
    arch: Literal["gpt2", "llama", "hf"] = "gpt2"
    """gpt2: learned positions, LayerNorm, GELU; llama: RoPE, RMSNorm, SwiGLU, grouped-query attention (both written
    here); hf: any `transformers` causal language model, from the config.json in model.path (model=hf)."""
    path: str = ""
    """model=hf: a local folder of a Hugging Face model: its config.json (the architecture and shape: vocab_size,
    d_model, n_layers, n_heads, n_kv_heads, d_ff, tie_embeddings, max_positions and norm_eps are read from it, whatever
    is set here), its .safetensors weights when it has them (else a random init for train.seed), its tokenizer.json
    when it has one (the run's tokenizer unless data.tokenizer is given)."""
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
        if self.arch == "hf":
            self._read_hf_shape()
            return
        check(
            not self.path, "model.path", "is for model=hf (model.arch=hf); a native model starts from model.init_from"
        )
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

    def _read_hf_shape(self) -> None:
        """model=hf: the shape fields from model.path's config.json (a multimodal config's text_config when the
        vocabulary is there), and model.context within the model's positions."""
        folder, hf = hf_folder_config(self.path)
        where = folder / "config.json"
        text = hf.get("text_config")
        if "vocab_size" not in hf and isinstance(text, dict):
            hf = {**hf, **text}
        vocab = hf.get("vocab_size")
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ConfigError(
                f"model.path: {where} has no vocab_size (a positive integer); it is not a language model's"
            )
        self.vocab_size = vocab
        for ours, keys in HF_SHAPE_KEYS.items():
            value = next((hf[k] for k in keys if isinstance(hf.get(k), int) and not isinstance(hf[k], bool)), None)
            if value is not None and value >= (0 if ours in ("n_kv_heads", "max_positions") else 1):
                setattr(self, ours, value)
        if not any(isinstance(hf.get(k), int) for k in HF_SHAPE_KEYS["d_ff"]):
            self.d_ff = 4 * self.d_model
        eps = next((hf[k] for k in HF_EPS_KEYS if isinstance(hf.get(k), (int, float)) and hf[k] > 0), None)
        self.norm_eps = float(eps) if eps is not None else self.norm_eps
        self.tie_embeddings = bool(hf.get("tie_word_embeddings", True))
        check(
            not self.max_positions or self.context <= self.max_positions,
            "model.context",
            f"{self.context} is longer than the model's {self.max_positions} positions ({where}: "
            f"max_position_embeddings); train on shorter sequences, e.g. model.context={self.max_positions}",
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
        """The parameters models/ builds for this shape (tied weights once), counted without torch (login nodes).
        model=hf: the tensors of its weight files, or without them an estimate of a Llama-like model's count."""
        if self.arch == "hf":
            return self._hf_param_count()
        d, ff, vocab = self.d_model, self.d_ff, self.vocab_size
        head = 0 if self.tie_embeddings else vocab * d
        if self.arch == "gpt2":  # LayerNorms, Linears with biases, learned positions
            block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * ff + ff) + (ff * d + d)
            return vocab * d + self.context * d + self.n_layers * block + 2 * d + head
        q, kv = self.n_heads * self.head_dim, self.kv_heads * self.head_dim
        block = d + d * q + 2 * d * kv + q * d + d + 3 * d * ff  # RMSNorms, attention, SwiGLU; no biases
        return vocab * d + self.n_layers * block + d + head

    def _hf_param_count(self) -> int:
        folder = Path(self.path).expanduser()
        shapes: dict[str, tuple[int, ...]] = {}
        for file in hf_weight_files(folder):
            shapes.update(safetensors_shapes(file))
        if shapes:
            tied = self.tie_embeddings and "lm_head.weight" in shapes
            return sum(math.prod(s) for n, s in shapes.items() if not (tied and n == "lm_head.weight"))
        d, ff, vocab = self.d_model, self.d_ff, self.vocab_size
        kv = d * self.kv_heads // self.n_heads
        block = 2 * d + 2 * d * d + 2 * d * kv + 3 * d * ff  # norms, attention, a gated MLP; no biases
        return vocab * d + self.n_layers * block + d + (0 if self.tie_embeddings else vocab * d)
