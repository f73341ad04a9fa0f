"""The downlink: each global update is encoded once (with error feedback), applied as decoded, and kept."""

from __future__ import annotations

import os
import re
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from geofed_hpc import codec
from geofed_hpc.ckpt.atomic import PRIVATE_FILE, atomic_write_bytes, fsync_dir, private_dirs
from geofed_hpc.codec.inputs import TensorSource
from geofed_hpc.config import CodecConfig
from geofed_hpc.faults import fault
from geofed_hpc.log import logger
from geofed_hpc.ps.aggregate import Params
from geofed_hpc.ps.pulls import Spilled, write_frames

_NAME = re.compile(r"^update-(\d{9,})\.gfdc$")
_PENDING = ".update-*.part"  # an update encoded but not (yet) kept: renamed into place by `store`


class Pending(Spilled):
    """An encoded update not kept yet: a file beside the kept ones, renamed into place by `Downlink.store`, removed
    when it is dropped unstored (its round refused, or its update not made)."""

    def __init__(self, fd: int, size: int, path: Path) -> None:
        super().__init__(fd, size)
        self.path = path
        self._remove = weakref.finalize(self, _remove, path)

    def kept(self) -> None:
        self._remove.detach()

    def discard(self) -> None:
        """Remove the file now (it is not to be kept), not when the last reference goes."""
        self._remove()


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)


@dataclass
class Published:
    """Global update `version` -> version+1 as the downlink sends it (`payload`), what every replica adds
    (`applied`, its decoding) and the quantisation error left over (`residual`; None for a lossless codec)."""

    version: int
    payload: bytes
    applied: Params
    residual: Params | None


