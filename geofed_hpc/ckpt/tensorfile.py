"""A self-describing, pickle-free tensor file (.gft): JSON header, raw little-endian arrays, sha256 trailer."""

from __future__ import annotations

import hashlib
import io
import json
import math
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from geofed_hpc.ckpt.atomic import atomic_write_bytes
from geofed_hpc.errors import CheckpointError

# Layout (all integers little-endian):
#   MAGIC (8) | header length H (u64) | header: UTF-8 JSON, space-padded so the data starts 64-byte aligned (H)
#   | data: each tensor's raw bytes at header["tensors"][i]["offset"], 64-byte aligned, zero padding (D)
#   | digest (32) | END_MAGIC (8)
# Format 1: digest = sha256 over every byte before it. Format 2: the bytes before it are cut into blocks of
# header["hash_block"] bytes; digest = sha256 over the concatenated sha256 of each block, so a reader checks
# the blocks on several cores while it copies the tensors out (a 5 GB checkpoint is not one long hash).
MAGIC = b"GEOFEDT\x01"
END_MAGIC = b"GFTEND\x00\x01"
FORMAT_NAME = "geofed-tensors"
FORMAT_VERSION = 2
HASH_BLOCK = 32 << 20
_HASH_BLOCK_RANGE = (1 << 12, 1 << 34)
VERIFY_THREADS = 4
SUFFIX = ".gft"
ALIGN = 64
_PREFIX = struct.Struct("<8sQ")
_TRAILER_LEN = 32 + len(END_MAGIC)
_MIN_SIZE = _PREFIX.size + _TRAILER_LEN
_CHUNK = 16 << 20

SUPPORTED_DTYPES: tuple[str, ...] = (
    "float64",
    "float32",
    "float16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
)

_ADVICE = (
    "it was probably cut short by a crash or damaged in a copy: delete it (an older checkpoint is then used) "
    "or restore it from another copy"
)


def _bad(path: Path, what: str, advice: str = _ADVICE) -> CheckpointError:
    return CheckpointError(f"checkpoint file {path} {what}; {advice}")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _le_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(name).newbyteorder("<")


class _Digest:
    """The trailer's digest of the bytes fed to it: format 1 one sha256, format 2 a sha256 per block."""

    def __init__(self, version: int) -> None:
        self.version, self.block = version, HASH_BLOCK
        self._whole = hashlib.sha256()
        self._blocks: list[bytes] = []
        self._current, self._filled = hashlib.sha256(), 0

    def update(self, data: bytes | memoryview) -> None:
        if self.version == 1:
            self._whole.update(data)
            return
        view, pos = memoryview(data), 0
        while pos < len(view):
            take = min(self.block - self._filled, len(view) - pos)
            self._current.update(view[pos : pos + take])
            self._filled += take
            pos += take
            if self._filled == self.block:
                self._blocks.append(self._current.digest())
                self._current, self._filled = hashlib.sha256(), 0

    def digest(self) -> bytes:
        if self.version == 1:
            return self._whole.digest()
        tail = [self._current.digest()] if self._filled else []
        return hashlib.sha256(b"".join(self._blocks + tail)).digest()


def _plan(
    path: Path, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any], version: int = FORMAT_VERSION
) -> tuple[bytes, list[Any], int]:
    """Validate inputs and lay out the file: (prefix + padded header, arrays in order, data length)."""
    entries: list[dict[str, Any]] = []
    arrays: list[Any] = []
    offset = 0
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str; got {name!r} ({type(name).__name__}) for {path}")
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        dtype_name = arr.dtype.name
        if dtype_name not in SUPPORTED_DTYPES:
            raise TypeError(
                f"tensor {name!r} has dtype {arr.dtype} which a .gft file cannot hold; "
                f"convert it to one of {', '.join(SUPPORTED_DTYPES)}"
            )
        offset = _align(offset)
        nbytes = int(arr.size) * arr.dtype.itemsize
        entries.append(
            {
                "name": name,
                "dtype": dtype_name,
                "shape": [int(d) for d in arr.shape],
                "offset": offset,
                "nbytes": nbytes,
            }
        )
        arrays.append(arr)
        offset += nbytes
    data_nbytes = _align(offset)
    header: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": version,
        "data_nbytes": data_nbytes,
        "tensors": entries,
        "meta": dict(meta),
    }
    if version >= 2:
        header["hash_block"] = HASH_BLOCK
    try:
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"meta for {path} must be JSON-serialisable (str keys; str/int/float/bool/None/list/dict): {e}"
        ) from e
    padded = len(raw) + (-(_PREFIX.size + len(raw)) % ALIGN)
    raw += b" " * (padded - len(raw))
    return _PREFIX.pack(MAGIC, len(raw)) + raw, arrays, data_nbytes


