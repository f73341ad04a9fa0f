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
from typing import Any

from geofed_hpc.ckpt.atomic import PRIVATE_FILE, atomic_write_bytes, clean_temp_files, fsync_dir, private_dirs
from geofed_hpc.errors import ConfigError
from geofed_hpc.faults import fault
from geofed_hpc.log import logger
from geofed_hpc.ps.tokens import check_site_name
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.stream import digest

# The header fields of a journaled push and their types (what m.PushHeader holds; sha256 as hex).
_HEADER: dict[str, type | tuple[type, ...]] = {
    "session_id": str,
    "base_version": int,
    "local_steps": int,
    "tokens": int,
    "codec": str,
    "total_bytes": int,
    "sha256": str,
    "push_id": str,
    "init": bool,
    "train_loss": (int, float),
}


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
    `directory`, mode 0600. The JSON is written last and atomically: a payload without it was never acknowledged
    and is removed; an entry that cannot be read, whose header is malformed or whose payload does not match the
    checksum it names is damaged: set aside in `set-aside/` with an error line, never removed.

    Lock: none; not thread-safe. Persistence calls it, under the coordinator's lock.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.aside = directory / "set-aside"
        private_dirs(directory)
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
        os.chmod(target, PRIVATE_FILE)
        fsync_dir(self.directory)
        fields = asdict(header)
        fields["sha256"] = header.sha256.hex()
        meta = {"version": version, "site": site, "header": fields}
        atomic_write_bytes(self.directory / f"{name}.json", json.dumps(meta).encode(), mode=PRIVATE_FILE)
        self._durable(name)
        fault("ps.journal", header.push_id)

    def _durable(self, name: str) -> None:
        """The entry `name` is on disk; a journal that also keeps it elsewhere (ps/remote.py) copies it here, and
        raises OSError, having removed it, when it cannot."""

    def entries(self) -> list[Entry]:
        """Every complete entry, oldest first; damaged ones are set aside, each with an error line."""
        out: list[Entry] = []
        for meta_path in sorted(self.directory.glob("*.json")):
            try:
                out.append(self._read(meta_path))
            except (OSError, ValueError) as exc:
                where = self._move_aside(meta_path.stem)
                logger.error(
                    "round journal entry %s is damaged (%s): set aside as %s; its push is not replayed (a resend "
                    "of it is applied as new)",
                    meta_path,
                    exc,
                    where,
                )
        complete = {p.stem for p in self.directory.glob("*.json")}
        for orphan in self.directory.glob("*.push"):
            # a payload without its header: the PS was killed between the payload's move and the header's write,
            # before the push was acknowledged (the site sends it again), a normal crash artifact; no data lost
            if orphan.stem not in complete:
                orphan.unlink(missing_ok=True)
        return out

    def _read(self, meta_path: Path) -> Entry:
        """One entry, checked: ValueError (or OSError) saying what is wrong with it."""
        try:
            meta = json.loads(meta_path.read_text())
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8 text: {exc}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
        if not isinstance(meta, dict) or set(meta) != {"version", "site", "header"}:
            raise ValueError("not a journal entry (an object of version, site and header expected)")
        version, site, fields = meta["version"], meta["site"], meta["header"]
        if not _is_int(version) or version < 0:
            raise ValueError(f"field 'version' is {version!r}, not an int >= 0")
        try:
            check_site_name(site if isinstance(site, str) else "")
        except ConfigError:
            raise ValueError(f"field 'site' is {site!r}, not a site name") from None
        header = _header(fields)
        payload_path = meta_path.with_suffix(".push")
        payload = payload_path.read_bytes()
        if len(payload) != header.total_bytes or digest(payload) != header.sha256:
            raise ValueError(f"{payload_path.name} does not match its checksum")
        return Entry(version, site, header, payload, meta_path.stem)

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
        return self._move_aside(entry.name)

    def _move_aside(self, stem: str) -> Path:
        private_dirs(self.aside)
        for suffix in (".push", ".json"):
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.directory / f"{stem}{suffix}", self.aside / f"{stem}{suffix}")
        fsync_dir(self.aside)
        fsync_dir(self.directory)
        return self.aside / f"{stem}.json"

    def clear(self) -> None:
        """A new model was seeded: no round from before it."""
        for path in self.directory.iterdir():
            if path.suffix in (".json", ".push") and path.is_file():
                path.unlink(missing_ok=True)

    def _remove(self, stem: str) -> None:
        for suffix in (".json", ".push"):
            with contextlib.suppress(OSError):
                (self.directory / f"{stem}{suffix}").unlink()


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _header(fields: Any) -> m.PushHeader:
    """A journaled push header, each field checked (ValueError naming the first that is not well-formed)."""
    if not isinstance(fields, dict):
        raise ValueError("field 'header' is not an object")
    unknown = sorted(set(fields) - set(_HEADER))
    if unknown:
        raise ValueError(f"header field {unknown[0]!r} is unknown")
    for name, kind in _HEADER.items():
        if name not in fields:
            if name in ("init", "train_loss"):  # they have defaults
                continue
            raise ValueError(f"header field {name!r} is missing")
        value = fields[name]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ValueError(f"header field {name!r} is {value!r}, not {_kind(kind)}")
    try:
        sha256 = bytes.fromhex(fields["sha256"])
    except ValueError:
        sha256 = b""
    if len(sha256) != 32:
        raise ValueError(f"header field 'sha256' is {fields['sha256']!r}, not 64 hex digits")
    return m.PushHeader(**{**fields, "sha256": sha256})


def _kind(kind: type | tuple[type, ...]) -> str:
    return "an int" if kind is int else "a string" if kind is str else "true or false" if kind is bool else "a number"
