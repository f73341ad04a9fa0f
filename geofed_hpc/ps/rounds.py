"""The open round: deltas folded into one accumulator (mean rules) or spooled on disk (robust rules)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from geofed_hpc.config import PSConfig
from geofed_hpc.log import logger
from geofed_hpc.ps.aggregate import (
    MeanAccumulator,
    Params,
    RelativeWork,
    buffer_full,
    clip_scale,
    global_norm,
    robust_rule,
    round_complete,
)
from geofed_hpc.ps.staging import Staging, read_rows

# Robust rules read all spooled deltas coordinate slice by slice; one slice of all of them stays under this.
ROBUST_SLICE_BYTES = 64 << 20


@dataclass
class Prepared:
    """A verified, decoded delta ready to join a round (already clipped, and divided by its steps for FedNova)."""

    session_id: str
    weight: float
    steps: int
    norm: float
    arrays: Params | None = None
    spool: Path | None = None


@dataclass
class _Spooled:
    path: Path
    discount: float
    steps: int


@dataclass
class _Open:
    acc: MeanAccumulator = field(default_factory=MeanAccumulator)
    spooled: list[_Spooled] = field(default_factory=list)
    pushed: set[str] = field(default_factory=set)
    deadline: float | None = None

    @property
    def count(self) -> int:
        return self.acc.count + len(self.spooled)


class Rounds:
    """When an update fires (sync: all active pushed or deadline; async: every delta; buffered: K or deadline)
    and what it is (weighted mean, FedNova-normalised mean, trimmed mean or coordinate median)."""

    def __init__(self, cfg: PSConfig, staging: Staging, clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.staging = staging
        self._clock = clock
        self.spec: dict[str, tuple[int, ...]] = {}
        self._open = _Open()
        self._work = RelativeWork()

    @property
    def count(self) -> int:
        return self._open.count

    @property
    def pushed(self) -> set[str]:
        return self._open.pushed

    @property
    def robust(self) -> bool:
        return self.cfg.robust != "none"

    def prepare(self, delta: Params, session_id: str, steps: int, tokens: int) -> Prepared:
        """Clip and normalise a delta (in place) and, for robust rules, spool it to disk. No lock needed."""
        norm = global_norm(delta)
        coef = clip_scale(norm, self.cfg.clip_norm)
        if self.cfg.outer_optimizer == "fednova":
            coef /= steps
        if coef != 1.0:
            for v in delta.values():
                v *= np.float32(coef)
        weight = float(tokens) if self.cfg.weighting == "tokens" else 1.0
        prepared = Prepared(session_id, weight, steps, norm)
        if self.robust:
            prepared.spool = self.staging.spool(delta, self.spec)
        else:
            prepared.arrays = delta
        return prepared

    def admit(self, p: Prepared, discount: float) -> None:
        """Add a prepared delta, scaled by its staleness discount (hold the PS lock). With async, each update is
        one delta, so `ps.weighting=tokens` scales it by its tokens against recent deltas' (RelativeWork)."""
        r = self._open
        if self.cfg.aggregation == "async" and self.cfg.weighting == "tokens":
            discount *= self._work.weight(p.weight)
        if p.spool is not None:
            r.spooled.append(_Spooled(p.spool, discount, p.steps))
        else:
            assert p.arrays is not None
            r.acc.fold(p.arrays, p.weight, discount, p.steps, consume=True)
            p.arrays = None
        r.pushed.add(p.session_id)
        if r.deadline is None:
            r.deadline = self._clock() + self.cfg.round_timeout.total_seconds()

    def discard(self, p: Prepared) -> None:
        if p.spool is not None:
            p.spool.unlink(missing_ok=True)
        p.arrays = None

    def ready(self, active: set[str]) -> bool:
        r = self._open
        if self.cfg.aggregation == "async":
            return r.count > 0
        if self.cfg.aggregation == "buffered":
            return buffer_full(r.count, self.cfg.buffer_size, self._clock(), r.deadline)
        return round_complete(r.pushed, active, self._clock(), r.deadline)

    def close(self) -> tuple[Params, int]:
        """The aggregated delta of the open round and how many deltas it holds; a new round opens."""
        r, self._open = self._open, _Open()
        if r.spooled:
            result = self._robust(r.spooled)
            tau_eff = float(np.mean([s.steps for s in r.spooled]))
        else:
            result, tau_eff = r.acc.take_mean()
        if self.cfg.outer_optimizer == "fednova":
            for v in result.values():
                v *= np.float32(tau_eff)
        return result, r.count

    def clear(self) -> None:
        """Drop the open round (its spooled files too)."""
        r, self._open = self._open, _Open()
        for s in r.spooled:
            s.path.unlink(missing_ok=True)

    def _robust(self, spooled: list[_Spooled]) -> Params:
        """Apply the robust rule coordinate slice by slice: memory is one slice of every delta, not N models."""
        n_rows = len(spooled)
        width = max(1, ROBUST_SLICE_BYTES // (4 * n_rows))
        biggest = max((int(np.prod(s)) for s in self.spec.values()), default=1)
        buf = np.empty((n_rows, max(1, min(width, biggest))), np.float32)
        discounts = np.array([[s.discount] for s in spooled], np.float32)
        fds = [os.open(s.path, os.O_RDONLY) for s in spooled]
        out: Params = {}
        try:
            offset = 0
            for name, shape in self.spec.items():
                numel = int(np.prod(shape))
                res = np.empty(numel, np.float32)
                for start in range(0, numel, buf.shape[1]):
                    rows = buf[:, : min(buf.shape[1], numel - start)]
                    read_rows(fds, offset + start, rows)
                    rows *= discounts
                    res[start : start + rows.shape[1]] = robust_rule(self.cfg.robust, rows, self.cfg.trim_fraction)
                out[name] = res.reshape(shape)
                offset += numel
        finally:
            for fd in fds:
                os.close(fd)
            for s in spooled:
                s.path.unlink(missing_ok=True)
        logger.debug("%s over %d spooled deltas, %d values per slice", self.cfg.robust, n_rows, buf.shape[1])
        return out
