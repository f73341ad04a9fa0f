"""A keep-latest directory of .gft checkpoints, for client checkpoints and parameter-server snapshots."""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from geofed_hpc.ckpt.atomic import PRIVATE_FILE, clean_temp_files, private_dirs, set_aside
from geofed_hpc.ckpt.tensorfile import SUFFIX, load_tensors, problem, read_ahead, save_tensors
from geofed_hpc.errors import CheckpointError, ConfigError
from geofed_hpc.log import logger

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
T = TypeVar("T")


class CheckpointStore:
    """`{prefix}-{step:09d}.gft` files in one directory, mode 0600 (they hold sessions and rejoin tokens; a folder
    made for them is 0700); the newest `keep` are kept. One writer per store."""

    def __init__(self, directory: Path, prefix: str = "ckpt", keep: int = 2) -> None:
        if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
            raise ConfigError(
                f"checkpoint prefix must be letters, digits, '_', '-' or '.' (not leading); got {prefix!r}"
            )
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"checkpoint keep must be an int >= 1; got {keep!r}")
        self.directory = Path(directory)
        self.prefix = prefix
        self.keep = keep
        self._name_re = re.compile(rf"^{re.escape(prefix)}-(\d{{9,}}){re.escape(SUFFIX)}$")

    def __repr__(self) -> str:
        return f"CheckpointStore({str(self.directory)!r}, prefix={self.prefix!r}, keep={self.keep})"

    def path_for(self, step: int) -> Path:
        """The file a checkpoint of `step` is written to."""
        return self.directory / f"{self.prefix}-{step:09d}{SUFFIX}"

    def files(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint file present, oldest first (files are not verified)."""
        try:
            entries = list(self.directory.iterdir())
        except FileNotFoundError:
            return []
        found: list[tuple[int, Path]] = []
        for entry in entries:
            m = self._name_re.match(entry.name)
            if m:
                found.append((int(m.group(1)), entry))
        return sorted(found)

    def latest_step(self) -> int | None:
        """Step of the newest checkpoint file present (by name, not verified), or None."""
        found = self.files()
        return found[-1][0] if found else None

    def prefetch(self) -> threading.Thread | None:
        """Start reading the newest checkpoint file into the page cache on a thread of its own, and return at once (the
        thread, None when there is no file): a restart imports torch and builds its model meanwhile, then maps a file
        already in memory instead of waiting for the disk. Only a hint: nothing is loaded or checked, a failure is
        ignored (`load_tensors` reads and verifies the file as always)."""
        found = self.files()
        if not found:
            return None
        path = found[-1][1]

        def read() -> None:
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDONLY)
                try:
                    read_ahead(fd, 0, os.fstat(fd).st_size)
                finally:
                    os.close(fd)

        thread = threading.Thread(target=read, name="checkpoint-prefetch", daemon=True)
        thread.start()
        return thread

    def save(self, step: int, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> Path:
        """Write the checkpoint of `step` atomically, then delete all but the newest `keep`; return its path."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint step must be an int >= 0; got {step!r}")
        private_dirs(self.directory)
        clean_temp_files(self.directory, lambda target: self._name_re.match(target) is not None)
        latest = self.latest_step()
        if latest is not None and step < latest:
            logger.warning(
                "saving checkpoint step %d into %s which already holds step %d; the newer file stays the latest",
                step,
                self.directory,
                latest,
            )
        path = self.path_for(step)
        save_tensors(path, tensors, meta, mode=PRIVATE_FILE)
        self._prune(path)
        return path

    def _prune(self, just_saved: Path) -> None:
        found = [p for _, p in self.files()]
        others = [p for p in found if p != just_saved]
        excess = len(others) + (just_saved in found) - self.keep
        for old in others[: max(excess, 0)]:
            try:
                old.unlink()
            except FileNotFoundError:
                continue
            logger.debug("pruned checkpoint %s", old)

    def load_newest(
        self, check: Callable[[Path, dict[str, np.ndarray], dict[str, Any]], T]
    ) -> tuple[tuple[T, Path] | None, list[tuple[Path, str]]]:
        """The newest checkpoint that loads and that `check(path, tensors, meta)` takes (it returns what the caller
        keeps, or raises ValueError saying what is wrong): ((its result, path) or None when none does, [(path, what
        is wrong)] of every newer file that did not). Nothing is moved or removed."""
        unreadable: list[tuple[Path, str]] = []
        for _, path in reversed(self.files()):
            try:
                tensors, meta = load_tensors(path)
                return (check(path, tensors, meta), path), unreadable
            except CheckpointError as e:
                unreadable.append((path, problem(e, path)))
            except ValueError as e:
                unreadable.append((path, str(e)))
        return None, unreadable

    def load_or_set_aside(
        self, check: Callable[[Path, dict[str, np.ndarray], dict[str, Any]], T], aside: Path, what: str, fresh: str
    ) -> tuple[T, Path] | None:
        """load_newest for state that must never be lost: the newer files that do not load are moved to `aside`, an
        error line each, and when files exist and none loads, CheckpointError naming each and what is wrong, nothing
        moved (`what`: what the files are, "snapshots of ..."; `fresh`: what moving them away starts afresh)."""
        loaded, unreadable = self.load_newest(check)
        if loaded is None and unreadable:
            reasons = "; ".join(f"{path.name} {why}" for path, why in unreadable)
            raise CheckpointError(
                f"none of the {len(unreadable)} {what} in {self.directory} can be read ({reasons}); the PS does not "
                f"start, so that nothing is lost: restore one from a copy, or move them out of {self.directory} to "
                f"start {fresh}"
            )
        for path, why in unreadable:
            where = set_aside(path, aside)
            logger.error("%s %s; set aside as %s, the PS starts from an older one", path, why, where)
        return loaded

    def load_latest(self) -> tuple[dict[str, np.ndarray], dict[str, Any], Path] | None:
        """(tensors, meta, path) of the newest checkpoint that loads cleanly; corrupt files are skipped with a
        warning. None when the directory holds no loadable checkpoint."""
        loaded, unreadable = self.load_newest(lambda path, tensors, meta: (tensors, meta))
        for path, why in unreadable:
            logger.warning("skipping unreadable checkpoint %s (%s), trying an older one", path, why)
        if loaded is None:
            if unreadable:
                logger.warning("none of the %d checkpoint files in %s could be loaded", len(unreadable), self.directory)
            return None
        (tensors, meta), path = loaded
        return tensors, meta, path
