"""The open round on disk: each admitted delta of a round still open, so a restarted PS gets the round back."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from geofed_hpc.ckpt.atomic import atomic_write_bytes, clean_temp_files, fsync_dir
from geofed_hpc.faults import fault
from geofed_hpc.log import logger
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.stream import digest


@dataclass
class Entry:
    """One journaled delta: admitted at `version` (the global version of its open round)."""

    version: int
    site: str
    header: m.PushHeader
    payload: bytes
    name: str  # of its files, <name>.json and <name>.push


def sync_file(path: Path) -> None:
    """Flush a file's bytes to disk (a staged push, before the journal takes it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RoundJournal:
    """The verified bytes and header of each delta admitted to a round that is still open, so that a PS killed
    before the round closes gets that round back on restart (an accepted push is never lost). Every admitted delta
    is journaled before its push is answered, whatever the aggregation mode; a restart replays the entries after
    its snapshot in admission order, so it reaches the versions it had made. Entries go once a snapshot holds
    their round (`drop_before`).

    `<name>.push` (the payload, moved from staging) and `<name>.json` (header, site, version) per delta in
    `directory`. The JSON is written last and atomically: an entry without it, or whose payload does not match
    the checksum it names, is incomplete and removed.

    Lock: none; not thread-safe. Persistence calls it, under the coordinator's lock.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        clean_temp_files(directory, lambda target: target.endswith(".json"))
        # entry names sort in admission order: a clock reading, never below the newest entry's (clocks step back)
        stems = [p.stem.split("-")[0] for p in directory.glob("*.json")]
        self._last = max((int(stem) for stem in stems if stem.isdigit()), default=0)

    def record(self, staged: Path, header: m.PushHeader, site: str, version: int) -> None:
        """Keep a verified staged payload (already fsynced, see `sync_file`) as an entry of the round open at
        `version`. Call with the PS lock held, before the push is answered."""
        # admission order, and the push id hashed: the id comes from a site and never becomes a path
        self._last = max(time.time_ns(), self._last + 1)
        name = f"{self._last:020d}-{hashlib.sha256(header.push_id.encode()).hexdigest()[:16]}"
        target = self.directory / f"{name}.push"
        try:
            os.replace(staged, target)  # staging usually lives in the same state directory
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            shutil.copyfile(staged, target)  # ps.staging_dir on another file system
            sync_file(target)
        fsync_dir(self.directory)
        fields = asdict(header)
        fields["sha256"] = header.sha256.hex()
        meta = {"version": version, "site": site, "header": fields}
        atomic_write_bytes(self.directory / f"{name}.json", json.dumps(meta).encode())
        fault("ps.journal", header.push_id)

    def entries(self) -> list[Entry]:
        """Every complete entry, oldest first; incomplete or damaged ones are removed with a warning."""
        out: list[Entry] = []
        for meta_path in sorted(self.directory.glob("*.json")):
            payload_path = meta_path.with_suffix(".push")
            try:
                meta = json.loads(meta_path.read_text())
                fields = dict(meta["header"])
                fields["sha256"] = bytes.fromhex(fields["sha256"])
                header = m.PushHeader(**fields)
                payload = payload_path.read_bytes()
                if len(payload) != header.total_bytes or digest(payload) != header.sha256:
                    raise ValueError(f"{payload_path.name} does not match its checksum")
                out.append(Entry(int(meta["version"]), str(meta["site"]), header, payload, meta_path.stem))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("round journal entry %s is damaged (%s); dropped", meta_path.name, exc)
                self._remove(meta_path.stem)
        complete = {p.stem for p in self.directory.glob("*.json")}
        for orphan in self.directory.glob("*.push"):  # killed between the payload's move and its header
            if orphan.stem not in complete:
                orphan.unlink(missing_ok=True)
        return out

    def drop(self, entry: Entry) -> None:
        self._remove(entry.name)

    def drop_before(self, version: int) -> int:
        """Remove the entries of rounds open before `version` (a snapshot at `version` holds them); how many."""
        dropped = 0
        for meta_path in self.directory.glob("*.json"):
            try:
                old = int(json.loads(meta_path.read_text())["version"]) < version
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a damaged entry: entries() reports and removes it
            if old:
                self._remove(meta_path.stem)
                dropped += 1
        return dropped

    def set_aside(self, entry: Entry) -> Path:
        """Move an entry that cannot be replayed to set-aside/ (kept for the operator, never replayed)."""
        aside = self.directory / "set-aside"
        aside.mkdir(exist_ok=True)
        for suffix in (".push", ".json"):
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.directory / f"{entry.name}{suffix}", aside / f"{entry.name}{suffix}")
        fsync_dir(self.directory)
        return aside / f"{entry.name}.json"

    def clear(self) -> None:
        """A new model was seeded: no round from before it."""
        for path in self.directory.iterdir():
            if path.suffix in (".json", ".push") and path.is_file():
                path.unlink(missing_ok=True)

    def _remove(self, stem: str) -> None:
        for suffix in (".json", ".push"):
            with contextlib.suppress(OSError):
                (self.directory / f"{stem}{suffix}").unlink()
