"""The state directory of a PS: snapshots (model, optimizer, residual, sessions), round journal, init files."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from geofed_hpc.ckpt import CheckpointStore, load_tensors
from geofed_hpc.errors import CheckpointError
from geofed_hpc.faults import fault
from geofed_hpc.log import logger
from geofed_hpc.ps.aggregate import Params
from geofed_hpc.ps.journal import Entry, RoundJournal
from geofed_hpc.ps.remote import RemoteState
from geofed_hpc.rpc import messages as m

FORMAT = 1
_GROUPS = ("param", "momentum", "residual")
SET_ASIDE = "set-aside"  # <state_dir>/set-aside/: snapshots that could not be read, kept for the operator


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
    """`global-{version}.gft` files in the state directory, written atomically, mode 0600; the newest two are kept.
    One that cannot be read is never removed: set aside when an older one loads, and the PS refuses to start when
    none does. Lock: none; Persistence calls it, under the coordinator's lock."""

    def __init__(self, directory: Path, keep: int = 2) -> None:
        self.store = CheckpointStore(directory, prefix="global", keep=keep)
        self.aside = directory / SET_ASIDE

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
        """The newest snapshot that loads and whose fields are well-formed (None: there is none). Newer ones that do
        not are set aside with an error line each; when snapshots exist and none loads, CheckpointError naming each
        and what is wrong, and nothing is moved."""
        fresh = "with no model (its journal is then set aside, not replayed)"
        return self.store.load_or_set_aside(_state, self.aside, "snapshot(s)", fresh)


def _state(path: Path, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> PSState:
    """A snapshot's state once its meta fields are checked (ValueError naming the first that is not well-formed)."""
    if meta.get("format") != FORMAT:
        raise ValueError(f"is not a geofed PS snapshot (meta field 'format' is {meta.get('format')!r}, not {FORMAT})")
    version = meta.get("version")
    if not _count(version):
        raise ValueError(f"has a malformed meta field 'version' ({version!r}, not an int >= 0)")
    sessions = _field(meta, "sessions", list)
    for i, row in enumerate(sessions):
        if not isinstance(row, dict) or not isinstance(row.get("id"), str):
            raise ValueError(f"has a malformed meta field 'sessions' (row {i} is not an object with a string 'id')")
    push_ids = _field(meta, "push_ids", list)
    for i, row in enumerate(push_ids):
        ok = isinstance(row, list) and len(row) == 5 and isinstance(row[0], str) and isinstance(row[1], bool)
        if not (ok and _count(row[2]) and isinstance(row[3], str) and _count(row[4])):
            shape = "[push id, accepted, version, reason, staleness]"
            raise ValueError(f"has a malformed meta field 'push_ids' (row {i} is not {shape})")
    settings = _field(meta, "settings", dict)
    if not all(isinstance(v, str) for v in settings.values()):
        raise ValueError("has a malformed meta field 'settings' (an object of strings expected)")
    strategy = _field(meta, "strategy", dict)
    for key, values in strategy.items():
        if not isinstance(values, list) or not all(_number(v) for v in values):
            raise ValueError(f"has a malformed meta field 'strategy' ({key!r} is not a list of finite numbers)")
    groups: dict[str, Params] = {g: {} for g in _GROUPS}
    for name, arr in tensors.items():
        group, _, key = name.partition("/")
        if group in groups:
            if arr.dtype.kind != "f":
                raise ValueError(f"has tensor {name!r} of dtype {arr.dtype}, not a float")
            groups[group][key] = arr.astype(np.float32, copy=False)
    if not groups["param"]:
        raise ValueError("holds no model tensors (param/*)")
    return PSState(
        version, groups["param"], groups["momentum"], groups["residual"], sessions, push_ids, settings, strategy
    )


def _field(meta: dict[str, Any], name: str, kind: type) -> Any:
    """A meta field of type `kind` (empty when a snapshot of an older version has none)."""
    value = meta.get(name, kind())
    if not isinstance(value, kind):
        raise ValueError(f"has a malformed meta field {name!r} ({type(value).__name__}, not a {kind.__name__})")
    return value


def _count(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Persistence:
    """Owns the state directory (nothing at all without one): the snapshots of the whole PS, the journal of the
    open round (ps/journal.py), and which version the newest written snapshot holds (`snapshot_version`).

    Lock: none; not thread-safe. The coordinator's lock guards every call, so a snapshot sees one version's
    model, sessions and push ids together, and a journaled delta is on disk before its push is answered.
    """

    def __init__(self, directory: Path | None, stamp: dict[str, str], remote: RemoteState | None = None) -> None:
        self._snapshots = Snapshots(directory) if directory else None
        self._remote = remote  # ps.state_dir on object storage: `directory` is its working folder (ps/remote.py)
        journal = remote.journal if remote is not None else RoundJournal
        self._journal = journal(directory / "round") if directory else None
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
        """The newest snapshot that loads (None: none, or no state directory); CheckpointError when snapshots exist
        and none loads, or when it holds a model of another paradigm than `stamp` says. Without a snapshot, the
        journal's entries (a model's that is not here) are set aside."""
        loaded = self._snapshots.load() if self._snapshots is not None else None
        if loaded is None:
            self._set_aside_all()
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
            if self._remote is not None:
                self._remote.commit(path, state.version)
        except (OSError, CheckpointError) as exc:
            logger.error("snapshot of version %d failed (the previous one stays loadable): %s", state.version, exc)
            return False
        self.snapshot_version = state.version
        logger.debug("snapshot of version %d written to %s", state.version, path)
        fault("ps.snapshot", str(state.version))
        return True

    def settle(self) -> None:
        """With the state on object storage: wait for the snapshot upload in flight (it runs off the lock)."""
        if self._remote is not None:
            self._remote.settle()

    def keep(self) -> None:
        """With the state on object storage: upload the token records that changed here."""
        if self._remote is not None:
            self._remote.keep()

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
        versions it had made. `version()`: the model's now (None: no model). Entries the snapshot holds, or of pushes
        already `known`, are dropped; one with no model to fold into, or that cannot be replayed (`fold` fails: a
        changed config, say), is set aside with a message, and the PS starts. How many were folded."""
        if self._journal is None:
            return 0
        start, replayed = version(), 0
        for entry in self._journal.entries():
            now = version()
            if now is None or start is None:
                self._set_aside(entry, "there is no model to fold it into")
                continue
            if entry.version < start or known(entry.header.push_id):
                self._journal.drop(entry)  # its round is in the snapshot, or its push is remembered there
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

    def _set_aside_all(self) -> None:
        """No snapshot: the journaled deltas belong to a model that is not here (moved away?); kept, never replayed."""
        if self._journal is None:
            return
        entries = self._journal.entries()
        for entry in entries:
            self._journal.set_aside(entry)
        if entries:
            logger.error(
                "the round journal holds %d delta(s) but there is no snapshot to fold them into: set aside in %s; "
                "the PS starts with no model",
                len(entries),
                self._journal.aside,
            )

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
