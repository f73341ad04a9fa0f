"""How deltas are encoded on the wire: `codec.*`."""

from __future__ import annotations

from dataclasses import dataclass, field

from geofed_hpc.config.fields import check, one_of

# Codecs on the wire (geofed_hpc.codec implements each); "adaptive" lets each site pick one per push.
WIRE_CODECS = ("fp32", "bf16", "int16", "int8", "int4", "paper_int8")


@dataclass
class CodecConfig:
    """How deltas are compressed on the wire; the adaptive_* fields steer codec.name=adaptive on each site."""

    name: str = "int8"
    block_size: int = 1 << 16
    zstd_level: int = 1
    stochastic_rounding: bool = False
    # most accurate first: a site pushes with the first one whose predicted push time fits the budget
    adaptive_codecs: list[str] = field(default_factory=lambda: ["fp32", "int16", "bf16", "int8", "int4"])
    adaptive_fraction: float = 0.1  # budget: this share of the sync interval per push
    adaptive_ema: float = 0.3  # weight of the newest throughput measurement

    def __post_init__(self) -> None:
        one_of(self.name, (*WIRE_CODECS, "adaptive"), "codec.name")
        check(64 <= self.block_size <= 1 << 31, "codec.block_size", f"must be in 64..{1 << 31}, got {self.block_size}")
        check(1 <= self.zstd_level <= 22, "codec.zstd_level", f"must be in 1..22, got {self.zstd_level}")
        self.adaptive_codecs = list(self.adaptive_codecs)
        check(bool(self.adaptive_codecs), "codec.adaptive_codecs", "must name at least one codec")
        for name in self.adaptive_codecs:
            one_of(name, WIRE_CODECS, "codec.adaptive_codecs")
        check(len(set(self.adaptive_codecs)) == len(self.adaptive_codecs), "codec.adaptive_codecs", "has duplicates")
        check(
            0 < self.adaptive_fraction <= 1,
            "codec.adaptive_fraction",
            f"must be in (0, 1], got {self.adaptive_fraction}",
        )
        check(0 < self.adaptive_ema <= 1, "codec.adaptive_ema", f"must be in (0, 1], got {self.adaptive_ema}")
