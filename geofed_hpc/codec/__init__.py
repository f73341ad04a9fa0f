"""Delta compression: min-max int16..int2, top-k sparse, bf16 or lossless fp32, zstd-coded, in checked frames."""

from geofed_hpc.codec.adaptive import LinkAdaptive
from geofed_hpc.codec.digest import model_digest
from geofed_hpc.codec.feedback import ErrorFeedback
from geofed_hpc.codec.inputs import TensorSource
from geofed_hpc.codec.sparse import SparseTensor
from geofed_hpc.codec.stream import (
    Piece,
    StreamDecoder,
    codec_name,
    decode,
    decode_sparse,
    decode_stream,
    encode,
    encode_frames,
)

__all__ = [
    "ErrorFeedback",
    "LinkAdaptive",
    "Piece",
    "SparseTensor",
    "StreamDecoder",
    "TensorSource",
    "codec_name",
    "decode",
    "decode_sparse",
    "decode_stream",
    "encode",
    "encode_frames",
    "model_digest",
]
