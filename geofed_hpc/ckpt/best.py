"""Keep the k checkpoints with the lowest evaluation loss: files of their own (or links) plus an index."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from geofed_hpc.ckpt.atomic import atomic_write_bytes
from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger

INDEX = "best.json"


class BestCheckpoints:
    """`directory` holds links to the `keep` best checkpoints (by loss) and best.json: [{file, loss, step}]."""

    def __init__(self, directory: Path, keep: int = 10) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ConfigError(f"train.keep_best: must be 0 (off) or more, got {keep!r}")
        self.directory = Path(directory)
        self.keep = keep

    def entries(self) -> list[dict]:
        """The kept checkpoints, best first."""
        try:
            data = json.loads((self.directory / INDEX).read_text())
        except (OSError, ValueError):
            return []
        ok = [e for e in data if isinstance(e, dict) and (self.directory / str(e.get("file"))).is_file()]
        return sorted(ok, key=lambda e: e["loss"])

    def would_keep(self, loss: float) -> bool:
        """Whether a checkpoint with this loss would be kept (ask before writing one just to offer it)."""
        if self.keep == 0 or not math.isfinite(loss):
            return False
        entries = self.entries()
        return len(entries) < self.keep or loss < entries[-1]["loss"]

    def offer(self, checkpoint: Path, loss: float, step: int, name: str | None = None) -> bool:
        """Keep `checkpoint` (linked as `name`, by default its own name) if its loss is among the best `keep`;
        drop the one it displaces. True if kept."""

        def link(target: Path) -> None:
            try:
                os.link(checkpoint, target)
            except OSError:
                shutil.copy2(checkpoint, target)

        return self.admit(name or checkpoint.name, loss, step, link)

    def admit(self, name: str, loss: float, step: int, write: Callable[[Path], object]) -> bool:
        """Keep a checkpoint named `name` if its loss is among the best `keep`: `write(path)` writes it there (a
        site writes the weights alone); drop the one it displaces. True if kept."""
        if self.keep == 0 or not math.isfinite(loss):
            return False
        entries = [e for e in self.entries() if e["file"] != name]
        if len(entries) >= self.keep and loss >= entries[-1]["loss"]:
            return False
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / name
        target.unlink(missing_ok=True)
        write(target)
        entries = sorted([*entries, {"file": name, "loss": float(loss), "step": int(step)}], key=lambda e: e["loss"])
        for dropped in entries[self.keep :]:
            (self.directory / dropped["file"]).unlink(missing_ok=True)
            logger.debug("dropped %s from the best checkpoints", dropped["file"])
        atomic_write_bytes(self.directory / INDEX, json.dumps(entries[: self.keep], indent=1).encode())
        return True
