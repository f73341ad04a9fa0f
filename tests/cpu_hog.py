"""Keep one CPU core busy until killed, until its parent goes, or for --seconds at most (`make test-busy`)."""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=7200.0, help="stop by itself after this long")
    p.add_argument("--parent", type=int, default=0, help="stop once this process is no longer the parent")
    args = p.parse_args()
    parent, end = args.parent or os.getppid(), time.monotonic() + args.seconds
    while time.monotonic() < end and os.getppid() == parent:
        sum(range(200_000))  # a few ms of pure CPU between checks


if __name__ == "__main__":
    main()
