"""The PS's state directory as a private place: its permissions, whether Join needs a token, the admin secret."""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from pathlib import Path

from geofed_hpc.ckpt.atomic import PRIVATE_DIR, PRIVATE_FILE, atomic_write_bytes, private_dirs
from geofed_hpc.errors import CheckpointError, ConfigError
from geofed_hpc.log import logger
from geofed_hpc.paths import os_reason

AUTH_FILE = "auth.json"
ADMIN_FILE = "admin.token"
ADMIN_PREFIX = "gfa"
FORMAT = 1
_ADMIN = re.compile(rf"{ADMIN_PREFIX}_[A-Za-z0-9_-]{{43,}}")


def check_state_dir(path: Path, setting: str = "ps.state_dir") -> Path:
    """`path` as the PS's private folder: made 0700 when missing; refused (ConfigError) when other users may write
    in it; when other users may read it or what it holds (written by an older version), tightened to 0700 for
    folders and 0600 for files, in one info line."""
    path = Path(path).expanduser()
    if not path.exists():
        try:
            return private_dirs(path)
        except OSError as exc:
            raise ConfigError(f"{setting}: cannot make {path}: {os_reason(exc)}") from None
    if not path.is_dir():
        raise ConfigError(f"{setting}: {path} is not a folder: a file is in the way; move it, or choose another path")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o022:
        fix = (
            f"use a folder of your own inside it ({path / 'geofed-ps'}, say): it is shared, like /tmp"
            if mode & stat.S_ISVTX
            else f"run `chmod 700 {path}` (and check what is in it)"
        )
        raise ConfigError(
            f"{setting}: {path} has mode {mode:04o}: other users may write in it and change the parameter server's "
            f"state; it does not start: {fix}"
        )
    folders, files = _tighten(path)
    if folders or files:
        logger.info(
            "%s was readable by other users (written by an older version): made %d folder(s) 0700 and %d file(s) "
            "0600 in it",
            path,
            folders,
            files,
        )
    return path


def _tighten(root: Path) -> tuple[int, int]:
    """Take every permission of other users off `root` and what it holds (symbolic links are left alone); how many
    folders and files changed."""
    changed = [0, 0]

    def fix(entry: Path, mode: int, private: int, kind: int) -> None:
        if mode & 0o077:
            try:
                os.chmod(entry, private)
            except FileNotFoundError:  # gone meanwhile
                return
            except OSError as exc:
                raise ConfigError(
                    f"{entry} has mode {mode:04o}, readable by other users, and cannot be made private "
                    f"({exc.strerror}): make it {private:o} (chmod {private:o} {entry}) or move it away"
                ) from None
            changed[kind] += 1

    fix(root, stat.S_IMODE(root.stat().st_mode), PRIVATE_DIR, 0)
    for folder, dirs, names in os.walk(root):
        for name in [*dirs, *names]:
            entry = Path(folder) / name
            try:
                st = entry.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                fix(entry, stat.S_IMODE(st.st_mode), PRIVATE_DIR, 0)
            elif stat.S_ISREG(st.st_mode):
                fix(entry, stat.S_IMODE(st.st_mode), PRIVATE_FILE, 1)
    return changed[0], changed[1]


def tokens_required(state_dir: Path) -> bool:
    """Whether the PS of `state_dir` recorded that Join needs a token (in auth.json: once recorded it stays, even
    when tokens.json is removed). CheckpointError naming the file when it is not what require_tokens writes."""
    path = Path(state_dir).expanduser() / AUTH_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc}); restore it, or write {_auth_text()} into it") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("tokens_required"), bool):
        raise CheckpointError(
            f"{path}: not a geofed auth record ({_auth_text()} expected); restore it, or write that into it"
        )
    return raw["tokens_required"]


def require_tokens(state_dir: Path) -> None:
    """Record in auth.json (0600, replaced atomically) that Join needs a token from now on (a token was issued)."""
    if tokens_required(state_dir):
        return
    path = Path(state_dir).expanduser() / AUTH_FILE
    atomic_write_bytes(path, _auth_text().encode(), mode=PRIVATE_FILE)
    logger.info("recorded in %s that joining needs a token from now on", path)


def _auth_text() -> str:
    return json.dumps({"format": FORMAT, "tokens_required": True})


def admin_token(state_dir: Path, create: bool) -> str:
    """The operator's secret for the PS of `state_dir` (`gfa_` and 256 random bits, URL-safe) from admin.token
    (0600, replaced atomically); made there when missing and `create`, else "" when missing. CheckpointError naming
    the file when it holds something else."""
    path = Path(state_dir).expanduser() / ADMIN_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        if not create:
            return ""
        token = f"{ADMIN_PREFIX}_{secrets.token_urlsafe(32)}"
        atomic_write_bytes(path, f"{token}\n".encode(), mode=PRIVATE_FILE)
        logger.info("made the admin token in %s", path)
        return token
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc}); restore it, or remove it to make a new one") from None
    token = text.strip()
    if not _ADMIN.fullmatch(token):
        raise CheckpointError(
            f"{path}: not an admin token ({ADMIN_PREFIX}_ and 43 or more URL-safe characters expected); restore it, "
            "or remove it to make a new one"
        )
    return token
