"""Terminal progress tables: a local launch's line per sync, `ps up`'s line per applied global version."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

COLUMNS = (
    ("site", 10),
    ("sync", 5),
    ("version", 8),
    ("steps", 6),
    ("train loss", 11),
    ("val loss", 9),
    ("sent", 11),
    ("ratio", 7),
)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# `ps up`: one line per applied global version
PS_COLUMNS = (
    ("version", 7),
    ("sites", 20),
    ("stale", 5),
    ("tokens", 8),
    ("received", 10),
    ("val loss", 9),
    ("active", 6),
)


def human_count(n: float) -> str:
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000 or unit == "G":
            return f"{n:.0f}" if not unit else f"{n:.1f}{unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _line(cells: Sequence[str], columns: Sequence[tuple[str, int]], left: int = 1) -> str:
    """The first `left` columns left-aligned, the others right-aligned, two spaces apart."""
    pairs = enumerate(zip(cells, columns, strict=True))
    return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, (_, w)) in pairs)


def header(columns: Sequence[tuple[str, int]] = COLUMNS, left: int = 1) -> str:
    return _line([name for name, _ in columns], columns, left)


def _num(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def row(record: Mapping[str, Any]) -> str:
    """One line for one sync record of one site (JSONL record written by the site's recorder)."""
    ratio = record.get("sync/compression_ratio")
    cells = (
        str(record.get("name", "?")),
        _num(record.get("sync/index"), "d"),
        _num(record.get("sync/version"), "d"),
        _num(record.get("sync/local_steps"), "d"),
        _num(record.get("train/loss"), ".4f"),
        _num(record.get("val/loss"), ".4f"),
        human_bytes(record.get("sync/bytes_sent", 0)),
        "-" if ratio is None or (isinstance(ratio, float) and math.isnan(ratio)) else f"{ratio:.1f}x",
    )
    return _line(cells, COLUMNS)


def _sites(names: Sequence[str], width: int) -> str:
    """Site names, comma-separated, as many as fit; the rest counted (`osc-0,tacc-1 +3`)."""
    text = ",".join(names) or "-"
    if len(text) <= width:
        return text
    for n in range(len(names) - 1, 0, -1):
        short = f"{','.join(names[:n])} +{len(names) - n}"
        if len(short) <= width:
            return short
    return f"{len(names)} sites"


def ps_row(applied: Mapping[str, Any], val_loss: float | None = None) -> str:
    """One line for one applied global version (a ps.observe.AppliedVersion as a dict)."""
    cells = (
        str(applied["version"]),
        _sites(list(applied["sites"]), PS_COLUMNS[1][1]),
        str(applied["staleness"]),
        human_count(applied["tokens"]),
        human_bytes(applied["nbytes"]),
        _num(val_loss, ".4f"),
        str(applied["active"]),
    )
    return _line(cells, PS_COLUMNS, left=2)


class PSProgress:
    """Prints `ps up`'s lines in version order. A version's line waits (at most `hold_s`) for the global
    validation loss the sites report after pulling it, so the loss shows on the line it belongs to."""

    def __init__(self, out: TextIO = sys.stdout, hold_s: float = 30.0, clock: Any = time.monotonic) -> None:
        self.out, self.hold_s, self._clock = out, hold_s, clock
        self.last = 0  # newest version printed or waiting
        self._waiting: list[tuple[float, dict[str, Any]]] = []
        self._losses: dict[int, float] = {}

    def start(self, version: int) -> None:
        self.last = version
        print(header(PS_COLUMNS, left=2), file=self.out, flush=True)

    def poll(self, applied: Sequence[dict[str, Any]], val: tuple[int, float]) -> None:
        """`applied`: versions applied after `self.last` (oldest first); `val`: (version, global val loss)."""
        now = self._clock()
        for record in applied:
            if record["version"] > self.last:
                self._waiting.append((now, record))
                self.last = record["version"]
        if val[0] >= 0 and not math.isnan(val[1]):
            self._losses[val[0]] = val[1]
        while self._waiting:
            since, record = self._waiting[0]
            loss = self._losses.get(record["version"])
            overtaken = any(v > record["version"] for v in self._losses)  # the sites evaluate a newer one
            if loss is None and not overtaken and now - since < self.hold_s:
                break
            self._emit(record, loss)

    def flush(self) -> None:
        while self._waiting:
            _, record = self._waiting[0]
            self._emit(record, self._losses.get(record["version"]))

    def _emit(self, record: dict[str, Any], loss: float | None) -> None:
        self._waiting.pop(0)
        self._losses = {v: x for v, x in self._losses.items() if v > record["version"]}
        print(ps_row(record, loss), file=self.out, flush=True)


def is_sync_record(record: Mapping[str, Any]) -> bool:
    return int(record.get("sync/index", 0) or 0) > 0 and "train/loss" in record


def summary(records: Sequence[Mapping[str, Any]]) -> str:
    """Global validation loss at the first and the last version any site evaluated."""
    evals = [r for r in records if "val/loss" in r and "sync/version" in r]
    if not evals:
        return "no validation loss was recorded"
    first = min(evals, key=lambda r: (r["sync/version"], r.get("time", 0)))
    last = max(evals, key=lambda r: (r["sync/version"], r.get("time", 0)))
    return (
        f"global validation loss: {first['val/loss']:.4f} at version {first['sync/version']} -> "
        f"{last['val/loss']:.4f} at version {last['sync/version']}"
    )
