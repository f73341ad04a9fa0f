"""The state directory of a PS: snapshots (model, optimizer, residual, sessions), round journal, init files."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from geofed_hpc.ckpt import CheckpointStore, load_tensors
from geofed_hpc.errors import CheckpointError
from geofed_hpc.faults import fault
from geofed_hpc.log import logger
from geofed_hpc.ps.aggregate import Params
from geofed_hpc.ps.journal import Entry, RoundJournal
from geofed_hpc.rpc import messages as m

FORMAT = 1
_GROUPS = ("param", "momentum", "residual")


@dataclass
class PSState:
    """Everything a restarted PS needs; tensors go in as raw arrays, the rest as JSON (no pickle)."""

    version: int
    params: Params
    momentum: Params = field(default_factory=dict)
    residual: Params = field(default_factory=dict)
    sessions: list[dict[str, Any]] = field(default_factory=list)
    push_ids: list[list[Any]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    strategy: dict[str, Any] = field(default_factory=dict)  # what the aggregation strategy keeps (Strategy.state)


class Snapshots:
    """`global-{version}.gft` files in the state directory, written atomically; the newest two are kept.
    Lock: none; Persistence calls it, under the coordinator's lock."""

    def __init__(self, directory: Path, keep: int = 2) -> None:
        self.store = CheckpointStore(directory, prefix="global", keep=keep)

    def save(self, state: PSState) -> Path:
        tensors: dict[str, np.ndarray] = {}
        for group, arrays in zip(_GROUPS, (state.params, state.momentum, state.residual), strict=True):
            tensors.update({f"{group}/{k}": v for k, v in arrays.items()})
        meta = {
            "format": FORMAT,
            "version": state.version,
            "time": time.time(),
            "sessions": state.sessions,
            "push_ids": state.push_ids,
            "settings": state.settings,
            "strategy": state.strategy,
        }
        return self.store.save(state.version, tensors, meta)

    def load(self) -> tuple[PSState, Path] | None:
        """The newest snapshot that loads cleanly (a torn or corrupt newer file is skipped), or None."""
        loaded = self.store.load_latest()
        if loaded is None:
            return None
        tensors, meta, path = loaded
        if meta.get("format") != FORMAT or not isinstance(meta.get("version"), int):
            raise CheckpointError(f"snapshot {path} is not a geofed PS snapshot (format {meta.get('format')!r})")
        groups: dict[str, Params] = {g: {} for g in _GROUPS}
        for name, arr in tensors.items():
            group, _, key = name.partition("/")
            if group in groups:
                groups[group][key] = arr.astype(np.float32, copy=False)
        state = PSState(
            meta["version"],
            groups["param"],
            groups["momentum"],
            groups["residual"],
            list(meta.get("sessions", [])),
            list(meta.get("push_ids", [])),
            dict(meta.get("settings", {})),
            dict(meta.get("strategy", {})),
        )
        return state, path


