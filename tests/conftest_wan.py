"""The emulated-WAN fixture (root only): a PS namespace and two site links, 50 ms and 100 ms one way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from geofed_hpc.testing.wan import FAR, NEAR, Wan, unavailable_reason

# What the emulated links are called in tests: "near" 50 ms +-10 ms, 1% loss, 50 Mbit/s;
# "far" 100 ms +-20 ms, 1% loss, 20 Mbit/s (each direction).
LINKS = {"near": NEAR, "far": FAR}
CONGESTION_CONTROL = "cubic"  # what most clusters run; this machine defaults to BBR


@pytest.fixture
def wan(tmp_path: Path) -> Iterator[Wan]:
    """Namespaces for the PS and both sites, joined by user-space netem links; all removed afterwards."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"emulated WAN unavailable: {reason}")
    with Wan(LINKS, tmp_path / "wan", congestion_control=CONGESTION_CONTROL) as lab:
        yield lab
