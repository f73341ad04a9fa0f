"""Checkpoint load benchmark: the same tensors in tensor-file format 1 (one sequential sha256, the baseline) and
format 2 (64 MiB blocks read on several threads, each checked with xxh3-128), loaded in this run.

    python bench/ckpt_load.py --json bench/results/ckpt_load.json             # 5.4 GB: a 354M site's checkpoint
    python bench/ckpt_load.py --gb 1 --repeats 2 --json /tmp/ckpt_load.json   # quicker

Both files are written once, then each is loaded `--repeats` times, alternating, with the files in the page
cache (a restarted site reads the checkpoint its previous segment just wrote); `--cold` drops the page cache
before every load (root only: a site requeued on another node reads from the shared filesystem). Reported:
best-of seconds and GB/s per format and `speedup` = format-1 seconds / format-2 seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from geofed_hpc.ckpt.tensorfile import load_tensors, save_tensors  # noqa: E402

TENSOR_BYTES = 100 << 20  # a transformer's largest matrices are about this size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=5.4, help="checkpoint size in GB (default: a 354M site's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="", help="where to write the two files (default: a temp dir)")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each load (root)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    total = int(args.gb * 1e9)
    rng = np.random.default_rng(0)
    sizes = [TENSOR_BYTES // 4] * (total // TENSOR_BYTES) + [max(1, total % TENSOR_BYTES // 4)]
    tensors = {f"t{i}": rng.standard_normal(n, dtype=np.float32) for i, n in enumerate(sizes)}
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        paths = {v: Path(tmp) / f"v{v}.gft" for v in (1, 2)}
        for v, path in paths.items():
            save_tensors(path, tensors, {"bench": True}, version=v)
        del tensors
        best = {1: float("inf"), 2: float("inf")}
        for _ in range(args.repeats):
            for v, path in paths.items():
                if args.cold:
                    os.sync()
                    Path("/proc/sys/vm/drop_caches").write_text("3\n")
                t0 = time.perf_counter()
                loaded, _ = load_tensors(path)
                best[v] = min(best[v], time.perf_counter() - t0)
                del loaded
        size_gb = paths[2].stat().st_size / 1e9
    out = {
        "gb": round(size_gb, 3),
        "cpus": os.cpu_count(),
        "cache": "cold" if args.cold else "warm",
        "v1_s": round(best[1], 3),
        "v2_s": round(best[2], 3),
        "v1_gb_per_s": round(size_gb / best[1], 3),
        "v2_gb_per_s": round(size_gb / best[2], 3),
        "speedup": round(best[1] / best[2], 3),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'format':<34}{'seconds':>9}{'GB/s':>8}")
    print(f"{'1: one sha256 (baseline)':<34}{best[1]:>9.2f}{out['v1_gb_per_s']:>8.2f}")
    print(f"{'2: xxh3-128 blocks on threads':<34}{best[2]:>9.2f}{out['v2_gb_per_s']:>8.2f}")
    print(f"speedup {out['speedup']:.2f}x on {out['gb']:.2f} GB, {out['cpus']} CPUs, {out['cache']} page cache")


if __name__ == "__main__":
    main()
