"""Small secret files (a site's one-time rejoin token): written atomically, readable by the owner only (0600)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

from geofed_hpc.ckpt.atomic import fsync_dir


def write_secret(path: Path, data: dict[str, Any]) -> None:
    """Replace `path` with JSON `data`, mode 0600 from the first byte (never briefly world-readable)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)  # O_CREAT's mode passes through the umask; make sure
        os.replace(tmp, path)
        fsync_dir(path.parent)  # the rename itself survives a crash
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def read_secret(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when it is missing or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
