"""Per-site enrollment tokens: issue, revoke, list and check; only their hashes are kept, in state_dir/tokens.json."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from geofed_hpc.ckpt.atomic import private_dirs
from geofed_hpc.ckpt.secret import write_secret
from geofed_hpc.errors import AuthError, CheckpointError, ConfigError
from geofed_hpc.log import logger, quote
from geofed_hpc.ps.statedir import require_tokens, tokens_required

TOKENS_FILE = "tokens.json"
FORMAT = 1
PREFIX = "gft"
_SITE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_ID = re.compile(r"[0-9a-f]{1,32}")
_HASH = re.compile(r"[0-9a-f]{64}")


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def tokens_path(state_dir: str) -> Path:
    """Where the PS with this state directory keeps its tokens; ConfigError without one."""
    if not state_dir:
        raise ConfigError(
            "ps.state_dir: enrollment tokens live in the parameter server's state directory; set ps.state_dir "
            "(ps=cloud uses ~/.geofed/ps/state) to the same value as `geofed-hpc ps up`"
        )
    return Path(state_dir).expanduser() / TOKENS_FILE


def admits(owner: str, site: str) -> bool:
    """A credential (token or certificate) of site `owner` admits `owner` and its numbered jobs `owner-0`, ..."""
    return site == owner or bool(re.fullmatch(re.escape(owner) + r"-\d+", site))


def family_of(site: str) -> str:
    """The site a numbered job belongs to (`osc-3` -> `osc`): what one enrollment token admits."""
    return re.sub(r"-\d+$", "", site)


def check_site_name(site: str, field: str = "site") -> str:
    if not _SITE.fullmatch(site):
        raise ConfigError(f"{field}: {quote(site)} is not a site name (1-64 letters, digits, '.', '_', '-')")
    return site


@dataclass
class TokenRecord:
    """One issued token as the PS keeps it: never the secret, only its SHA-256. Times are Unix seconds; 0 is never."""

    id: str
    site: str
    hash: str
    created: float
    expires: float = 0.0
    revoked: float = 0.0

    def state(self, now: float) -> str:
        if self.revoked:
            return "revoked"
        return "expired" if self.expires and now >= self.expires else "valid"

    def admits(self, site: str) -> bool:
        """A token for `osc` admits the site `osc` and its numbered jobs `osc-0`, `osc-1`, ..."""
        return admits(self.site, site)

    @classmethod
    def from_row(cls, row: object, where: str) -> TokenRecord:
        """A record from its JSON object, each field checked; CheckpointError starting with `where` naming the
        first field that is not well-formed."""
        if not isinstance(row, dict):
            raise CheckpointError(f"{where} is not an object")
        if isinstance(row.get("id"), str) and _ID.fullmatch(row["id"]):
            where = f"{where} (id {row['id']})"
        unknown = sorted(set(row) - {"id", "site", "hash", "created", "expires", "revoked"})
        if unknown:
            raise CheckpointError(f"{where}: field {quote(unknown[0])} is unknown")

        def bad(name: str, expected: str) -> CheckpointError:
            value = row.get(name)
            shown = "missing" if name not in row else quote(value) if isinstance(value, str) else repr(value)[:64]
            return CheckpointError(f"{where}: field {name!r} is {shown}, not {expected}")

        if not isinstance(row.get("id"), str) or not _ID.fullmatch(row["id"]):
            raise bad("id", "a short hex string")
        if not isinstance(row.get("site"), str) or not _SITE.fullmatch(row["site"]):
            raise bad("site", "a site name (1-64 letters, digits, '.', '_', '-')")
        if not isinstance(row.get("hash"), str) or not _HASH.fullmatch(row["hash"]):
            raise bad("hash", "a SHA-256 in 64 lowercase hex digits")
        times: dict[str, float] = {}
        for name in ("created", "expires", "revoked"):
            value = row.get(name, 0.0 if name != "created" else None)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise bad(name, "a time in Unix seconds (a number >= 0, 0 for never)")
            times[name] = float(value)
        return cls(row["id"], row["site"], row["hash"], times["created"], times["expires"], times["revoked"])


def _records(path: Path) -> list[TokenRecord]:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: unreadable token file ({exc}); restore it or remove it and issue again"
        ) from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("tokens"), list):
        raise CheckpointError(f"{path}: not a geofed token file (format {FORMAT} expected)")
    records: dict[str, TokenRecord] = {}
    for i, row in enumerate(raw["tokens"]):
        try:
            record = TokenRecord.from_row(row, f"{path}: token record {i}")
            if record.id in records:
                raise CheckpointError(f"{path}: token record {i} (id {record.id}): this id is taken by another record")
        except CheckpointError as exc:
            raise CheckpointError(f"{exc}; fix that record, or restore the file from a copy") from None
        records[record.id] = record
    return list(records.values())


def canonical(records: Iterable[TokenRecord]) -> bytes:
    """The records as one PS group peer shows them to another: the same bytes for the same records in any order."""
    return json.dumps([asdict(r) for r in sorted(records, key=lambda r: r.id)], sort_keys=True).encode()


def from_canonical(data: bytes, source: str) -> list[TokenRecord]:
    """What `canonical` wrote; CheckpointError naming `source` when it is not that."""
    try:
        rows = json.loads(data)
    except ValueError as exc:
        raise CheckpointError(f"{source}: malformed token records ({exc})") from None
    if not isinstance(rows, list):
        raise CheckpointError(f"{source}: malformed token records (not a list)")
    return [TokenRecord.from_row(row, f"{source}: token record {i}") for i, row in enumerate(rows)]


class TokenFile:
    """The token records of one PS; each change is a locked read-modify-write, replaced atomically, mode 0600. Once
    it holds a record, the state directory records that Join needs a token (statedir.require_tokens).

    Lock: an exclusive flock on a lock file beside it (`_locked`), so `token issue` and `token revoke` may run
    beside a running PS (and beside its PS group's merges)."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._clock = clock

    def read(self) -> list[TokenRecord]:
        return _records(self.path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[list[TokenRecord]]:
        private_dirs(self.path.parent)
        fd = os.open(self.path.with_name(f".{self.path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            records = _records(self.path)
            before = canonical(records)
            yield records
            if canonical(records) != before:  # rewritten only when a record changed
                if records:  # Join needs a token from now on, even if this file goes: recorded before it is written
                    require_tokens(self.path.parent)
                write_secret(self.path, {"format": FORMAT, "tokens": [asdict(r) for r in records]})
        finally:
            os.close(fd)

    def issue(self, site: str, ttl: timedelta) -> tuple[str, TokenRecord]:
        """A new token for `site` (its secret is returned here and nowhere else) valid for `ttl` (0: forever)."""
        return self.issue_many([site], ttl)[0]

    def issue_many(self, sites: list[str], ttl: timedelta) -> list[tuple[str, TokenRecord]]:
        """A new token for each of `sites`, in one locked rewrite of the file (a federation of thousands of sites
        would otherwise rewrite it once per site)."""
        for site in sites:
            check_site_name(site)
        now = self._clock()
        expires = now + ttl.total_seconds() if ttl.total_seconds() > 0 else 0.0
        issued = []
        for site in sites:
            token_id = secrets.token_hex(6)
            token = f"{PREFIX}_{token_id}_{secrets.token_urlsafe(32)}"
            issued.append((token, TokenRecord(token_id, site, token_hash(token), now, expires)))
        with self._locked() as records:
            records.extend(record for _, record in issued)
        for _, record in issued:
            logger.debug("issued token %s for site %s (%s)", record.id, record.site, _expiry(record))
        return issued

    def merge(self, others: Iterable[TokenRecord]) -> list[str]:
        """Take a peer PS's records: a token issued there is added, one revoked there is revoked here too (at the
        earliest time either saw); the ids that changed (the file is rewritten only when one did)."""
        changed: list[str] = []
        with self._locked() as records:
            mine = {r.id: r for r in records}
            for other in others:
                held = mine.get(other.id)
                if held is None:
                    records.append(other)
                    mine[other.id] = other
                    changed.append(other.id)
                elif other.revoked and (not held.revoked or other.revoked < held.revoked):
                    held.revoked = other.revoked
                    changed.append(other.id)
        return changed

    def revoke(self, site: str = "", token_id: str = "") -> list[TokenRecord]:
        """Revoke the token `token_id`, or every valid token of `site`; the revoked records (ConfigError: none)."""
        with self._locked() as records:
            now = self._clock()
            hits = [r for r in records if (r.id == token_id if token_id else r.site == site) and not r.revoked]
            for r in hits:
                r.revoked = now
        if not hits:
            what = f"token {token_id}" if token_id else f"site {site}"
            raise ConfigError(f"no unrevoked token for {what} in {self.path}; see `geofed-hpc token list`")
        logger.debug("revoked token(s) %s", ", ".join(r.id for r in hits))
        return hits


def _expiry(r: TokenRecord) -> str:
    return f"expires {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(r.expires))}" if r.expires else "no expiry"


def token_table(records: list[TokenRecord], now: float | None = None) -> str:
    """`token list`: ids, sites, dates and states, never a secret."""
    now = time.time() if now is None else now

    def day(t: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.gmtime(t)) if t else "-"

    lines = [f"{'id':<14}{'site':<18}{'created (UTC)':<18}{'expires (UTC)':<18}{'revoked (UTC)':<18}state"]
    for r in sorted(records, key=lambda r: (r.site, r.created)):
        lines.append(
            f"{r.id:<14}{r.site:<18}{day(r.created):<18}{day(r.expires):<18}{day(r.revoked):<18}{r.state(now)}"
        )
    return "\n".join(lines)


class TokenVerifier:
    """Checks Join tokens for the running PS: `ps.enroll_token` (one for all sites) and the issued tokens of the
    token file, which is read again whenever it changes on disk (issue and revoke need no restart).

    Lock: its own `_lock` (re-entrant) around every read and change of what it holds: the server's gate asks it
    before a call starts, the session table under the coordinator's lock."""

    def __init__(self, path: Path | None, shared: str = "", clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._shared = token_hash(shared) if shared else ""
        self._clock = clock
        self._stamp: tuple[int, int, int] | None = None
        self._by_id: dict[str, TokenRecord] = {}
        self._had_file = False
        self.readable = True  # False while the token file, changed on disk, cannot be read (the last read holds)
        self._lock = threading.RLock()
        # the state directory's record that tokens are required (a token was issued): a deleted file changes nothing
        self._recorded = tokens_required(path.parent) if path is not None else False
        self._refresh(strict=True)

    def _refresh(self, strict: bool = False) -> None:
        with self._lock:
            self._read(strict)

    def _read(self, strict: bool) -> None:
        if self.path is None:
            return
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self._stamp is not None:
                logger.warning("token file %s is gone: only ps.enroll_token admits new sites now", self.path)
            self._stamp, self._by_id, self.readable = None, {}, True
            return
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        try:
            records = _records(self.path)
        except CheckpointError:
            if strict:
                raise
            logger.exception("token file changed but cannot be read; keeping the tokens read before")
            self._stamp, self.readable = stamp, False  # read again once it changes, not at every call
            return
        self._stamp, self._had_file, self.readable = stamp, True, True
        self._by_id = {r.id: r for r in records}
        logger.info("read %d token(s) from %s", len(records), self.path)

    def records(self) -> list[TokenRecord] | None:
        """The issued tokens' records as last read (read again when the file changed); None without a token file,
        or while it cannot be read."""
        with self._lock:
            self._refresh()
            return list(self._by_id.values()) if self.path is not None and self.readable else None

    @property
    def required(self) -> bool:
        """Whether Join needs a token: with ps.enroll_token, and once a token was issued (recorded in the state
        directory: it stays required even if the token file is removed)."""
        with self._lock:
            self._refresh()
            return bool(self._shared) or self._had_file or self._recorded

    def known(self, token: str) -> bool:
        """`token` is ps.enroll_token or an issued token (valid or not)."""
        with self._lock:
            self._refresh()
            if self._shared and hmac.compare_digest(self._shared, token_hash(token)):
                return True
            parts = token.split("_", 2)
            record = self._by_id.get(parts[1]) if len(parts) == 3 and parts[0] == PREFIX else None
            return record is not None and hmac.compare_digest(record.hash, token_hash(token))

    def identify(self, token: str, who: str = "this caller") -> TokenRecord | None:
        """The valid issued token `token` is (None: it is ps.enroll_token, or no token is required); AuthError when it
        is none of them, or expired or revoked. `who` names the caller in the error."""
        with self._lock:
            self._refresh()
            if not self.required:
                return None
            if self._shared and hmac.compare_digest(self._shared, token_hash(token)):
                return None
            parts = token.split("_", 2)
            record = self._by_id.get(parts[1]) if len(parts) == 3 and parts[0] == PREFIX else None
            if record is None or not hmac.compare_digest(record.hash, token_hash(token)):
                raise AuthError(f"{who}: enrollment token refused (unknown or wrong token; check site.token)")
            state = record.state(self._clock())
            if state != "valid":
                raise AuthError(
                    f"{who}: enrollment token {record.id} is {state}: "
                    f"issue a new one with `geofed-hpc token issue site={record.site}`"
                )
            return record

    def check(self, site: str, token: str) -> str:
        """The id of the token that admits `site` ("" for ps.enroll_token or an open PS); AuthError otherwise."""
        record = self.identify(token, f"site {site!r}")
        if record is None:
            return ""
        if not record.admits(site):
            raise AuthError(f"site {site!r}: enrollment token {record.id} is for site {record.site!r}, not this one")
        return record.id

    def revoked(self, token_id: str) -> bool:
        """Whether the token a session enrolled with has been revoked since (its sessions end)."""
        if not token_id:
            return False
        with self._lock:
            self._refresh()
            record = self._by_id.get(token_id)
            return record is None or bool(record.revoked)
