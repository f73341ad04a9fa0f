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
    Delta,
    Lazy,
    MeanAccumulator,
    Params,
    WeightedSum,
    clip_scale,
    dense_of,
    global_norm,
    robust_rule,
    scale_delta,
)
from geofed_hpc.ps.staging import Staging, read_rows

# Robust rules read all spooled deltas coordinate slice by slice; one slice of all of them stays under this.
ROBUST_SLICE_BYTES = 64 << 20


@dataclass
class Prepared:
    """A verified, decoded delta ready to join a round (already clipped, and divided by its steps for FedNova)."""

    session_id: str
    tokens: int
    steps: int
    norm: float
    arrays: Delta | None = None
    spool: Path | None = None
    push_id: str = ""


@dataclass
class Spooled:
    """One delta of a robust round, on disk (float32, in the round's `spec` order), with its scale and steps."""

    path: Path
    scale: float
    steps: int


@dataclass
class _Open:
    acc: MeanAccumulator = field(default_factory=MeanAccumulator)
    spooled: list[Spooled] = field(default_factory=list)
    pushed: set[str] = field(default_factory=set)
    push_ids: list[str] = field(default_factory=list)
    deadline: float | None = None

    @property
    def count(self) -> int:
        return self.acc.count + len(self.spooled)


@dataclass
class RoundTotals:
    """A round taken to be closed, before its aggregate: the weighted sum of mean rules, or the spooled deltas of a
    robust rule (exactly one of the two), how many deltas it holds and their push ids. Until `release`, the round
    is whole and can be put back (`OpenRound.restore`) when its update cannot be made."""

    count: int
    push_ids: list[str]
    folded: WeightedSum | None = None
    spooled: list[Spooled] = field(default_factory=list)
    source: _Open | None = field(default=None, repr=False)


class OpenRound:
    """The round now open: who pushed, its deadline (`ps.round_timeout` after its first delta), and its deltas,
    folded (weighted mean, FedNova-normalised mean) or spooled (trimmed mean, coordinate median). Knows nothing of
    the aggregation mode: a strategy (ps/strategy/) picks each delta's weight and scale and when the round closes.

    Lock: none; not thread-safe. The coordinator's lock guards every call but `prepare` (which touches only the
    delta it is given and `spec`, set while no push is being prepared).
    """

    def __init__(self, cfg: PSConfig, staging: Staging, clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.staging = staging
        self._clock = clock
        self.spec: dict[str, tuple[int, ...]] = {}  # what a delta carries, in spool order
        self._open = _Open()

    @property
    def count(self) -> int:
        return self._open.count

    @property
    def pushed(self) -> set[str]:
        """Sessions with a delta in the open round."""
        return self._open.pushed

    @property
    def deadline(self) -> float | None:
        """When the open round's timeout passes (None: no delta yet)."""
        return self._open.deadline

    @property
    def robust(self) -> bool:
        return self.cfg.robust != "none"

    def prepare(self, delta: Delta, session_id: str, steps: int, tokens: int) -> Prepared:
        """Clip and normalise a delta (in place) and, for robust rules, spool it to disk (a sparse tensor is
        densified there, one at a time). No lock needed."""
        norm = global_norm(delta)
        coef = clip_scale(norm, self.cfg.clip_norm)
        if self.cfg.outer_optimizer == "fednova":
            coef /= steps
        if coef != 1.0:
            scale_delta(delta, coef)
        prepared = Prepared(session_id, tokens, steps, norm)
        if self.robust:
            prepared.spool = self.staging.spool(delta, self.spec)
        else:
            prepared.arrays = delta
        return prepared

    def admit(self, p: Prepared, weight: float, scale: float) -> None:
        """Add a prepared delta as weight * scale * delta (robust rules: scale * delta; they are unweighted)."""
        r = self._open
        if p.spool is not None:
            r.spooled.append(Spooled(p.spool, scale, p.steps))
        else:
            assert p.arrays is not None
            r.acc.fold(p.arrays, weight, scale, p.steps, consume=True)
            p.arrays = None
        r.pushed.add(p.session_id)
        r.push_ids.append(p.push_id)
        if r.deadline is None:
            r.deadline = self._clock() + self.cfg.round_timeout.total_seconds()

    def discard(self, p: Prepared) -> None:
        if p.spool is not None:
            p.spool.unlink(missing_ok=True)
        p.arrays = None

    def now(self) -> float:
        """The round clock's reading (the one deadlines are set on)."""
        return self._clock()

    def take(self) -> RoundTotals:
        """The open round's totals, before anything is divided (a new round opens; `restore` puts this one back,
        `release` lets its spooled files go once its update is made or refused)."""
        r, self._open = self._open, _Open()
        if r.spooled:
            return RoundTotals(r.count, list(r.push_ids), spooled=r.spooled, source=r)
        return RoundTotals(r.count, list(r.push_ids), folded=r.acc.peek_sum(lazy=True), source=r)

    def restore(self, totals: RoundTotals) -> None:
        """Put a taken round back as the open one (its update could not be made): nothing of it is lost."""
        assert totals.source is not None and self._open.count == 0, "a round is restored before any new delta"
        self._open = totals.source

    def release(self, totals: RoundTotals) -> None:
        """A taken round is done with (its update made, or refused): its spooled files go."""
        for s in totals.spooled:
            s.path.unlink(missing_ok=True)
        totals.source = None

    def aggregate(self, totals: RoundTotals, lazy: bool = False) -> Lazy:
        """The round's aggregated delta in new arrays: the robust rule over its spooled deltas or its weighted mean,
        times FedNova's effective step count (the totals stay whole: see `restore`). With `lazy` a weighted mean
        is read piece by piece from the sum when it is used (TensorSources: no copy of the sum is made)."""
        fednova = self.cfg.outer_optimizer == "fednova"
        if not totals.spooled:
            assert totals.folded is not None
            w = totals.folded
            tau_eff = w.weighted_steps / w.weight if w.weight > 0 else 0.0
            sources, _ = w.mean_sources(tau_eff if fednova else None)
            return dict(sources) if lazy else {k: dense_of(v) for k, v in sources.items()}
        result = self._robust(totals.spooled)
        tau_eff = float(np.mean([s.steps for s in totals.spooled]))
        if fednova:
            for v in result.values():
                v *= np.float32(tau_eff)
        return dict(result)

    def clear(self) -> None:
        """Drop the open round (its spooled files too)."""
        r, self._open = self._open, _Open()
        for s in r.spooled:
            s.path.unlink(missing_ok=True)

    def _robust(self, spooled: list[Spooled]) -> Params:
        """Apply the robust rule coordinate slice by slice: memory is one slice of every delta, not N models."""
        n_rows = len(spooled)
        width = max(1, ROBUST_SLICE_BYTES // (4 * n_rows))
        biggest = max((int(np.prod(s)) for s in self.spec.values()), default=1)
        buf = np.empty((n_rows, max(1, min(width, biggest))), np.float32)
        scales = np.array([[s.scale] for s in spooled], np.float32)
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
                    rows *= scales
                    res[start : start + rows.shape[1]] = robust_rule(self.cfg.robust, rows, self.cfg.trim_fraction)
                out[name] = res.reshape(shape)
                offset += numel
        finally:
            for fd in fds:
                os.close(fd)
        logger.debug("%s over %d spooled deltas, %d values per slice", self.cfg.robust, n_rows, buf.shape[1])
        return out
