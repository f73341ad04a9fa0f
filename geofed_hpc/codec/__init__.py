"""Delta compression: per-block min-max int8 or lossless fp32, zstd-coded, in a checksummed container."""

from geofed_hpc.codec.container import codec_name, decode, encode

__all__ = ["codec_name", "decode", "encode"]
