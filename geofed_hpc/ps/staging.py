"""Disk staging: pushes land in files while their checksum is computed, then decode; robust rules spool deltas."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np

from geofed_hpc import codec
from geofed_hpc.ckpt.atomic import PRIVATE_DIR, PRIVATE_FILE
from geofed_hpc.codec.packed import PackedTensor
from geofed_hpc.codec.sparse import SparseTensor
from geofed_hpc.codec.stream import Scratch
from geofed_hpc.errors import CodecError, ProtocolError
from geofed_hpc.log import logger
from geofed_hpc.paradigms.exchange import Params
from geofed_hpc.ps.statedir import check_state_dir
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.stream import Header, drain

_KINDS = ("push-", "spool-", "model-")
_PRIVATE = "geofed-ps-staging-"  # a private staging dir: <temp>/geofed-ps-staging-<pid>-<random>


def remove_orphans(temp: Path) -> None:
    """Remove the private staging dirs of PS processes that are gone (killed before `close`). A dir whose
    process still runs, or whose name carries no process id, is left alone."""
    for p in temp.glob(f"{_PRIVATE}*-*"):
        pid = p.name[len(_PRIVATE) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        shutil.rmtree(p, ignore_errors=True)
        logger.debug("removed %s, the staging dir of process %s, which is gone", p, pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class Staging:
    """One directory of short-lived files, 0700 with files 0600 (a directory other users may write in is refused,
    as the state directory is); leftovers of a crash are removed at start. Without a directory the PS owns a
    private temp dir for its lifetime (removed by `close`, or by the next PS when this one is killed); a
    directory that disappears while the PS runs (a /tmp cleaner) is made again by the next file staged.

    Receiving a push writes chunk by chunk to a file (memory stays one chunk per push, whatever the number
    of sites uploading at once); nothing is decoded or applied before the whole stream verified.

    Lock: its own `_lock` guards the file-name counter; each file belongs to the one stream or delta that made it.
    """

    def __init__(self, directory: str | Path | None) -> None:
        self._owned = directory is None or str(directory) == ""
        if self._owned:
            remove_orphans(Path(tempfile.gettempdir()))
            self.directory = Path(tempfile.mkdtemp(prefix=f"{_PRIVATE}{os.getpid()}-"))
        else:
            self.directory = check_state_dir(Path(directory), "ps.staging_dir")  # type: ignore[arg-type]
            self._clear()
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def _clear(self) -> None:
        if not self.directory.is_dir():
            return
        for p in self.directory.iterdir():
            if p.name.startswith(_KINDS) and p.is_file():
                p.unlink(missing_ok=True)

    def new_path(self, kind: str) -> Path:
        """A fresh file name in the directory, which exists (again) once this returns."""
        with self._lock:
            if not self.directory.is_dir():
                logger.warning("staging area %s disappeared (a temp cleaner?); making it again", self.directory)
                self.directory.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
                os.chmod(self.directory, PRIVATE_DIR)  # mkdir's mode passes through the umask
            return self.directory / f"{kind}-{os.getpid()}-{next(self._ids):08d}"

    def receive(self, header: Header, first: m.Chunk, rest: Iterable[m.Chunk]) -> Path:
        """Stream a payload into a new file; raise (and remove it) unless length and sha256 verify."""
        path = self.new_path("push")
        try:
            with _create(path) as f:
                drain(header, first, rest, f.write)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return path

    def spool(self, arrays: Mapping[str, np.ndarray | SparseTensor | PackedTensor], order: Iterable[str]) -> Path:
        """Write float32 arrays back to back, in `order`, to a new file (read back slice by slice); a sparse
        tensor is densified for its write alone."""
        path = self.new_path("spool")
        with _create(path) as f:
            for name in order:
                v = arrays[name]
                dense = v if isinstance(v, np.ndarray) else v.dense()
                f.write(np.ascontiguousarray(dense, dtype="<f4").reshape(-1).view(np.uint8).data)
                del dense
        return path

    def close(self) -> None:
        """Remove everything staged (and the directory when it was a private temp dir)."""
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)
        else:
            self._clear()
        logger.debug("staging area %s cleared", self.directory)


def _create(path: Path) -> BinaryIO:
    """A new file (never an existing one, nor through a link) for writing, mode 0600 whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
    f = os.fdopen(fd, "wb")
    try:
        os.fchmod(fd, PRIVATE_FILE)
    except BaseException:
        f.close()
        raise
    return f


def read_rows(fds: list[int], offset: int, out: np.ndarray) -> None:
    """Fill row i of float32 `out` (N, n) from open file i at element `offset` (files from Staging.spool)."""
    n = out.shape[1]
    for i, fd in enumerate(fds):
        view = memoryview(out[i]).cast("B")
        got = 0
        while got < 4 * n:
            read = os.preadv(fd, [view[got:]], 4 * offset + got)
            if read == 0:
                raise OSError(f"spooled delta {i} ended early at element {offset + got // 4}")
            got += read


def decode_push(payload: bytes, header: m.PushHeader, expected: dict | None) -> Params:
    """Decode a verified payload (`expected`: name -> (shape, dtype) it must hold) to dense arrays; its bytes
    arrived intact, so any fault is in what the site sent: ProtocolError."""
    try:
        _check_codec(payload, header)
        return codec.decode(payload, expected=expected)
    except CodecError as exc:
        raise ProtocolError(f"delta refused: {exc}") from None


def decode_delta(
    payload: bytes, header: m.PushHeader, expected: dict, scratch: Scratch | None = None
) -> dict[str, np.ndarray | SparseTensor | PackedTensor]:
    """decode_push for a delta: a sparse one comes as SparseTensors (kept indices and values), never densified;
    dense ones as PackedTensors (their pieces' contents, checked: decoded when folded); `scratch` (a decoder
    slot's) lends its piece buffer and decompressor."""
    try:
        _check_codec(payload, header)
        return codec.decode_stream(payload, expected, sparse=True, scratch=scratch, packed=True)[1]
    except CodecError as exc:
        raise ProtocolError(f"delta refused: {exc}") from None


def _check_codec(payload: bytes, header: m.PushHeader) -> None:
    if codec.codec_name(payload) != header.codec:
        raise ProtocolError(f"header says codec {header.codec!r}, payload is {codec.codec_name(payload)!r}")
