"""Folders the commands write: made and tried here, or refused in one line naming the setting and the reason."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from geofed_hpc.errors import ConfigError

_WHY = {
    errno.EACCES: "permission denied: choose a folder you own",
    errno.EPERM: "not permitted here: choose a folder you own",
    errno.EROFS: "a read-only filesystem: choose a writable one ($SCRATCH, $HOME)",
    errno.ENOTDIR: "a file is in the way where a folder is needed: move it, or choose another path",
    errno.EEXIST: "a file is in the way where a folder is needed: move it, or choose another path",
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "your disk quota is used up",
    errno.ENOENT: "a folder on the way does not exist",
    errno.EISDIR: "a folder is in the way where a file is needed",
}


def os_reason(exc: OSError) -> str:
    """What an OSError means for the user, in words that say what to do."""
    return _WHY.get(exc.errno or 0, exc.strerror or str(exc))


def describe_os_error(exc: OSError) -> str:
    """One line for an OSError that reached the command line: the path, the reason."""
    where = f" {exc.filename}" if exc.filename else ""
    return f"cannot use{where}: {os_reason(exc)}"


def writable_dir(path: str | Path, setting: str, make: bool = True) -> Path:
    """`path` (with `~` expanded) as a folder this process can write in, made with its parents; ConfigError naming
    `setting` (the config key or argument it came from) when it cannot be. With `make=False` nothing is created:
    the nearest folder that exists on the way is tried instead (for commands that make the folder only on success)."""
    folder = tried = Path(path).expanduser()
    try:
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(folder))
        if make:
            folder.mkdir(parents=True, exist_ok=True)
        else:
            while not tried.exists() and tried != tried.parent:
                tried = tried.parent
            if not tried.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(tried))
        fd, probe = tempfile.mkstemp(dir=tried, prefix=".geofed-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        name = Path(str(exc.filename)) if exc.filename else folder
        where = str(folder) if {folder, tried} & {name, name.parent} else f"{folder} (at {name})"
        raise ConfigError(f"{setting}: cannot write in {where}: {os_reason(exc)}") from None
    return folder
