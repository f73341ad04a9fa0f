"""A site's checkpoints mirrored to object storage in the background, and a purged site's resume from the mirror."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from geofed_hpc.ckpt.atomic import PRIVATE_FILE, atomic_write_bytes, private_dirs
from geofed_hpc.ckpt.objects import Retry, Store, file_chunks, open_store
from geofed_hpc.errors import CheckpointError, StoreError
from geofed_hpc.faults import fault
from geofed_hpc.log import logger

MANIFEST = "mirror.json"
OBJECTS = "ckpt/"
FORMAT = 1
KEEP = 2  # checkpoints the manifest names, newest first
PUSHES = "pushes/"  # the record of each push, written before the push goes out: pushes/<syncs after it>.json
KEEP_PUSHES = 16  # the newest records kept: a purged site finds how far its applied work reached among them
LOG_WAIT = timedelta(seconds=5)  # the longest a push waits for its record to reach the mirror
STAGING = ".mirror"  # in the checkpoint folder: links to the files being uploaded (local pruning cannot take them)
SETTING = "train.checkpoint_mirror"


@dataclass
class Upload:
    """One checkpoint to mirror: its file, the files of its shard folder (multi-rank sites), and the record of the
    push that went out after it (push.json), once there is one."""

    path: Path
    shards: str = ""
    push: dict[str, Any] | None = None
    staged: Path | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)  # the objects once uploaded
    problem: str = ""  # why it could not be staged


class CheckpointMirror:
    """Mirrors the checkpoints of one site to `<url>/<site>` on a thread of its own; training never waits for it.

    Layout there: `ckpt/<stamp>/<file>` (each upload under a fresh stamp, so an object a manifest names is never
    overwritten), the shard folder's files beside it, and `mirror.json`, written last, naming the newest complete
    checkpoints (key, size, SHA-256 of every object) and the push record of the newest: a reader sees the previous
    mirror or the new one, never half of one. Objects no manifest names are removed after each commit. Beside them,
    `pushes/<syncs>.json`: the record of each push, written before it goes out (`log_push`), the newest kept.

    At most one upload is in flight; a checkpoint submitted meanwhile waits, and a newer one supersedes it before it
    starts. A push record (`push`) belongs to the newest checkpoint submitted: it rides in that checkpoint's manifest
    (a manifest alone is written again when the checkpoint is up already). A failed upload is logged and the next
    checkpoint tried; the mirror then lags, never holds half a checkpoint. The thread is not a daemon and ends when
    nothing is left: a job that ends normally finishes its last upload before the interpreter exits; a stopping job
    (which leaves with os._exit) waits for it briefly once its local checkpoint is on disk (`settle`, called by
    SiteCheckpoints.leave). Neither `submit` and `push` (the checkpoint writer's thread calls them) nor the uploading
    thread while anyone may wait for it log: a signal handler may wait while it holds the log's lock; what they have
    to say is logged by `notes` and `settle`, on the caller's thread.

    Lock: `_cond` guards `_latest`, `_done`, `_done_push`, `_thread`, `_logging` and the counters; uploads run
    without it."""

    def __init__(self, url: str, site: str, directory: Path, retry: Retry | None = None) -> None:
        self.url = f"{url.rstrip('/')}/{site}"
        self.site = site
        self.store: Store = open_store(self.url, retry or Retry(), SETTING)
        self._log_store: Store = open_store(self.url, Retry(attempts=2, total=LOG_WAIT), SETTING)
        self._logging = True  # push records go to the mirror (False after one failed, until an upload succeeds)
        self.directory = directory
        shutil.rmtree(directory / STAGING, ignore_errors=True)  # links a killed job left
        self._cond = threading.Condition()
        self._latest: Upload | None = None  # the newest submitted
        self._done: Upload | None = None  # the newest whose manifest is up
        self._done_push: dict[str, Any] | None = None
        self._busy: Upload | None = None  # the one being uploaded
        self._thread: threading.Thread | None = None
        self.uploaded = 0  # checkpoints committed to the mirror since the job started
        self.superseded = 0  # submitted, replaced by a newer one before their upload began
        self.failed = 0
        self._notes: list[tuple[int, str]] = []  # what the thread has to say, logged by `notes` (see above)

    # ---------------------------------------------------------------- the training side (never waits)
    def submit(self, path: Path, shards: str = "") -> None:
        """Mirror the checkpoint just written at `path` (and its shard folder `shards`, relative to its folder)."""
        upload = Upload(path, shards)
        try:
            upload.staged = self._stage(path, shards)
        except OSError as exc:  # linking failed: the upload reads the files in place (said by the thread)
            upload.problem = f"cannot stage {path} for the mirror ({exc}); uploading it in place"
        with self._cond:
            old = self._latest
            if old is not None and old is not self._done and old is not self._busy and not old.rows:
                self.superseded += 1
                self._discard(old)
            self._latest = upload
            self._kick()

    def push(self, record: dict[str, Any]) -> None:
        """The record of a push that went out after the newest submitted checkpoint (push.json's content)."""
        with self._cond:
            if self._latest is None:
                return  # no checkpoint yet: a resume starts afresh and nothing is skipped
            self._latest.push = dict(record)
            self._kick()

    def log_push(self, record: dict[str, Any]) -> None:
        """Write the record of a push about to go out (push.json's content) to the mirror now, on the caller's
        thread, under its count of syncs: a purged site whose newest mirrored checkpoint lags several pushes behind
        finds them all, asks the PS which it applied, and trains none of them again. The push waits for it, at most
        LOG_WAIT; once the store failed one, records are skipped until an upload succeeds again (a store that is
        down never holds every sync), and `notes` says so."""
        with self._cond:
            if not self._logging:
                return
        try:
            self._log_store.put(f"{PUSHES}{int(record['syncs']):09d}.json", json.dumps(record).encode())
        except OSError as exc:  # StoreError is one
            with self._cond:
                self._logging = False
            self._note(logging.WARNING, f"{self.site}: push records no longer reach the mirror {self.url} until it "
                       f"takes an upload again ({exc}); purged before then, this site may train the pushes since "
                       "its newest mirrored checkpoint again")  # fmt: skip

    def settle(self, wait: timedelta = timedelta(seconds=60)) -> bool:
        """Wait (at most `wait`) until the newest checkpoint and push record are in the mirror; whether they are."""
        deadline = time.monotonic() + wait.total_seconds()
        with self._cond:
            while self._thread is not None and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.01, deadline - time.monotonic()))
            settled = self._thread is None
        self.notes()
        if not settled:
            logger.warning("%s: the mirror %s is still uploading after %s; it goes on until the job exits", self.site,
                           self.url, wait)  # fmt: skip
        return settled

    def check(self) -> None:
        """Reach the mirror at start (StoreError: bucket, credentials, network; CheckpointError: not this site's),
        rather than find out from the first upload in the background."""
        _manifest(self.store, self.site)

    def notes(self) -> None:
        """Log what the uploading thread had to say since the last call."""
        with self._cond:
            notes, self._notes = self._notes, []
        for level, line in notes:
            logger.log(level, "%s", line)

    def _note(self, level: int, line: str) -> None:
        with self._cond:
            self._notes.append((level, line))

    def _kick(self) -> None:
        if self._thread is None:
            # not a daemon: a job that ends normally finishes the upload before the interpreter exits
            self._thread = threading.Thread(target=self._run, name=f"{self.site}-checkpoint-mirror")
            self._thread.start()

    # ---------------------------------------------------------------- the uploading thread
    def _run(self) -> None:
        while True:
            with self._cond:
                job = self._latest
                idle = job is None or (job is self._done and job.push == self._done_push)
                if idle:
                    self._thread = None
                    self._cond.notify_all()  # a waiter is released before this thread logs anything
                else:
                    assert job is not None
                    push, self._busy = job.push, job
            if idle:
                self.notes()  # at the end of a job nobody may call `notes` again
                return
            assert job is not None
            if job.problem:
                self._note(logging.WARNING, f"{self.site}: {job.problem}")
                job.problem = ""
            try:
                self._upload(job, push)
            except (OSError, CheckpointError, ValueError) as exc:
                self._note(logging.ERROR, f"{self.site}: mirroring {job.path.name} to {self.url} failed (the mirror "
                           f"keeps the one before): {exc}")  # fmt: skip
                with self._cond:
                    self.failed += 1
                    self._busy = None
                    if self._latest is job:  # tried again only with the next checkpoint or push record
                        self._done, self._done_push = job, push
                    self._discard(job)
                continue
            with self._cond:
                self._logging = True
                self.uploaded += self._done is not job
                self._done, self._done_push, self._busy = job, push, None
                self._discard(job)  # its objects are up: a manifest written again needs no file
                self._cond.notify_all()

    def _upload(self, job: Upload, push: dict[str, Any] | None) -> None:
        if not job.rows:
            stamp = f"{OBJECTS}{time.time_ns():020d}/"
            source = job.staged or job.path.parent
            rows = []
            if job.shards:  # the shards first, then the file that names them
                for path in sorted(p for p in (source / job.shards).rglob("*") if p.is_file()):
                    rows.append(self._put(stamp + path.relative_to(source).as_posix(), path))
            rows.insert(0, self._put(stamp + job.path.name, source / job.path.name))
            job.rows = rows
        self._commit(job, push)

    def _put(self, key: str, path: Path) -> dict[str, Any]:
        digest = hashlib.sha256()

        def hashed() -> Any:
            for chunk in file_chunks(path):
                digest.update(chunk)
                yield chunk

        fault("mirror.put", key)
        self.store.put(key, hashed())
        return {"key": key, "bytes": path.stat().st_size, "sha256": digest.hexdigest()}

    def _commit(self, job: Upload, push: dict[str, Any] | None) -> None:
        """Name `job` (and the newest checkpoint before it) in the manifest, then drop objects none names."""
        entry = {"file": job.path.name, "shards": job.shards, "objects": job.rows, "push": push}
        try:
            old = _manifest(self.store, self.site).get("checkpoints", [])
        except (StoreError, CheckpointError):
            old = []
        rows = [entry, *[r for r in old if r.get("objects") != job.rows]][:KEEP]
        for row in rows[1:]:
            row["push"] = None  # a push record follows only the newest checkpoint
        manifest = {"format": FORMAT, "site": self.site, "checkpoints": rows}
        fault("mirror.manifest", job.path.name)
        self.store.put(MANIFEST, json.dumps(manifest, indent=1).encode())
        named = {o["key"] for row in rows for o in row["objects"]}
        stale = [key for key in self.store.listing(OBJECTS) if key not in named]
        stale += sorted(self.store.listing(PUSHES))[:-KEEP_PUSHES]  # zero-padded: oldest first
        for key in stale:
            with contextlib.suppress(StoreError):
                self.store.delete(key)
        self._note(logging.DEBUG, f"{self.site}: checkpoint {job.path.name} mirrored to {self.url}")

    # ---------------------------------------------------------------- staging
    def _stage(self, path: Path, shards: str) -> Path:
        """Hard links to the checkpoint's files under .mirror/<stamp>/ (pruning the originals leaves them)."""
        folder = private_dirs(self.directory / STAGING) / f"{time.time_ns():020d}"
        folder.mkdir()
        try:
            os.link(path, folder / path.name)
            if shards:
                for src in (path.parent / shards).rglob("*"):
                    if src.is_file():
                        target = folder / src.relative_to(path.parent)
                        target.parent.mkdir(parents=True, exist_ok=True)
                        os.link(src, target)
        except OSError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder

    def _discard(self, job: Upload) -> None:
        if job.staged is not None:
            shutil.rmtree(job.staged, ignore_errors=True)
            job.staged = None


