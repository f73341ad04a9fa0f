"""A self-describing, pickle-free tensor file (.gft): JSON header, raw little-endian arrays, checksum trailer."""

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
import xxhash

from geofed_hpc.ckpt.atomic import atomic_write_bytes
from geofed_hpc.errors import CheckpointError

# Layout (all integers little-endian):
#   MAGIC (8) | header length H (u64) | header: UTF-8 JSON, space-padded so the data starts 64-byte aligned (H)
#   | data: each tensor's raw bytes at header["tensors"][i]["offset"], 64-byte aligned, zero padding (D)
#   | checksum over every byte before it, zero-padded to 32 bytes (32) | END_MAGIC (8)
# The header's "checksum" names it. Since format version 2: "xxh3_128-blocks", the xxh3_128 of the
# concatenated xxh3_128 digests of each BLOCK bytes of the file (the last block may be shorter), so blocks are
# read and checked in parallel: a checkpoint of several GB loads at the disk's parallel rate, where one sha256
# stream managed ~0.3 GB/s from a cold virtual disk. It guards against torn writes and damaged copies, not
# against an attacker. Version 1 files carry one sha256 over the whole and still load. A site's restart maps the
# file instead of reading it (`load_tensors(mapped=True)`): checked the same way, nothing allocated for it.
# safetensors with the same block checksums in its header loads slower (one thread copies every tensor):
# bench/ckpt_load.py compares them.
MAGIC = b"GEOFEDT\x01"
END_MAGIC = b"GFTEND\x00\x01"
FORMAT_NAME = "geofed-tensors"
FORMAT_VERSION = 2
CHECKSUM = "xxh3_128-blocks"
BLOCK = 64 << 20
READERS = 4  # parallel block reads (a cold virtual disk: 0.3 GB/s with one, 2 GB/s with four)
READAHEAD = 2 << 20  # bytes per readahead hint (the kernel caps one at the device's window)
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


def problem(exc: CheckpointError, path: Path) -> str:
    """What a load error of `path` says is wrong with it, without the file's name and the advice (for a line that
    names several files)."""
    text = str(exc).removeprefix(f"checkpoint file {path} ")
    return text.split("; ", 1)[0]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _le_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(name).newbyteorder("<")


class BlockDigest:
    """The version 2 checksum, fed sequentially: xxh3_128 over the xxh3_128 of each BLOCK bytes."""

    def __init__(self) -> None:
        self._outer = xxhash.xxh3_128()
        self._block = xxhash.xxh3_128()
        self._filled = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), BLOCK - self._filled)
            self._block.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == BLOCK:
                self._outer.update(self._block.digest())
                self._block, self._filled = xxhash.xxh3_128(), 0

    def digest(self) -> bytes:
        outer = self._outer.copy()
        if self._filled:
            outer.update(self._block.digest())
        return outer.digest()


CHECKSUMS: dict[str, Any] = {"sha256": hashlib.sha256, CHECKSUM: BlockDigest}


def _plan(
    path: Path, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any], version: int
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
    header = {
        "format": FORMAT_NAME,
        "version": version,
        "data_nbytes": data_nbytes,
        **({"checksum": CHECKSUM} if version > 1 else {}),
        "tensors": entries,
        "meta": dict(meta),
    }
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
    digest = CHECKSUMS[CHECKSUM if version > 1 else "sha256"]()
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
    yield digest.digest().ljust(32, b"\0") + END_MAGIC


def save_tensors(
    path: Path,
    tensors: Mapping[str, np.ndarray],
    meta: Mapping[str, Any],
    version: int = FORMAT_VERSION,
    mode: int | None = None,
) -> None:
    """Write `tensors` and JSON-able `meta` to `path` atomically, streaming the arrays (no pickle). `version` 1
    writes the first format (one sequential sha256), which every release reads. `mode`: the file's permission bits
    (None: the umask's), as atomic_write_bytes takes them."""
    if version not in (1, FORMAT_VERSION):
        raise ValueError(f"tensor-file format version must be 1 or {FORMAT_VERSION}, got {version!r}")
    path = Path(path)
    prefix, arrays, data_nbytes = _plan(path, tensors, meta, version)
    atomic_write_bytes(path, _stream(prefix, arrays, data_nbytes, version), mode=mode)


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
    checksum = header.setdefault("checksum", "sha256")  # format version 1 names none
    if checksum not in CHECKSUMS:
        raise _bad(path, f"has a corrupt header (unknown checksum {checksum!r})")
    data_nbytes = header.get("data_nbytes")
    entries = header.get("tensors")
    if not _is_int(data_nbytes) or data_nbytes < 0 or not isinstance(entries, list):
        raise _bad(path, "has a corrupt header ('data_nbytes' or 'tensors' missing or malformed)")
    if not isinstance(header.get("meta"), dict):
        raise _bad(path, "has a corrupt header ('meta' missing or not an object)")
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


