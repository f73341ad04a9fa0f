"""A PS state directory on object storage: a local working folder, written through to `ps.state_dir=s3://...`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from geofed_hpc.ckpt.atomic import set_aside
from geofed_hpc.ckpt.objects import Retry, Store, file_chunks, is_remote, local_path, open_store
from geofed_hpc.ckpt.tensorfile import SUFFIX
from geofed_hpc.config import PSConfig
from geofed_hpc.errors import CheckpointError, StoreError
from geofed_hpc.log import logger
from geofed_hpc.ps.journal import RoundJournal

MANIFEST = "manifest.json"
SNAPSHOTS = "snapshots/"
ROUND = "round/"
ASIDE = "round/set-aside/"
ASIDE_DIR = "set-aside"  # in the working folder: what it held that the store does not (ps/persist.py's too)
KEPT_FILES = ("tokens.json", "auth.json")  # the token records (admin.token stays on the machine that made it)
FORMAT = 1
KEEP = 2  # snapshots the manifest names, newest first (as on disk)
UPLOADS = ".upload"  # in the working folder: links to the snapshots being uploaded (local pruning cannot take them)
CACHE = Path("~/.geofed/ps/cache")


def local_state(cfg: PSConfig) -> Path | None:
    """The local folder of a PS's state: `ps.state_dir` itself, or for an s3:// URL its working folder
    (`ps.state_cache`, or ~/.geofed/ps/cache/<bucket>/<prefix>); None without a state directory."""
    if not cfg.state_dir:
        return None
    if not is_remote(cfg.state_dir):
        return local_path(cfg.state_dir)
    if cfg.state_cache:
        return Path(cfg.state_cache).expanduser()
    return CACHE.expanduser() / cfg.state_dir[len("s3://") :].strip("/")


def remote_state(cfg: PSConfig, local: Path | None) -> RemoteState | None:
    """The object store behind `local` when `ps.state_dir` is a URL (None: a plain folder, as always)."""
    if local is None or not is_remote(cfg.state_dir):
        return None
    return RemoteState(open_store(cfg.state_dir, Retry(), "ps.state_dir"), local)


class RemoteState:
    """The store is the truth, the working folder a copy the PS's code reads and writes as it always did.

    At start (`pull`) the folder is made to hold what the store holds: the snapshots `manifest.json` names (each
    checked against the size and SHA-256 the manifest records), the round journal's entries and the token records;
    snapshots and entries it held that the store does not (never committed) are set aside in its set-aside/.
    Then every change that must outlive the machine is written through: a journaled delta is uploaded (payload,
    then its header) before its push is answered (`RemoteJournal`); changed token records are uploaded at start
    and at each tick (`keep`). A snapshot is uploaded on a thread of its own, off the PS's lock (`commit` only hands
    it over; at most one upload in flight, a newer snapshot supersedes one not yet started), then the manifest naming
    it is replaced: a reader sees the old snapshot or the new one, never half of one. Until that manifest is up, the
    store keeps every journal entry since the snapshot it names, so a PS killed at any point is continued elsewhere
    at the same versions; the entries a committed snapshot holds are removed after it (`defer`). Staging, the
    downlink's updates and locks stay local: what a new machine does not need.

    Lock: `_cond` guards the upload hand-over (`_pending`, `_deferred`, `_thread`, `committed`); the coordinator's
    lock guards every other call."""

    def __init__(self, store: Store, local: Path) -> None:
        self.store = store
        self.local = local
        self.url = store.url
        self._kept: dict[str, tuple[int, int]] = {}  # what `keep` uploaded last: (size, mtime_ns) per file
        self._cond = threading.Condition()
        self._pending: tuple[Path, int] | None = None  # the staged snapshot the thread uploads next, its version
        self._deferred: list[tuple[str, int]] = []  # journal entries to remove from the store once a snapshot of
        # at least that version is committed
        self._thread: threading.Thread | None = None
        self.committed = -1  # the version of the newest snapshot this PS committed to the store
        self.superseded = 0
        self.seeded = False  # the journal was cleared: the next snapshot alone holds the model (uploaded at once)
        shutil.rmtree(local / UPLOADS, ignore_errors=True)  # links a killed PS left

    # ---------------------------------------------------------------- start
    def pull(self) -> None:
        """Make the working folder hold what the store holds (module docstring); CheckpointError when the manifest
        names snapshots and none of them is intact."""
        listing = self.store.listing()
        named = self._manifest(listing)
        wanted = {Path(row["key"]).name for row in named}
        for old in self.local.glob(f"global-*{SUFFIX}"):
            if old.name not in wanted:  # written here, never committed (or a folder of another state): kept aside
                logger.warning(
                    "%s is not in %s: set aside as %s", old, self.url, set_aside(old, self.local / ASIDE_DIR)
                )
        problems: list[str] = []
        for row in named:
            try:
                self._fetch_snapshot(row, listing)
            except (StoreError, ValueError) as exc:
                problems.append(str(exc))
                logger.error("%s", exc)
        if named and len(problems) == len(named):
            raise CheckpointError(
                f"{self.store.where(MANIFEST)} names {len(named)} snapshot(s) and none is intact ({problems[0]}): "
                "restore them from a copy, or point ps.state_dir at a new URL to start afresh"
            )
        self._pull_journal(listing)
        for name in KEPT_FILES:
            if name in listing:
                self.store.get_file(name, self.local / name)
                self._kept[name] = _stamp(self.local / name)
        logger.info("state of %s pulled into %s (%d snapshot(s))", self.url, self.local, len(named) - len(problems))

    def _manifest(self, listing: dict[str, int]) -> list[dict[str, Any]]:
        if MANIFEST not in listing:
            if any(key.startswith(SNAPSHOTS) for key in listing):
                logger.warning("%s holds snapshots but no manifest: none was committed; starting without", self.url)
            return []
        where = self.store.where(MANIFEST)
        try:
            raw = json.loads(self.store.get(MANIFEST))
        except ValueError as exc:
            raise CheckpointError(f"{where}: not JSON ({exc}); restore it from a copy") from None
        ok = isinstance(raw, dict) and raw.get("format") == FORMAT and isinstance(raw.get("snapshots"), list)
        if not ok:
            raise CheckpointError(f"{where}: not a geofed state manifest (format {FORMAT}); restore it from a copy")
        if raw.get("url") != self.url:
            raise CheckpointError(
                f"{where} was written for the state of {raw.get('url')!r}, not {self.url} (copied from another "
                f"run?): point ps.state_dir at {raw.get('url')}, or remove {where} to start this one afresh"
            )
        rows = raw["snapshots"]
        for row in rows:
            good = isinstance(row, dict) and isinstance(row.get("key"), str) and row["key"].startswith(SNAPSHOTS)
            if not (good and isinstance(row.get("bytes"), int) and isinstance(row.get("sha256"), str)):
                raise CheckpointError(f"{where}: malformed snapshot row {row!r}; restore it from a copy")
        return rows

    def _fetch_snapshot(self, row: dict[str, Any], listing: dict[str, int]) -> None:
        """One snapshot the manifest names into the working folder, checked (ValueError/StoreError: it is not)."""
        key, size = row["key"], row["bytes"]
        where, target = self.store.where(key), self.local / Path(key).name
        if target.exists() and target.stat().st_size == size and _sha256(target) == row["sha256"]:
            return  # the copy of a restart on the same machine
        if key not in listing:
            raise StoreError(f"{where}: missing, though {MANIFEST} names it; restore it from a copy")
        if listing[key] != size:
            raise ValueError(
                f"{where} is truncated or replaced: {listing[key]} bytes, the manifest says {size}; restore it"
            )
        self.store.get_file(key, target)
        if _sha256(target) != row["sha256"]:
            target.unlink()
            raise ValueError(f"{where} is not the snapshot the manifest names (another run's, or overwritten)")

    def _pull_journal(self, listing: dict[str, int]) -> None:
        folder = self.local / ROUND.rstrip("/")
        names = {k[len(ROUND) :] for k in listing if k.startswith(ROUND) and "/" not in k[len(ROUND) :]}
        complete = {n[: -len(".json")] for n in names if n.endswith(".json")} & {
            n[: -len(".push")] for n in names if n.endswith(".push")
        }
        for name in names:
            if name[: name.rindex(".")] not in complete:  # a payload whose header never landed: never acknowledged
                self.store.delete(ROUND + name)
        if folder.is_dir():
            for path in folder.iterdir():  # journaled here, never uploaded: never acknowledged; kept aside
                if path.suffix in (".json", ".push") and path.stem not in complete:
                    set_aside(path, self.local / ASIDE_DIR)
        for stem in sorted(complete):
            for suffix in (".push", ".json"):
                target, key = folder / f"{stem}{suffix}", f"{ROUND}{stem}{suffix}"
                if not (target.exists() and target.stat().st_size == listing[key]):
                    self.store.get_file(key, target)

    # ---------------------------------------------------------------- while running
    def commit(self, path: Path, version: int) -> None:
        """Hand the snapshot just written at `path` to the uploading thread (a link to it, so that local pruning
        cannot take it) and return at once; a pending one not yet started is superseded. The first snapshot after
        the journal was cleared (a model seeded: nothing else holds it) is uploaded here, before this returns."""
        if self.seeded:
            self.settle()
            self._upload(path, version)  # StoreError: the caller logs it; the seed is not answered as durable
            self.seeded = False
            return
        staged = self.local / UPLOADS / path.name
        staged.parent.mkdir(mode=0o700, exist_ok=True)
        staged.unlink(missing_ok=True)
        os.link(path, staged)
        with self._cond:
            if self._pending is not None:
                self.superseded += 1
                self._pending[0].unlink(missing_ok=True)
            self._pending = (staged, version)
            if self._thread is None:  # not a daemon: a PS that exits finishes the upload first
                self._thread = threading.Thread(target=self._uploads, name="ps-snapshot-upload")
                self._thread.start()

    def defer(self, stem: str, version: int) -> None:
        """Remove journal entry `stem` from the store once a snapshot of `version` or later is committed."""
        with self._cond:
            self._deferred.append((stem, version))

    def settle(self, wait: timedelta = timedelta(minutes=10)) -> bool:
        """Wait, at most `wait`, for the snapshot upload in flight or pending; whether none is left."""
        deadline = time.monotonic() + wait.total_seconds()
        with self._cond:
            while self._thread is not None and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.01, deadline - time.monotonic()))
            done = self._thread is None
        if not done:
            logger.error("the snapshot upload to %s did not finish within %s", self.url, wait)
        return done

    def _uploads(self) -> None:
        while True:
            with self._cond:
                job, self._pending = self._pending, None
                if job is None:
                    self._thread = None
                    self._cond.notify_all()
                    return
            staged, version = job
            try:
                self._upload(staged, version)
            except Exception as exc:  # noqa: BLE001 - the thread must go on: the next snapshot is tried
                logger.error(
                    "snapshot of version %d could not be uploaded (%s keeps the one before and the journal since): %s",
                    version,
                    self.url,
                    exc,
                )
            finally:
                staged.unlink(missing_ok=True)

    def _upload(self, path: Path, version: int) -> None:
        """Upload a snapshot, then replace the manifest so that it names it (and the one before), then remove the
        snapshots no manifest names and the journal entries it holds. StoreError: the manifest names the old ones."""
        key, digest = SNAPSHOTS + path.name, hashlib.sha256()

        def hashed() -> Iterator[bytes]:
            for chunk in file_chunks(path):
                digest.update(chunk)
                yield chunk

        self.store.put(key, hashed())
        row = {"key": key, "version": version, "bytes": path.stat().st_size, "sha256": digest.hexdigest()}
        try:
            old = json.loads(self.store.get(MANIFEST)).get("snapshots", [])
        except (StoreError, ValueError, AttributeError):
            old = []
        rows = [row, *[r for r in old if isinstance(r, dict) and r.get("key") != key]][:KEEP]
        manifest = {"format": FORMAT, "url": self.url, "snapshots": rows}
        self.store.put(MANIFEST, json.dumps(manifest, indent=1).encode())
        with self._cond:
            self.committed = max(self.committed, version)
            done = [stem for stem, v in self._deferred if v <= self.committed]
            self._deferred = [(stem, v) for stem, v in self._deferred if v > self.committed]
        logger.debug("snapshot of version %d committed to %s", version, self.url)
        named = {r["key"] for r in rows}
        for stale in self.store.listing(SNAPSHOTS):
            if stale not in named:
                self.store.delete(stale)
        for stem in done:
            _forget(self.store, stem)

    def keep(self) -> None:
        """Upload the token records that changed here since the last upload or pull (a failure is logged and tried
        again at the next call)."""
        for name in KEPT_FILES:
            path = self.local / name
            if not path.is_file() or self._kept.get(name) == _stamp(path):
                continue
            try:
                self.store.put(name, path.read_bytes())
                self._kept[name] = _stamp(path)
            except OSError as exc:
                logger.error("could not upload %s (tried again later): %s", name, exc)

    def journal(self, directory: Path) -> RemoteJournal:
        return RemoteJournal(directory, self.store, self)


class RemoteJournal(RoundJournal):
    """The round journal, each entry written through to `round/` of the store before its push is answered; an
    entry dropped or set aside here is dropped or set aside there (one a snapshot holds, once that snapshot is
    committed to the store: `RemoteState.defer`)."""

    def __init__(self, directory: Path, store: Store, state: RemoteState | None = None) -> None:
        super().__init__(directory)
        self.store = store
        self._state = state
        self._snapshot: int | None = None  # inside drop_before: the version of the snapshot that holds the entries

    def drop_before(self, version: int) -> int:
        self._snapshot = version
        try:
            return super().drop_before(version)
        finally:
            self._snapshot = None

    def _durable(self, name: str) -> None:
        try:
            self.store.put(f"{ROUND}{name}.push", (self.directory / f"{name}.push").read_bytes())
            self.store.put(f"{ROUND}{name}.json", (self.directory / f"{name}.json").read_bytes())
        except OSError:
            self._remove(name)  # not acknowledged: no copy of it may be replayed (a payload left there goes at pull)
            raise

    def _remove(self, stem: str) -> None:
        super()._remove(stem)
        if self._snapshot is not None and self._state is not None:
            self._state.defer(stem, self._snapshot)  # the store keeps it until that snapshot is there
        else:
            self._forget(stem)

    def _forget(self, stem: str) -> None:
        _forget(self.store, stem)

    def _move_aside(self, stem: str) -> Path:
        for suffix in (".push", ".json"):
            path = self.directory / f"{stem}{suffix}"
            if path.exists():
                try:
                    self.store.put(f"{ASIDE}{stem}{suffix}", path.read_bytes())
                except OSError as exc:
                    logger.warning("could not keep journal entry %s in %s: %s", stem, ASIDE, exc)
        self._forget(stem)
        return super()._move_aside(stem)

    def clear(self) -> None:
        for path in self.directory.glob("*.json"):
            self._forget(path.stem)
        super().clear()
        if self._state is not None:
            self._state.seeded = True


def _forget(store: Store, stem: str) -> None:
    """Remove journal entry `stem` from the store, its header first: a payload alone is never replayed."""
    for suffix in (".json", ".push"):
        try:
            store.delete(f"{ROUND}{stem}{suffix}")
        except OSError as exc:  # its round is in a snapshot: a restart drops it then
            logger.warning("could not remove journal entry %s from the store: %s", stem, exc)


def _stamp(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    for chunk in file_chunks(path):
        digest.update(chunk)
    return digest.hexdigest()