def _stream(prefix: bytes, arrays: list[Any], data_nbytes: int, version: int) -> Iterator[bytes | memoryview]:
    """Yield the file's bytes chunk by chunk (one contiguous copy of one tensor at most) and the trailer."""
    digest = _Digest(version)
    digest.update(prefix)
    yield prefix
    pos = 0
    for arr in arrays:
        start = _align(pos)
        if start > pos:
            pad = bytes(start - pos)
            digest.update(pad)
            yield pad
        flat = np.ascontiguousarray(arr).astype(_le_dtype(arr.dtype.name), copy=False).reshape(-1)
        view = flat.view(np.uint8).data
        for i in range(0, len(view), _CHUNK):
            piece = view[i : i + _CHUNK]
            digest.update(piece)
            yield piece
        pos = start + len(view)
    if data_nbytes > pos:
        pad = bytes(data_nbytes - pos)
        digest.update(pad)
        yield pad
    yield digest.digest() + END_MAGIC


def save_tensors(
    path: Path, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any], version: int = FORMAT_VERSION
) -> None:
    """Write `tensors` and JSON-able `meta` to `path` atomically, streaming the arrays (no pickle). `version` 1
    writes the older format (one sequential sha256), which every reader since the first one loads."""
    if version not in (1, FORMAT_VERSION):
        raise ValueError(f"tensor-file format version must be 1 or {FORMAT_VERSION}, got {version!r}")
    path = Path(path)
    prefix, arrays, data_nbytes = _plan(path, tensors, meta, version)
    atomic_write_bytes(path, _stream(prefix, arrays, data_nbytes, version))


