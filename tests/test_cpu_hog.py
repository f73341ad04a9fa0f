"""The CPU hog of `make test-busy` ends by itself: after its time, or once its parent is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HOG = Path(__file__).resolve().parent / "cpu_hog.py"


def test_the_hog_stops_after_its_seconds() -> None:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(HOG), "--seconds", "0.5"], timeout=120)
    assert done.returncode == 0 and time.monotonic() - t0 >= 0.5


def test_the_hog_stops_when_its_parent_is_not_the_one_it_was_given() -> None:
    done = subprocess.run([sys.executable, str(HOG), "--seconds", "3600", "--parent", "1"], timeout=120)
    assert done.returncode == 0  # its parent is this test, not pid 1: it ends at once, not in an hour


def test_the_hog_keeps_a_core_busy_until_killed() -> None:
    hog = subprocess.Popen([sys.executable, str(HOG), "--seconds", "3600"])
    try:
        deadline = time.monotonic() + 120
        while (cpu := _cpu_seconds(hog.pid)) < 0.5 and hog.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert hog.poll() is None and cpu >= 0.5
    finally:
        hog.kill()
        hog.wait(timeout=30)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, in clock ticks
