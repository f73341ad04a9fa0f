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
    model), the newest two kept; nothing at all without a state directory. Lock: none (the service's)."""

    def __init__(self, state_dir: Path | None) -> None:
        self.store = CheckpointStore(state_dir / "split", prefix="split", keep=2) if state_dir else None
        self.count = 0  # snapshots written so far (the next file's number)

    def load(self) -> tuple[dict[str, np.ndarray], dict[str, Any], Path] | None:
        if self.store is None:
            return None
        loaded = self.store.load_latest()
        if loaded is not None:
            self.count = int(loaded[1].get("snapshot", 0)) + 1
        return loaded

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
