"""Typed, validated configuration sections (pydantic dataclasses) built from the composed Hydra tree."""

from geofed_hpc.config.codec import WIRE_CODECS, CodecConfig
from geofed_hpc.config.fields import parse_duration
from geofed_hpc.config.model import ModelConfig
from geofed_hpc.config.ps import PSConfig
from geofed_hpc.config.run import RunConfig
from geofed_hpc.config.section import from_dict, to_dict
from geofed_hpc.config.site import GPU_TYPES, SiteConfig
from geofed_hpc.config.train import PARADIGMS, DataConfig, ParadigmConfig, TrainConfig

__all__ = [
    "GPU_TYPES",
    "PARADIGMS",
    "WIRE_CODECS",
    "CodecConfig",
    "DataConfig",
    "ModelConfig",
    "PSConfig",
    "ParadigmConfig",
    "RunConfig",
    "SiteConfig",
    "TrainConfig",
    "from_dict",
    "parse_duration",
    "to_dict",
]
