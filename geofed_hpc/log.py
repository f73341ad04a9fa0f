"""The one `geofed_hpc` logger and its console setup."""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "geofed_hpc"
logger = logging.getLogger(LOGGER_NAME)


def setup_logging(verbosity: int = 0, stream=None) -> None:
    """Configure the package logger once: -1 quiet (warnings), 0 info, 1+ debug."""
    level = logging.WARNING if verbosity < 0 else logging.DEBUG if verbosity > 0 else logging.INFO
    logger.setLevel(level)
    if not any(getattr(h, "_geofed", False) for h in logger.handlers):
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        handler._geofed = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.propagate = False
