"""How deltas are encoded on the wire: `codec.*`."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated

from pydantic import Field, StrictBool, StrictFloat, StrictInt

from geofed_hpc.config.fields import OneOrMany, check, choice
from geofed_hpc.config.section import section

# Codecs on the wire (geofed_hpc.codec implements each); "adaptive" lets each site pick one per push.
WIRE_CODECS = ("fp32", "bf16", "int16", "int8", "int4", "int2", "paper_int8", "sparse")
WireCodec = Annotated[str, choice(WIRE_CODECS)]
Share = Annotated[StrictFloat, Field(gt=0, le=1)]


@section("codec")
class CodecConfig:
    """How deltas are compressed on the wire; the adaptive_* fields steer codec.name=adaptive on each site."""

    name: Annotated[str, choice((*WIRE_CODECS, "adaptive"))] = "int8"
    """The codec of every push, or `adaptive`: each site picks one of adaptive_codecs per push."""
    block_size: Annotated[StrictInt, Field(ge=64, le=1 << 31)] = 1 << 16
    """Values per min-max block (one offset and scale each); at least the model size: one global min-max."""
    zstd_level: Annotated[StrictInt, Field(ge=1, le=22)] = 1
    """zstd compression level of the encoded bytes."""
    stochastic_rounding: StrictBool = False
    """floor(x / step + U[0,1)) instead of round-to-nearest: unbiased without error feedback."""
    adaptive_codecs: Annotated[list[WireCodec], OneOrMany, Field(min_length=1)] = field(
        default_factory=lambda: ["fp32", "int16", "bf16", "int8", "int4"]
    )
    """Most accurate first: a site pushes with the first one whose predicted push time fits the budget."""
    adaptive_fraction: Share = 0.1
    """The budget: this share of the sync interval per push."""
    adaptive_ema: Share = 0.3
    """The weight of the newest throughput measurement."""
    density: Annotated[StrictFloat, Field(gt=0, le=0.5)] = 1 / 64
    """sparse: the share of each chunk's values sent (its largest magnitudes); chunk x density must be whole."""
    chunk: Annotated[StrictInt, Field(ge=64, le=1 << 16)] = 4096
    """sparse: values per chunk (each keeps chunk x density values, with one magnitude range)."""
    value_bits: Annotated[StrictInt, Field(ge=1, le=4)] = 2
    """sparse: bits per kept value (a sign and value_bits - 1 bits of magnitude within the chunk's range)."""
    dense_below: Annotated[StrictInt, Field(ge=0, le=1 << 24)] = 1 << 16
    """sparse: tensors of fewer values go dense, with codec.dense_codec (0: every tensor sparse). Small tensors
    (norms, a small model's block matrices) cost little in bits and every token moves them: top-k would make most
    of their coordinates wait many syncs for their turn."""
    dense_codec: Annotated[str, choice(("int8", "int4", "int2"))] = "int4"
    """sparse: the min-max codec (codec.block_size blocks) of the tensors below codec.dense_below."""
    mean_row: StrictBool = True
    """sparse: a sparse matrix of at least 64 / density rows (an embedding, an output layer) also sends its mean
    row (float32, one value per column, added to every row), and top-k picks from what is left. AdamW moves every
    row of such a layer each step, along a shared direction: one row carries that common part exactly, where
    top-k would spend its budget on it."""

    def __post_init__(self) -> None:
        check(len(set(self.adaptive_codecs)) == len(self.adaptive_codecs), "codec.adaptive_codecs", "has duplicates")
        keep = self.chunk * self.density
        check(
            abs(keep - round(keep)) <= 1e-6 * keep and 1 <= round(keep) <= self.chunk // 2,
            "codec.density",
            f"codec.chunk x codec.density must be a whole number of values kept per chunk, 1 to chunk/2; "
            f"{self.chunk} x {self.density:g} = {keep:g} (e.g. density {max(1, round(keep)) / self.chunk:g})",
        )
