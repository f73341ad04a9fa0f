"""Crash-safe file replacement (temp file beside it, fsync, os.replace, fsync the directory); owner-only folders."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from geofed_hpc.errors import ConfigError
from geofed_hpc.faults import fault
from geofed_hpc.log import logger

TEMP_MARKER = ".tmp-"
PRIVATE_FILE = 0o600  # state files: read and written by their owner only
PRIVATE_DIR = 0o700
Chunk = bytes | bytearray | memoryview


def temp_prefix(path: Path) -> str:
    """The name prefix of every temp file written on the way to `path` (hidden, recognisable)."""
    return f".{path.name}{TEMP_MARKER}"


def temp_target(path: Path) -> str | None:
    """The target file name a temp file was written for, or None when `path` is not such a temp file."""
    name = path.name
    if not name.startswith(".") or TEMP_MARKER not in name:
        return None
    return name[1 : name.rindex(TEMP_MARKER)]


def clean_temp_files(directory: Path, match: Callable[[str], bool]) -> list[Path]:
    """Remove temp files in `directory` left by interrupted writes whose target name satisfies `match`.

    Returns the removed paths. Only call this where no other writer is busy with a matching target.
    """
    removed: list[Path] = []
    try:
        entries = list(Path(directory).iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        target = temp_target(entry)
        if target is None or not match(target):
            continue
        try:
            entry.unlink()
        except FileNotFoundError:
            continue
        removed.append(entry)
        logger.debug("removed leftover temp file %s", entry)
    return removed


def fsync_dir(directory: Path) -> None:
    """Make the renames and removals in `directory` durable (where the platform allows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def private_dirs(directory: Path) -> Path:
    """Make `directory` and the folders missing on the way to it, each made here mode 0700 (mkdir's mode passes
    through the umask, so it is set again); folders that exist are left as they are."""
    directory = Path(directory)
    missing: list[Path] = []
    here = directory
    while not here.exists() and here != here.parent:
        missing.append(here)
        here = here.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=PRIVATE_DIR)
        except FileExistsError:  # made meanwhile by another writer
            continue
        os.chmod(folder, PRIVATE_DIR)
    return directory


def set_aside(path: Path, folder: Path) -> Path:
    """Move `path` into `folder` (made 0700; a name taken there gets a suffix), kept for the operator; the new path."""
    private_dirs(folder)
    target = Path(folder) / path.name
    n = 0
    while target.exists():
        n += 1
        target = Path(folder) / f"{path.name}.{n}"
    os.replace(path, target)
    fsync_dir(path.parent)
    fsync_dir(Path(folder))
    return target


def atomic_write_bytes(path: Path, data: Chunk | Iterable[Chunk], mode: int | None = None) -> None:
    """Replace `path` with `data` (bytes, or an iterable of byte chunks) so that a crash leaves old or new.

    Writes to a hidden temp file next to `path`, flushes and fsyncs it, `os.replace`s it over `path` and
    fsyncs the directory. Temp files left by an earlier crash on the same target are removed first.
    On an exception the temp file is removed and the previous `path` is untouched. `mode`: the file's permission
    bits from its first byte, whatever the umask (None: 0666 less the umask); with an owner-only mode (PRIVATE_FILE)
    the folders made on the way are owner-only too.
    """
    path = Path(path)
    directory = path.parent
    if mode is not None and not mode & 0o077:
        private_dirs(directory)
    else:
        directory.mkdir(parents=True, exist_ok=True)
    clean_temp_files(directory, lambda target: target == path.name)
    tmp = directory / f"{temp_prefix(path)}{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)  # O_CREAT's mode passes through the umask
            chunks: Iterable[Chunk] = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
            for chunk in chunks:
                f.write(chunk)
                fault("atomic.chunk", path.name)
            fault("atomic.write", path.name)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(directory)


@contextlib.contextmanager
def atomic_dir(out: Path, force: bool = False, flag: str = "--force") -> Iterator[Path]:
    """A hidden folder beside `out` to write into; renamed to `out` when the block succeeds, removed when it fails,
    so `out` is never half-written. An `out` that exists and is not empty is refused unless `force` (then replaced)."""
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ConfigError(f"{out} exists and is not empty; choose another folder, or pass {flag} to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{temp_prefix(out)}{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        old = out.parent / f"{temp_prefix(out)}old-{secrets.token_hex(4)}" if out.exists() else None
        if old is not None:
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
