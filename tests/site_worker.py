"""One rank of a site as its own process, the way a Slurm task runs it: python -m tests.site_worker CFG INDEX PS."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from geofed_hpc.client.job import ClientJob


def main() -> int:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    result = ClientJob(cfg, int(sys.argv[2]), sys.argv[3])()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