class Downlink:
    """Global update v -> v+1 is published as E_v = encode(U_v + e); every replica (the PS included) adds
    decode(E_v), so a site that holds version v and applies E_v..E_{now-1} is bit-identical to the PS. The
    quantisation error e stays on the PS and joins the next update (error feedback), so nothing is lost.

    The last `keep` encoded updates live in `directory` (atomic files, mode 0600, that survive a restart) or in
    memory. The PS's model (ps/model.py) encodes with `encode` and keeps with `store`, reading the update, the
    residual and decode(E_v) piece by piece: no decoded copy of an update is held; `propose`/`publish` do the same
    on whole arrays.

    Lock: none; not thread-safe. The GlobalModel owns it, under the coordinator's lock.
    """

    def __init__(self, cfg: CodecConfig, keep: int, directory: Path | None) -> None:
        self.cfg = cfg
        self.keep = keep
        self.directory = directory
        self.residual: Params = {}
        self._mem: OrderedDict[int, bytes] = OrderedDict()
        if directory is not None:
            private_dirs(directory)
            for p in directory.glob(_PENDING):  # left by a PS that stopped between encoding and keeping one
                p.unlink(missing_ok=True)

    @property
    def lossy(self) -> bool:
        """Its codec loses something, kept as the residual (every codec but fp32)."""
        return self.cfg.name != "fp32"

    def encode(self, version: int, targets: Mapping[str, TensorSource]) -> bytes | Pending:
        """E_v: the encoding of `targets` (each update plus the residual, read piece by piece, twice where the codec
        takes a first pass); the caller computes the new residual from decode(E_v) when it makes the update. With a
        directory it is written frame by frame to a file there (Pending, kept by `store`), never held in memory."""
        if self.directory is None or self.keep == 0:
            out = bytearray()  # grown frame by frame: never the frames and their join at once
            for frame in codec.encode_frames(targets, self.cfg):
                out += frame
            return cast(bytes, out)  # read-only from here on, as bytes are (hashed, written, sliced, decoded)
        private_dirs(self.directory)
        path = self.directory / f".update-{version:09d}-{os.urandom(6).hex()}.part"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
        try:
            size = write_frames(fd, codec.encode_frames(targets, self.cfg))
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return Pending(fd, size, path)

    def store(self, version: int, payload: bytes | Pending) -> None:
        """Keep encoded update version -> version+1 (the one step of making it that may fail: OSError, and then
        nothing is kept): a Pending file is synced and renamed into place."""
        if not isinstance(payload, Pending):
            self._store(version, payload)
            return
        assert self.directory is not None
        final = self.directory / f"update-{version:09d}.gfdc"
        try:
            fault("atomic.write", final.name)  # where atomic_write_bytes has its own (tests fill the disk there)
            os.fsync(payload.fd)
            os.replace(payload.path, final)
        except BaseException:
            payload.discard()
            raise
        payload.kept()
        fsync_dir(self.directory)
        for v in self.versions()[: -self.keep]:
            (self.directory / f"update-{v:09d}.gfdc").unlink(missing_ok=True)

    def publish(self, version: int, update: Params) -> Params:
        """Encode update version -> version+1 (consumed) plus the residual, keep it; return exactly what to add."""
        published = self.propose(version, update)
        self.commit(published)
        return published.applied

    def propose(self, version: int, update: Params) -> Published:
        """Encode update version -> version+1 (consumed) plus the residual; nothing is kept or changed yet."""
        target = update
        for k, v in target.items():
            res = self.residual.get(k)
            if res is not None:
                v += res
        payload = codec.encode(target, self.cfg)
        decoded = codec.decode(payload)
        residual = None
        if self.cfg.name != "fp32":
            for k, v in target.items():
                np.subtract(v, decoded[k], out=v)
            residual = target
        return Published(version, payload, decoded, residual)

    def commit(self, published: Published) -> None:
        """Keep a proposed update (the one step that may fail: its file is written first) and its residual."""
        self._store(published.version, published.payload)
        if published.residual is not None:
            self.residual = published.residual

    def _store(self, version: int, payload: bytes) -> None:
        if self.keep == 0:
            return
        if self.directory is not None:
            atomic_write_bytes(self.directory / f"update-{version:09d}.gfdc", payload, mode=PRIVATE_FILE)
            for v in self.versions()[: -self.keep]:
                (self.directory / f"update-{v:09d}.gfdc").unlink(missing_ok=True)
        else:
            self._mem[version] = payload
            while len(self._mem) > self.keep:
                self._mem.popitem(last=False)

    def versions(self) -> list[int]:
        """From-versions of the updates kept, oldest first."""
        if self.directory is None:
            return list(self._mem)
        return sorted(int(mt.group(1)) for p in self.directory.iterdir() if (mt := _NAME.match(p.name)))

    def chain(self, since: int, now: int, limit_bytes: int) -> list[bytes | Spilled] | None:
        """Encoded updates since..now-1 in order, or None when one is missing or they outweigh `limit_bytes`: the
        kept bytes, or with a directory its files, open (read when sent, never held in memory)."""
        kept = set(self.versions())
        if any(v not in kept for v in range(since, now)):
            return None
        out: list[bytes | Spilled] = []
        total = 0
        for v in range(since, now):
            data: bytes | Spilled
            if self.directory is None:
                data = self._mem[v]
            else:
                try:
                    data = Spilled.open(self.directory / f"update-{v:09d}.gfdc")
                except FileNotFoundError:
                    return None
            total += len(data)
            if total >= limit_bytes:
                return None
            out.append(data)
        return out

    def truncate(self, version: int) -> int:
        """Forget updates that start at or after `version`; return how many were dropped."""
        dropped = [v for v in self.versions() if v >= version]
        for v in dropped:
            if self.directory is not None:
                (self.directory / f"update-{v:09d}.gfdc").unlink(missing_ok=True)
            else:
                self._mem.pop(v, None)
        return len(dropped)

    def reset(self) -> None:
        """Forget every update and the residual (a new model was seeded)."""
        dropped = self.truncate(0)
        self.residual = {}
        if dropped:
            logger.info("downlink history cleared (%d updates): a new global model was seeded", dropped)
