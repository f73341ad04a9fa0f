"""The server part's snapshots in the PS's state directory: <state_dir>/split/split-<n>.gft (no pickle)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.errors import CheckpointError
from geofed_hpc.faults import fault
from geofed_hpc.log import logger


class SplitSnapshots:
    """Numbered snapshots of the server part (its parameters, optimizer, kept activations, fitted auxiliary
    model), mode 0600, the newest two kept; nothing at all without a state directory. One that cannot be read is
    never removed: set aside in <state_dir>/set-aside/ when an older one loads, and the PS refuses to start when
    none does. Lock: none (the service's)."""

    def __init__(self, state_dir: Path | None) -> None:
        self.store = CheckpointStore(state_dir / "split", prefix="split", keep=2) if state_dir else None
        self.aside = state_dir / "set-aside" if state_dir else None
        self.count = 0  # snapshots written so far (the next file's number)

    def load(self) -> tuple[dict[str, np.ndarray], dict[str, Any], Path] | None:
        if self.store is None or self.aside is None:
            return None
        what = "snapshot(s) of the server part"
        loaded = self.store.load_or_set_aside(_numbered, self.aside, what, "the server part afresh")
        if loaded is None:
            return None
        (tensors, meta), path = loaded
        self.count = meta["snapshot"] + 1
        return tensors, meta, path

    def save(self, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any], why: str) -> Path | None:
        """Write one atomically (`why`: version, align or stop); a failure is logged, never fatal (the previous one
        stays loadable)."""
        if self.store is None:
            return None
        try:
            path = self.store.save(self.count, tensors, {**meta, "snapshot": self.count})
        except (OSError, CheckpointError) as exc:
            logger.error("snapshot of the server part failed (the previous one stays loadable): %s", exc)
            return None
        fault("split.snapshot", f"{why}:{self.count}")
        self.count += 1
        return path


def _numbered(path: Path, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> tuple[dict, dict]:
    """A snapshot whose number is well-formed (ValueError otherwise); what the server part restores is checked
    there."""
    number = meta.setdefault("snapshot", 0)
    if isinstance(number, bool) or not isinstance(number, int) or number < 0:
        raise ValueError(f"has a malformed meta field 'snapshot' ({number!r}, not an int >= 0)")
    return tensors, meta