def _read_exact(f: io.BufferedReader, path: Path, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise _bad(path, f"is truncated: it ended {n - len(data)} bytes early")
    return data


def _read_into(f: io.BufferedReader, path: Path, view: memoryview, digest: Any) -> None:
    done = 0
    while done < len(view):
        got = f.readinto(view[done : done + _CHUNK])
        if not got:
            raise _bad(path, f"is truncated: it ended {len(view) - done} bytes early")
        digest.update(view[done : done + got])
        done += got


def _is_int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_header(path: Path, raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(path, f"has a corrupt header (not valid JSON: {e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise _bad(path, "has a corrupt header (no 'format': 'geofed-tensors' entry)")
    version = header.get("version")
    if not _is_int(version) or version < 1:
        raise _bad(path, f"has a corrupt header (format version {version!r})")
    if version > FORMAT_VERSION:
        raise _bad(
            path,
            f"uses tensor-file format version {version}, newer than this geofed-hpc reads ({FORMAT_VERSION})",
            "upgrade geofed-hpc to load it",
        )
    data_nbytes = header.get("data_nbytes")
    entries = header.get("tensors")
    if not _is_int(data_nbytes) or data_nbytes < 0 or not isinstance(entries, list):
        raise _bad(path, "has a corrupt header ('data_nbytes' or 'tensors' missing or malformed)")
    if not isinstance(header.get("meta"), dict):
        raise _bad(path, "has a corrupt header ('meta' missing or not an object)")
    if version >= 2:
        block = header.get("hash_block")
        if not _is_int(block) or not _HASH_BLOCK_RANGE[0] <= block <= _HASH_BLOCK_RANGE[1]:
            raise _bad(path, f"has a corrupt header (hash block size {block!r})")
    end = 0
    names: set[str] = set()
    for i, ent in enumerate(entries):
        ok = (
            isinstance(ent, dict)
            and isinstance(ent.get("name"), str)
            and ent.get("dtype") in SUPPORTED_DTYPES
            and isinstance(ent.get("shape"), list)
            and all(_is_int(d) and d >= 0 for d in ent["shape"])
            and _is_int(ent.get("offset"))
            and _is_int(ent.get("nbytes"))
        )
        if not ok:
            raise _bad(path, f"has a corrupt header (tensor entry {i} is malformed)")
        if ent["name"] in names:
            raise _bad(path, f"has a corrupt header (tensor {ent['name']!r} appears twice)")
        names.add(ent["name"])
        expected = math.prod(ent["shape"]) * np.dtype(ent["dtype"]).itemsize
        if ent["nbytes"] != expected or ent["offset"] < end or ent["offset"] + ent["nbytes"] > data_nbytes:
            raise _bad(path, f"has a corrupt header (tensor {ent['name']!r} has an inconsistent offset or size)")
        end = ent["offset"] + ent["nbytes"]
    return header


def load_tensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read a .gft file: (name -> writable array, meta). Raises CheckpointError on any missing/short/bad byte."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} does not exist; check the path or run directory") from None
    except OSError as e:
        raise CheckpointError(
            f"checkpoint file {path} cannot be opened ({e.strerror}); check its permissions"
        ) from None
    with f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(_PREFIX.size)
        if len(head) >= len(MAGIC) and head[: len(MAGIC)] != MAGIC:
            raise _bad(
                path,
                "is not a geofed tensor file (its first bytes are not the .gft magic)",
                "check that the path points at a checkpoint written by geofed-hpc",
            )
        if size < _MIN_SIZE:
            raise _bad(path, f"is truncated: {size} bytes, fewer than the {_MIN_SIZE} of an empty tensor file")
        _, header_len = _PREFIX.unpack(head)
        if header_len > size - _MIN_SIZE:
            raise _bad(path, f"is truncated or corrupt: its header claims {header_len} bytes but the file has {size}")
        digest = hashlib.sha256(head)
        raw = _read_exact(f, path, header_len)
        digest.update(raw)
        header = _parse_header(path, raw)
        expected = _MIN_SIZE + header_len + header["data_nbytes"]
        if size < expected:
            raise _bad(path, f"is truncated: {size} bytes where its header promises {expected}")
        if size > expected:
            raise _bad(
                path, f"has {size - expected} unexpected bytes after its end ({size} bytes, {expected} expected)"
            )
        if header["version"] >= 2:
            return _load_blocks(f, path, header, size), header["meta"]
        tensors: dict[str, np.ndarray] = {}
        pos = 0
        for ent in header["tensors"]:
            if ent["offset"] > pos:
                digest.update(_read_exact(f, path, ent["offset"] - pos))
            arr = np.empty(ent["shape"], dtype=_le_dtype(ent["dtype"]))
            _read_into(f, path, arr.reshape(-1).view(np.uint8).data, digest)
            tensors[ent["name"]] = arr
            pos = ent["offset"] + ent["nbytes"]
        if header["data_nbytes"] > pos:
            digest.update(_read_exact(f, path, header["data_nbytes"] - pos))
        trailer = _read_exact(f, path, _TRAILER_LEN)
        if trailer[32:] != END_MAGIC:
            raise _bad(path, "is corrupt: its end marker is damaged")
        if trailer[:32] != digest.digest():
            raise _bad(path, "is corrupt: its sha256 checksum does not match its contents")
    return tensors, header["meta"]


def _load_blocks(f: io.BufferedReader, path: Path, header: dict[str, Any], size: int) -> dict[str, np.ndarray]:
    """Format 2: copy the tensors out of a read-only map while a few threads hash its blocks (hashlib and
    numpy's copy both run without the GIL), then check the trailer."""
    body, block = size - _TRAILER_LEN, header["hash_block"]
    data_start = body - header["data_nbytes"]
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            with ThreadPoolExecutor(max(1, min(VERIFY_THREADS, os.cpu_count() or 1))) as pool:
                hashes = pool.map(
                    lambda a: hashlib.sha256(view[a : min(a + block, body)]).digest(), range(0, body, block)
                )
                tensors: dict[str, np.ndarray] = {}
                for ent in header["tensors"]:
                    arr = np.empty(ent["shape"], dtype=_le_dtype(ent["dtype"]))
                    start = data_start + ent["offset"]
                    arr.reshape(-1).view(np.uint8)[:] = np.frombuffer(view[start : start + ent["nbytes"]], np.uint8)
                    tensors[ent["name"]] = arr
                digest = hashlib.sha256(b"".join(hashes)).digest()
            trailer = bytes(view[body:])
        finally:
            view.release()
    if trailer[32:] != END_MAGIC:
        raise _bad(path, "is corrupt: its end marker is damaged")
    if trailer[:32] != digest:
        raise _bad(path, "is corrupt: its sha256 checksum does not match its contents")
    return tensors