class Persistence:
    """Owns the state directory (nothing at all without one): the snapshots of the whole PS, the journal of the
    open round (ps/journal.py), and which version the newest written snapshot holds (`snapshot_version`).

    Lock: none; not thread-safe. The coordinator's lock guards every call, so a snapshot sees one version's
    model, sessions and push ids together, and a journaled delta is on disk before its push is answered.
    """

    def __init__(self, directory: Path | None, stamp: dict[str, str]) -> None:
        self._snapshots = Snapshots(directory) if directory else None
        self._journal = RoundJournal(directory / "round") if directory else None
        self.stamp = stamp  # the settings each snapshot records; a snapshot of another "paradigm" is refused
        self.snapshot_version = -1

    @property
    def enabled(self) -> bool:
        """A state directory is set."""
        return self._snapshots is not None

    @property
    def journals(self) -> bool:
        """Deltas of an open round are journaled."""
        return self._journal is not None

    def load(self) -> tuple[PSState, Path] | None:
        """The newest snapshot that loads (None: none, or no state directory); CheckpointError when it holds a
        model of another paradigm than `stamp` says."""
        loaded = self._snapshots.load() if self._snapshots is not None else None
        if loaded is None:
            return None
        state, path = loaded
        theirs, ours = state.settings.get("paradigm", "identity"), self.stamp.get("paradigm", "identity")
        if theirs != ours:
            raise CheckpointError(
                f"the snapshot {path} holds a global model of paradigm {theirs}, this PS runs "
                f"{ours}: start it with the snapshot's paradigm, or use another ps.state_dir"
            )
        self.snapshot_version = state.version
        return loaded

    def save(self, state: PSState) -> bool:
        """Write a snapshot (stamped with `stamp`) atomically; a failure is logged, never fatal (the previous one
        stays loadable)."""
        if self._snapshots is None:
            return False
        state.settings = dict(self.stamp)
        try:
            path = self._snapshots.save(state)
        except (OSError, CheckpointError) as exc:
            logger.error("snapshot of version %d failed (the previous one stays loadable): %s", state.version, exc)
            return False
        self.snapshot_version = state.version
        logger.debug("snapshot of version %d written to %s", state.version, path)
        fault("ps.snapshot", str(state.version))
        return True

    def record(self, staged: Path, header: m.PushHeader, site: str, version: int) -> None:
        """Journal a delta admitted to the round open at `version` (its staged payload, fsynced already), before
        its push is answered. OSError: it could not be made durable (the caller refuses the push)."""
        if self._journal is not None:
            self._journal.record(staged, header, site, version)

    def replay(
        self,
        version: Callable[[], int | None],
        known: Callable[[str], bool],
        fold: Callable[[Entry], None],
        close: Callable[[], None],
    ) -> int:
        """After a restart: the journaled deltas since the snapshot, in admission order, folded again (`fold`) into
        the rounds they joined, each round closed (`close`) where the next one began, so the PS reaches the
        versions it had made. `version()`: the model's now (None: no model). Entries the snapshot holds, of another
        model, or of pushes already `known` are dropped; one that cannot be replayed (`fold` fails: a changed
        config, say) is set aside with a message, and the PS starts. How many were folded."""
        if self._journal is None:
            return 0
        start, replayed = version(), 0
        for entry in self._journal.entries():
            now = version()
            if now is None or start is None or entry.version < start or known(entry.header.push_id):
                self._journal.drop(entry)  # its round is in the snapshot, or there is no model it belongs to
                continue
            if entry.version == now + 1:
                close()  # the round open at `now` closed before the restart: this entry joined the next one
                now = version()
            if entry.version != now:
                self._set_aside(entry, f"it joined the round of version {entry.version}, the model is at {now}")
                continue
            try:
                fold(entry)
            except Exception as exc:  # noqa: BLE001 - whatever it is, the PS must start
                self._set_aside(entry, f"{type(exc).__name__}: {exc}")
                continue
            replayed += 1
        if replayed:
            logger.info(
                "journal replayed: %d delta(s) since snapshot version %s; now at version %s", replayed, start, version()
            )
        return replayed

    def _set_aside(self, entry: Entry, why: str) -> None:
        assert self._journal is not None
        where = self._journal.set_aside(entry)
        logger.error(
            "journaled push %s from %s (round of version %d) cannot be replayed (%s): set aside as %s; the PS "
            "starts without it",
            entry.header.push_id[:8],
            entry.site,
            entry.version,
            why,
            where,
        )

    def forget_before(self, version: int) -> None:
        """A snapshot holds `version`: the journaled rounds before it are in it."""
        if self._journal is not None and self.snapshot_version == version:
            self._journal.drop_before(version)

    def drop_round(self, version: int) -> None:
        """The round open at `version` was refused (its update was not finite): its entries go too."""
        if self._journal is None:
            return
        for entry in self._journal.entries():
            if entry.version == version:
                self._journal.drop(entry)

    def clear_journal(self) -> None:
        """A new model was seeded: no open round from before it."""
        if self._journal is not None:
            self._journal.clear()


def load_init(path: Path) -> tuple[Params, int]:
    """Θ0 and its version from a PS snapshot (`param/*`), a site checkpoint (`model/*`) or a plain tensor file."""
    tensors, meta = load_tensors(Path(path).expanduser())
    for prefix in ("param/", "model/"):
        picked = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if picked:
            break
    else:
        picked = dict(tensors)
    params: Params = {}
    for name, arr in picked.items():
        if arr.dtype.kind != "f":
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {arr.dtype}; a model holds float tensors only")
        if not np.isfinite(arr).all():
            raise CheckpointError(f"{path}: tensor {name!r} holds NaN or Inf; refusing to seed the federation")
        params[name] = arr.astype(np.float32, copy=False)
    if not params:
        raise CheckpointError(f"{path}: holds no tensors to seed the global model with")
    version = meta.get("version", 0)
    version = version if isinstance(version, int) and version >= 0 else 0
    logger.info("read %d tensors (version %d) from %s", len(params), version, path)
    return params, version
