"""The per-sync table a local launch prints: pure functions from metric records to text."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

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


def header() -> str:
    return "  ".join(name.rjust(width) if i else name.ljust(width) for i, (name, width) in enumerate(COLUMNS))


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
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS, strict=True)))


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
