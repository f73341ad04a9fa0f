"""The delta container: magic, version, a checksummed JSON header, then one checksummed section per tensor."""

# Layout (integers little-endian):
#   b"GFDC" | version u8 | header length u32 | header crc32 u32 | header JSON (utf-8)
#   then per tensor, in header order: section length u64 | section crc32 u32 | section body (see sections.py)
# Header: {"codec": "fp32"|"int8", "block_size": int, "tensors": [{"name", "shape", "dtype", "bytes"}]};
# `bytes` repeats each section's length.

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from geofed_hpc.codec.sections import decode_body, encode_body
from geofed_hpc.codec.zstdio import compressor
from geofed_hpc.config import CodecConfig
from geofed_hpc.errors import CodecError
from geofed_hpc.log import logger

MAGIC = b"GFDC"
VERSION = 1
CODECS = ("fp32", "int8")
_PREFIX = struct.Struct("<4sBII")
_SECTION = struct.Struct("<QI")
_ENTRY_KEYS = {"name", "shape", "dtype", "bytes"}
_MAX_NDIM = 32
_MAX_NUMEL = 1 << 40
_MAX_BLOCK = 1 << 31

Expected = Mapping[str, tuple[tuple[int, ...], str]]


@dataclass(frozen=True)
class _Entry:
    name: str
    shape: tuple[int, ...]
    nbytes: int


def _checked_array(name: object, value: object) -> np.ndarray:
    if not isinstance(name, str):
        raise CodecError(f"tensor names must be strings, got {name!r}")
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        raise CodecError(f"tensor {name!r}: expected a numpy array, got {type(value).__name__}")
    if value.dtype.kind != "f":
        raise CodecError(f"tensor {name!r}: dtype {value.dtype} is not a floating dtype (float32 expected)")
    return value


def encode(tensors: Mapping[str, np.ndarray], cfg: CodecConfig) -> bytes:
    """Compress float tensors (encoded as float32) in their given order with `cfg`; CodecError names a bad one."""
    if cfg.name not in CODECS:
        raise CodecError(f"codec.name: unknown codec {cfg.name!r}; expected one of {', '.join(CODECS)}")
    cctx = compressor(cfg.zstd_level)
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for name, value in tensors.items():
        arr = _checked_array(name, value)
        body = encode_body(name, arr, cfg.name, cfg.block_size, cctx)
        size, crc = 0, 0
        for chunk in body:
            size, crc = size + len(chunk), zlib.crc32(chunk, crc)
        chunks.append(_SECTION.pack(size, crc))
        chunks.extend(body)
        entries.append({"name": name, "shape": list(arr.shape), "dtype": "float32", "bytes": size})
    header = {"codec": cfg.name, "block_size": cfg.block_size, "tensors": entries}
    raw = json.dumps(header, separators=(",", ":")).encode()
    payload = b"".join([_PREFIX.pack(MAGIC, VERSION, len(raw), zlib.crc32(raw)), raw, *chunks])
    numel = sum(math.prod(e["shape"]) for e in entries)
    logger.debug("codec %s: %d tensors, %d values -> %d bytes", cfg.name, len(entries), numel, len(payload))
    return payload