def read_meta(path: Path) -> dict[str, Any]:
    """The meta of a .gft file from its header alone (no tensor is read or verified: `load_tensors` checks them)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(_PREFIX.size)
            magic, header_len = _PREFIX.unpack(head) if len(head) == _PREFIX.size else (b"", 0)
            if magic != MAGIC:
                raise _bad(path, "is not a geofed tensor file (its first bytes are not the .gft magic)")
            return dict(_parse_header(path, _read_exact(f, path, header_len))["meta"])  # type: ignore[arg-type]
    except OSError as e:
        raise CheckpointError(f"checkpoint file {path} cannot be read ({e.strerror}); check the path") from None


def load_tensors(path: Path, mapped: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read a .gft file: (name -> writable array, meta). Raises CheckpointError on any missing/short/bad byte.

    `mapped`: the file is mapped instead of read (a private, copy-on-write mapping): the arrays are views of the page
    cache, checked against the file's checksum like read ones, and a write to one copies only the page it touches,
    never reaching the file. A restart then allocates nothing for the checkpoint itself: on a VM whose freshly
    touched memory costs seconds per GB, reading 5.4 GB into new memory was most of a site's restart. The mapping
    lives as long as any of its arrays (the file's blocks stay allocated until then, even once it is deleted): a
    caller that keeps state for good copies it out. Checkpoint files are replaced by renames, never rewritten in
    place, so a mapped file does not change under its arrays."""
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
        raw = _read_exact(f, path, header_len)
        header = _parse_header(path, raw)
        expected = _MIN_SIZE + header_len + header["data_nbytes"]
        if size < expected:
            raise _bad(path, f"is truncated: {size} bytes where its header promises {expected}")
        if size > expected:
            raise _bad(
                path, f"has {size - expected} unexpected bytes after its end ({size} bytes, {expected} expected)"
            )
        if mapped:
            data, checksum = _map_verified(f.fileno(), header["checksum"], _PREFIX.size + header_len, size)
        elif header["checksum"] == "sha256":  # format version 1: one stream
            digest = hashlib.sha256(head + raw)
            data = np.empty(header["data_nbytes"], dtype=np.uint8)
            _read_into(f, path, data.data, digest)
            checksum = digest.digest()
        else:
            data, checksum = _read_blocks(f.fileno(), path, head + raw, header["data_nbytes"])
        trailer = os.pread(f.fileno(), _TRAILER_LEN, size - _TRAILER_LEN)
        if len(trailer) != _TRAILER_LEN or trailer[32:] != END_MAGIC:
            raise _bad(path, "is corrupt: its end marker is damaged")
        if trailer[:32] != checksum.ljust(32, b"\0"):
            raise _bad(path, f"is corrupt: its {header['checksum']} checksum does not match its contents")
    tensors = {}
    for ent in header["tensors"]:  # views of one buffer, each 64-byte aligned within it
        raw_bytes = data[ent["offset"] : ent["offset"] + ent["nbytes"]]
        tensors[ent["name"]] = raw_bytes.view(_le_dtype(ent["dtype"])).reshape(ent["shape"])
    return tensors, header["meta"]


def read_ahead(fd: int, start: int, stop: int) -> None:
    """Have the kernel read bytes [start, stop) of the file open on `fd` into the page cache (Linux; a hint: elsewhere
    nothing). One call reads at most the device's readahead window, so the range goes in READAHEAD steps; each
    returns once its reads are queued, and the GIL is released meanwhile."""
    if not hasattr(os, "posix_fadvise"):
        return
    for offset in range(start, stop, READAHEAD):
        os.posix_fadvise(fd, offset, min(READAHEAD, stop - offset), os.POSIX_FADV_WILLNEED)


def _map_verified(fd: int, checksum: str, start: int, size: int) -> tuple[np.ndarray, bytes]:
    """The data region of the file open on `fd` as a view of a private mapping, and the checksum of everything
    before the trailer computed over the mapping (format 2: READERS threads hash a BLOCK each, xxhash releasing the
    GIL, so pages come in from a cold disk in parallel as they do for `_read_blocks`)."""
    end = size - _TRAILER_LEN
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view = memoryview(mapping)
    if checksum == "sha256":  # format version 1: one stream
        return np.frombuffer(mapping, np.uint8, end - start, start), hashlib.sha256(view[:end]).digest()

    def block(offset: int) -> bytes:
        stop = min(offset + BLOCK, end)
        read_ahead(fd, offset, stop)  # large reads from a cold disk, not page by page
        return xxhash.xxh3_128(view[offset:stop]).digest()

    with ThreadPoolExecutor(READERS, thread_name_prefix="gft-map") as pool:
        whole = xxhash.xxh3_128(b"".join(pool.map(block, range(0, end, BLOCK)))).digest()
    return np.frombuffer(mapping, np.uint8, end - start, start), whole


def _read_blocks(fd: int, path: Path, front: bytes, data_nbytes: int) -> tuple[np.ndarray, bytes]:
    """Read the data region after `front` (prefix + header) with READERS threads, one BLOCK of the file each,
    hashing each block as it lands; (data, the file's block checksum)."""
    start, end = len(front), len(front) + data_nbytes
    data = np.empty(data_nbytes, dtype=np.uint8)
    view = data.data

    def block(offset: int) -> bytes:
        h = xxhash.xxh3_128(front[offset : min(offset + BLOCK, start)])
        lo, hi = max(offset, start), min(offset + BLOCK, end)
        if hi <= lo:  # a block of the header only
            return h.digest()
        got = lo
        while got < hi:
            n = os.preadv(fd, [view[got - start : hi - start]], got)
            if n == 0:
                raise _bad(path, f"is truncated: it ended {end - got} bytes early")
            got += n
        h.update(view[lo - start : hi - start])
        return h.digest()

    with ThreadPoolExecutor(READERS, thread_name_prefix="gft-read") as pool:
        digests = list(pool.map(block, range(0, end, BLOCK)))
    return data, xxhash.xxh3_128(b"".join(digests)).digest()