def _manifest(store: Store, site: str) -> dict[str, Any]:
    """The mirror's manifest ({} when there is none); CheckpointError when it is not one, or another site's."""
    where = store.where(MANIFEST)
    try:
        raw = json.loads(store.get(MANIFEST))
    except StoreError as exc:
        if exc.missing:
            return {}
        raise
    except ValueError as exc:
        raise CheckpointError(f"{where}: not JSON ({exc}); remove it to start this site's mirror afresh") from None
    rows = raw.get("checkpoints") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(rows, list):
        raise CheckpointError(f"{where}: not a geofed checkpoint mirror (format {FORMAT}); remove it or fix {SETTING}")
    if raw.get("site") != site:
        raise CheckpointError(
            f"{where} mirrors site {str(raw.get('site'))[:64]!r}, not {site}: give each run its own {SETTING} prefix"
        )
    for row in rows:
        objects = row.get("objects") if isinstance(row, dict) else None
        if not (isinstance(objects, list) and objects and isinstance(row.get("file"), str)) or not all(
            isinstance(o, dict) and {"key", "bytes", "sha256"} <= set(o) for o in objects
        ):
            raise CheckpointError(f"{where}: malformed checkpoint row; remove it to start this site's mirror afresh")
    return raw


def restore(mirror: CheckpointMirror, directory: Path, push_file: str, log_file: str) -> tuple[Path, str] | None:
    """Into an empty checkpoint folder: the newest complete checkpoint of the mirror (each object checked against
    its size and SHA-256; a damaged one skipped for the one before), the record of the push after it as
    `push_file`, and the newest records of the pushes (`log_push`), oldest first, as a list in `log_file`. Its path
    and shard folder ("": none), or None when the mirror holds none (the site starts afresh)."""
    store, where = mirror.store, mirror.store.where(MANIFEST)
    rows = _manifest(store, mirror.site).get("checkpoints", [])
    problems = []
    for row in rows:
        try:
            path = _fetch(store, row, directory)
        except (StoreError, ValueError) as exc:
            problems.append(str(exc))
            logger.error("%s: mirrored checkpoint %s cannot be used, trying an older one: %s", mirror.site,
                         row["file"], exc)  # fmt: skip
            continue
        if row.get("push"):
            atomic_write_bytes(directory / push_file, json.dumps(row["push"]).encode(), mode=PRIVATE_FILE)
        records = _push_log(mirror)
        if records:
            atomic_write_bytes(directory / log_file, json.dumps(records).encode(), mode=PRIVATE_FILE)
        logger.info("%s: local checkpoints gone; %s restored from the mirror %s", mirror.site, path.name, mirror.url)
        return path, str(row.get("shards") or "")
    if rows:
        raise CheckpointError(
            f"{where} names {len(rows)} checkpoint(s) and none is intact ({problems[0]}); restore them from a copy, "
            f"or point {SETTING} at a new URL to start this site afresh"
        )
    return None


