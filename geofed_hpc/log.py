"""The one `geofed_hpc` logger and its console setup."""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

LOGGER_NAME = "geofed_hpc"
logger = logging.getLogger(LOGGER_NAME)


_PASSWORD = re.compile(r"(://[^\s/@:'\"]*):[^\s/@]*@")  # a password quoted for a shell: quotes and all
HIDDEN = "***"


def hide_passwords(text: str) -> str:
    """`text` with the password of every scheme://user:pass@ URL in it shown as *** (what commands print of a
    site.proxy: a dry run's batch file, the path a job took, its log)."""
    return _PASSWORD.sub(rf"\g<1>:{HIDDEN}@", text)


def escape(text: object, limit: int = 64) -> str:
    """Text that came from the network, as a log line or an error may show it: every character that is not
    printable escaped (no forged lines, no terminal escapes), cut after `limit` characters with the count of the
    rest."""
    s = text if isinstance(text, str) else str(text)
    shown = s[:limit]
    if not shown.isprintable():
        shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in shown)
    return shown + (f"...(+{len(s) - limit} chars)" if len(s) > limit else "")


def quote(text: object, limit: int = 64) -> str:
    """escape(), in quotes."""
    return f"'{escape(text, limit)}'"


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler writing to sys.stderr as it is at each record: whoever swaps sys.stderr later (a test's capture, a
    library's console capture) never leaves the package logging into a stream that was closed."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # always the current sys.stderr


def setup_logging(verbosity: int = 0, stream=None) -> None:
    """Configure the package logger once: -1 quiet (warnings), 0 info, 1+ debug."""
    level = logging.WARNING if verbosity < 0 else logging.DEBUG if verbosity > 0 else logging.INFO
    logger.setLevel(level)
    if not any(getattr(h, "_geofed", False) for h in logger.handlers):
        handler = logging.StreamHandler(stream) if stream is not None else _Stderr()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        handler._geofed = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.propagate = False