def _read_header(payload: bytes) -> tuple[memoryview, dict[str, Any], int]:
    """The payload as bytes, its parsed (crc-checked) header, and where the first section starts."""
    try:
        mv = memoryview(payload).cast("B")
    except TypeError as exc:
        raise CodecError(f"payload: expected bytes, got {type(payload).__name__}") from exc
    if len(mv) < _PREFIX.size:
        raise CodecError(f"payload: {len(mv)} bytes is shorter than the {_PREFIX.size}-byte prefix (truncated)")
    magic, version, size, crc = _PREFIX.unpack_from(mv)
    if magic != MAGIC:
        raise CodecError(f"payload: bad magic {magic!r}, expected {MAGIC!r} (not a geofed delta)")
    if version != VERSION:
        raise CodecError(f"payload: format version {version} is not supported (this build reads {VERSION})")
    end = _PREFIX.size + size
    if end > len(mv):
        raise CodecError(f"header: truncated, needs {size} bytes but only {len(mv) - _PREFIX.size} follow")
    raw = mv[_PREFIX.size : end]
    if zlib.crc32(raw) != crc:
        raise CodecError(f"header: crc32 mismatch (stored {crc:#010x}, computed {zlib.crc32(raw):#010x}); corrupt")
    try:
        header = json.loads(bytes(raw))
    except (ValueError, RecursionError) as exc:
        raise CodecError(f"header: not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CodecError(f"header: expected a JSON object, got {type(header).__name__}")
    return mv, header, end


def _is_int(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _parse_entry(raw: object, index: int) -> _Entry:
    where = f"header: tensors[{index}]"
    if not isinstance(raw, dict) or set(raw) != _ENTRY_KEYS:
        raise CodecError(f"{where}: expected an object with keys {sorted(_ENTRY_KEYS)}, got {raw!r:.200}")
    name, shape = raw["name"], raw["shape"]
    if not isinstance(name, str):
        raise CodecError(f"{where}: name must be a string, got {name!r:.100}")
    where = f"header: tensor {name!r}"
    if not (isinstance(shape, list) and len(shape) <= _MAX_NDIM and all(_is_int(d, 0, _MAX_NUMEL) for d in shape)):
        raise CodecError(f"{where}: shape must be a list of at most {_MAX_NDIM} sizes >= 0, got {shape!r:.200}")
    if math.prod(shape) > _MAX_NUMEL:
        raise CodecError(f"{where}: shape {shape} has more than {_MAX_NUMEL} elements")
    if raw["dtype"] != "float32":
        raise CodecError(f"{where}: dtype must be 'float32', got {raw['dtype']!r:.100}")
    if not _is_int(raw["bytes"], 0, 1 << 62):
        raise CodecError(f"{where}: bytes must be an integer >= 0, got {raw['bytes']!r:.100}")
    return _Entry(name, tuple(shape), raw["bytes"])


def _parse_header(header: dict[str, Any]) -> tuple[str, int, list[_Entry]]:
    if set(header) != {"codec", "block_size", "tensors"}:
        raise CodecError(f"header: expected keys block_size, codec, tensors; got {', '.join(sorted(header))}")
    codec, block_size, tensors = header["codec"], header["block_size"], header["tensors"]
    if codec not in CODECS:
        raise CodecError(f"header: codec {codec!r:.100} is unknown; expected one of {', '.join(CODECS)}")
    if not _is_int(block_size, 1, _MAX_BLOCK):
        raise CodecError(f"header: block_size must be an integer in 1..{_MAX_BLOCK}, got {block_size!r:.100}")
    if not isinstance(tensors, list):
        raise CodecError(f"header: tensors must be a list, got {type(tensors).__name__}")
    entries = [_parse_entry(raw, i) for i, raw in enumerate(tensors)]
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise CodecError(f"header: tensor {e.name!r} appears more than once")
        seen.add(e.name)
    return codec, block_size, entries


def _check_expected(entries: list[_Entry], expected: Expected) -> None:
    got = {e.name: e for e in entries}
    missing = [n for n in expected if n not in got]
    extra = [n for n in got if n not in expected]
    mismatched = []
    for name, (shape, dtype) in expected.items():
        e = got.get(name)
        if e is not None and (e.shape != tuple(shape) or dtype != "float32"):
            mismatched.append(f"{name!r} is {list(e.shape)} float32, expected {list(shape)} {dtype}")
    problems = [
        f"{label}: {', '.join(items)}"
        for label, items in (
            ("missing", [repr(n) for n in missing]),
            ("extra", [repr(n) for n in extra]),
            ("mismatched", mismatched),
        )
        if items
    ]
    if problems:
        raise CodecError("payload does not hold the expected tensors; " + "; ".join(problems))


def _sections(mv: memoryview, start: int, entries: list[_Entry]) -> list[memoryview]:
    """Each tensor's section body, after checking its length against the header and its crc32."""
    bodies = []
    pos = start
    for e in entries:
        what = f"tensor {e.name!r}"
        if pos + _SECTION.size > len(mv):
            raise CodecError(f"{what}: payload truncated in the section prefix at byte {pos}")
        size, crc = _SECTION.unpack_from(mv, pos)
        pos += _SECTION.size
        if size != e.nbytes:
            raise CodecError(f"{what}: section length {size} disagrees with the header's {e.nbytes}")
        if pos + size > len(mv):
            raise CodecError(f"{what}: payload truncated, section needs {size} bytes but {len(mv) - pos} remain")
        body = mv[pos : pos + size]
        pos += size
        if zlib.crc32(body) != crc:
            raise CodecError(f"{what}: section fails its crc32 check (stored {crc:#010x}); corrupt payload")
        bodies.append(body)
    if pos != len(mv):
        raise CodecError(f"payload: {len(mv) - pos} trailing bytes after the last section")
    return bodies


def decode(payload: bytes, expected: Expected | None = None) -> dict[str, np.ndarray]:
    """Float32 tensors of `payload`, in encoded order; with `expected` (name -> (shape, dtype)) names must match.

    Every malformed input raises CodecError; shapes are checked against `expected` before anything is
    allocated, so pass it whenever the payload comes from an untrusted peer.
    """
    mv, header, start = _read_header(payload)
    codec, block_size, entries = _parse_header(header)
    if expected is not None:
        _check_expected(entries, expected)
    bodies = _sections(mv, start, entries)
    return {e.name: decode_body(b, e.name, e.shape, codec, block_size) for e, b in zip(entries, bodies, strict=True)}


def codec_name(payload: bytes) -> str:
    """The codec a payload was encoded with, read from its (checked) header alone."""
    _, header, _ = _read_header(payload)
    return _parse_header(header)[0]