def _push_log(mirror: CheckpointMirror) -> list[dict[str, Any]]:
    """The push records in the mirror, oldest first; one that cannot be read is skipped with one line."""
    records = []
    try:
        keys = sorted(mirror.store.listing(PUSHES))[-KEEP_PUSHES:]
    except StoreError as exc:
        logger.warning("%s: the mirror's push records cannot be listed, none used: %s", mirror.site, exc)
        return []
    for key in keys:
        try:
            record = json.loads(mirror.store.get(key))
        except (StoreError, ValueError) as exc:
            logger.warning("%s: push record %s skipped: %s", mirror.site, mirror.store.where(key), exc)
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _fetch(store: Store, row: dict[str, Any], directory: Path) -> Path:
    """One mirrored checkpoint's objects into `directory`, its file last (ValueError/StoreError: one is damaged)."""
    objects = row["objects"]
    stamp = objects[0]["key"].rsplit("/", 1)[0] + "/"
    private_dirs(directory)
    for obj in [*objects[1:], objects[0]]:
        rel = obj["key"][len(stamp) :]
        if not rel or rel.startswith("/") or ".." in Path(rel).parts:
            raise ValueError(f"{store.where(obj['key'])}: not a key of this mirror")
        target = directory / rel
        private_dirs(target.parent)
        size = store.get_file(obj["key"], target)
        if size != obj["bytes"] or _sha256(target) != obj["sha256"]:
            target.unlink(missing_ok=True)
            raise ValueError(f"{store.where(obj['key'])} is truncated or replaced (not what {MANIFEST} names)")
    return directory / objects[0]["key"][len(stamp) :]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    for chunk in file_chunks(path):
        digest.update(chunk)
    return digest.hexdigest()
