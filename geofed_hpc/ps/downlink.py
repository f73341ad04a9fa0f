"""The downlink: each global update is encoded once (with error feedback), applied as decoded, and kept."""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from geofed_hpc import codec
from geofed_hpc.ckpt.atomic import PRIVATE_FILE, atomic_write_bytes, private_dirs
from geofed_hpc.config import CodecConfig
from geofed_hpc.log import logger
from geofed_hpc.ps.aggregate import Params

_NAME = re.compile(r"^update-(\d{9,})\.gfdc$")


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
    memory.

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

    def chain(self, since: int, now: int, limit_bytes: int) -> list[bytes] | None:
        """Encoded updates since..now-1 in order, or None when one is missing or they outweigh `limit_bytes`."""
        kept = set(self.versions())
        if any(v not in kept for v in range(since, now)):
            return None
        out: list[bytes] = []
        total = 0
        for v in range(since, now):
            if self.directory is None:
                data = self._mem[v]
            else:
                data = (self.directory / f"update-{v:09d}.gfdc").read_bytes()
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
