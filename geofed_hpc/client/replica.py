"""The site's copy of the global model it trains from (its base): pulled whole or as the PS's updates since."""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np

from geofed_hpc import codec
from geofed_hpc.client.events import EventLog
from geofed_hpc.client.group import SiteGroup
from geofed_hpc.client.telemetry import SyncTimer
from geofed_hpc.errors import CodecError, ProtocolError
from geofed_hpc.log import logger
from geofed_hpc.paradigms import Exchange
from geofed_hpc.paradigms.exchange import Params
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient


def apply_updates(base: Params, header: m.ModelHeader, payload: bytes, exchange: Exchange | None = None) -> Params:
    """Add the PS's encoded global updates (header.segments, in version order) to `base` in place, the same
    float32 adds the PS made (each update expanded by the paradigm as the PS does), so `base` stays
    bit-identical to the global model."""
    if sum(header.segments) != len(payload):
        raise ProtocolError(f"update segments add up to {sum(header.segments)} bytes, the payload has {len(payload)}")
    exchange = exchange or Exchange()
    shapes = {k: tuple(v.shape) for k, v in base.items()}
    expected = {k: (s, "float32") for k, s in exchange.wire_spec(shapes).items()}
    view, pos = memoryview(payload), 0
    for i, size in enumerate(header.segments):
        update = codec.decode(view[pos : pos + size], expected=expected)  # type: ignore[arg-type]
        for k, v in exchange.expand(update, header.base_version + i, shapes).items():
            base[k] += v
        pos += size
    return base


class PSBehind(Exception):  # noqa: N818 - a finding the site acts on, not an error for the user
    """A pull found the PS at an older version than our base (it came back from an older snapshot without its
    journal): nothing was loaded; the site re-seeds it (the freshest copy wins)."""

    def __init__(self, version: int) -> None:
        super().__init__(f"the parameter server is back at version {version}")
        self.version = version


class Replica:
    """`base`: the global model at `version` that local work is measured against (delta = local - base).
    `exact` says whether it is the PS's model bit for bit (False after a lost pull: then it is the model the site
    pushed, and the next pull is a full one). Loading a pulled model into the site's ranks goes through `group`;
    the site's private tensors (hybrid_lora's adapters) are kept across it."""

    def __init__(
        self, name: str, group: SiteGroup, exchange: Exchange, private: list[str], events: EventLog | None = None
    ) -> None:
        self.name, self.group, self.exchange, self.private = name, group, exchange, private
        self.events = events  # a `pulled` event per pull (the version, how it came, the model's digest)
        self.base: Params = {}
        self.version = 0
        self.exact = True

    def pull(self, client: PSClient, session_id: str, min_version: int, wait: timedelta, timer: SyncTimer) -> None:
        """Take the global model: only the PS's encoded updates since our version when it still keeps them
        (the base stays bit-identical to the PS), the full model otherwise; load it into the model."""
        have = self.version if self.base and self.exact else None
        t0 = time.monotonic()
        header, payload = client.pull_model(session_id, min_version, wait, have_version=have)
        timer.pull_s += time.monotonic() - t0
        timer.wait_s += client.last_pull_wait_s
        timer.bytes_received += len(payload)
        if header.kind == "updates":
            try:
                if header.base_version != have:
                    raise ProtocolError(f"updates start at version {header.base_version}, we hold {have}")
                arrays = apply_updates(self.base, header, payload, self.exchange)
                if not self._matches(header, arrays):
                    raise ProtocolError(
                        f"after the updates our model differs from the PS's version {header.version} (it restarted "
                        "from an older state or was re-seeded since we pulled)"
                    )
            except (CodecError, ProtocolError) as exc:
                logger.warning("%s: cannot apply the global updates (%s); pulling the full model", self.name, exc)
                self.base = {}
                self.pull(client, session_id, min_version, timedelta(0), timer)
                return
        else:
            arrays = codec.decode(payload)
            if have is not None and header.version < have:
                logger.warning("%s: the PS is back at version %d (we held %d)", self.name, header.version, have)
                raise PSBehind(header.version)
            if not self._matches(header, arrays):  # the PS's own model, sent whole: never expected to differ
                logger.error("%s: the model of version %d does not match its digest", self.name, header.version)
        self.group.load_model(self.with_private(arrays))
        self.base, self.version, self.exact = arrays, header.version, True
        if self.events is not None:
            digest = header.model_digest or codec.model_digest(arrays)  # checked equal above when the PS sent one
            self.events("pulled", version=header.version, kind=header.kind, bytes=len(payload), digest=digest.hex())

    def _matches(self, header: m.ModelHeader, arrays: Params) -> bool:
        """Whether `arrays` are the PS's model of header.version, bit for bit (a PS that sends no digest: yes).
        Every check is recorded: replica_diverged events count the replicas that were not."""
        if not header.model_digest or codec.model_digest(arrays) == header.model_digest:
            return True
        if self.events is not None:
            self.events("replica_diverged", version=header.version, kind=header.kind)
        return False

    def with_private(self, arrays: Params) -> Params:
        """The global model plus this site's private tensors (hybrid_lora's adapters), which it never sends."""
        if not self.private:
            return arrays
        local = self.group.model_arrays()
        return {**{k: np.array(local[k], copy=True) for k in self.private}, **arrays}

    def adopt_local(self, version: int) -> None:
        """The pull after a push failed: the local model becomes the base at the version pushed to (not the PS's
        model bit for bit)."""
        self.base = {k: np.array(v, copy=True) for k, v in self.group.model_arrays().items()}
        self.version, self.exact = version, False

    def adopt_disk(self, model: Params, version: int) -> None:
        """A checkpoint holding the global model at `version` (its private tensors left out) is the base."""
        self.base, self.version, self.exact = self.exchange.public(model), version, True

    def seed_arrays(self) -> Params:
        """What to seed an empty PS with: our base (the global model we last pulled), else our fresh model."""
        return self.base if self.base else self.exchange.public(self.group.model_arrays())
