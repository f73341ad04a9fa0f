"""Checkpoint load benchmark: tensor-file format 2 (today's) against safetensors with the same checksums, in one run.

    python bench/ckpt_load.py --json bench/results/ckpt_load.json             # 5.4 GB: a 354M site's checkpoint
    python bench/ckpt_load.py --gb 2 --repeats 3 --json /tmp/ckpt_load.json   # quicker

The same tensors are written once in each layout, then each file is loaded `--repeats` times, alternating, with
the files in the page cache (a restarted site reads the checkpoint its previous segment just wrote); `--cold`
drops the page cache before every load (root only: a site requeued on another node reads from the shared
filesystem). The layouts:

- `v1`: format 1, one sequential sha256 over the file (the first release's);
- `v2`: format 2, 64 MiB blocks read on several threads, each hashed with xxh3-128 as it lands (today's);
- `safetensors+xxh3`: `safetensors.numpy.save_file` with the xxh3-128 of every 64 MiB block of every tensor in
  the header's `__metadata__`; loaded with `safe_open(...).get_tensors()`, then the blocks checked on threads, so
  a torn or damaged file is still refused (what a switch to safetensors would ship);
- `safetensors`: `safetensors.numpy.load_file` alone, no checksum (the library's floor).

Reported: best-of seconds and GB/s per layout, and `ratio` = each layout's seconds / format 2's (above 1: slower).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from geofed_hpc.ckpt.tensorfile import BLOCK, READERS, load_tensors, save_tensors  # noqa: E402

TENSOR_BYTES = 100 << 20  # a transformer's largest matrices are about this size


def block_digests(arr: np.ndarray) -> list[str]:
    """xxh3-128 of each BLOCK bytes of one tensor's little-endian bytes (one digest of nothing when empty)."""
    view = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
    return [xxhash.xxh3_128(view[i : i + BLOCK]).hexdigest() for i in range(0, max(len(view), 1), BLOCK)]


def save_checked(path: Path, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
    """safetensors with every tensor's block digests (and a digest of that list and `meta`) in `__metadata__`."""
    with ThreadPoolExecutor(READERS) as pool:
        digests = list(pool.map(block_digests, tensors.values()))
    blocks = json.dumps([[name, d] for name, d in zip(tensors, digests, strict=True)])
    text = json.dumps(meta)
    seal = xxhash.xxh3_128(f"{text}\n{blocks}".encode()).hexdigest()
    metadata = {"format": "geofed-tensors", "version": "3", "meta": text, "blocks": blocks, "seal": seal}
    save_file(dict(tensors), str(path), metadata=metadata)


def load_checked(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Load with safetensors, then check every block on READERS threads; ValueError naming the file if any differs."""
    with safe_open(str(path), framework="np") as f:
        metadata = f.metadata() or {}
        tensors = f.get_tensors()
    text, blocks = metadata.get("meta", ""), metadata.get("blocks", "")
    if xxhash.xxh3_128(f"{text}\n{blocks}".encode()).hexdigest() != metadata.get("seal"):
        raise ValueError(f"{path}: its header does not match its checksum")
    expected = json.loads(blocks)
    if sorted(tensors) != sorted(name for name, _ in expected):
        raise ValueError(f"{path}: its tensors are not the ones its header lists")
    with ThreadPoolExecutor(READERS) as pool:
        got = list(pool.map(block_digests, (tensors[name] for name, _ in expected)))
    for (name, want), have in zip(expected, got, strict=True):
        if want != have:
            raise ValueError(f"{path}: tensor {name!r} does not match its xxh3-128 checksum")
    return {name: tensors[name] for name, _ in expected}, json.loads(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=5.4, help="checkpoint size in GB (default: a 354M site's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="", help="where to write the files (default: a temp dir)")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each load (root)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    total = int(args.gb * 1e9)
    rng = np.random.default_rng(0)
    sizes = [TENSOR_BYTES // 4] * (total // TENSOR_BYTES) + [max(1, total % TENSOR_BYTES // 4)]
    tensors = {f"t{i}": rng.standard_normal(n, dtype=np.float32) for i, n in enumerate(sizes)}
    layouts: dict[str, tuple[str, Callable[[Path], Any]]] = {
        "v1": ("format 1: one sha256", load_tensors),
        "v2": ("format 2: xxh3-128 blocks, threads", load_tensors),
        "safetensors+xxh3": ("safetensors + xxh3-128 blocks", load_checked),
        "safetensors": ("safetensors, no checksum", load_file),
    }
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        paths = {name: Path(tmp) / f"{name}.bin" for name in layouts}
        saved: dict[str, float] = {}
        for name, path in paths.items():
            t0 = time.perf_counter()
            if name in ("v1", "v2"):
                save_tensors(path, tensors, {"bench": True}, version=int(name[1]))
            elif name == "safetensors+xxh3":
                save_checked(path, tensors, {"bench": True})
            else:
                save_file(tensors, str(path))
            saved[name] = time.perf_counter() - t0
        loaded, _ = load_checked(paths["safetensors+xxh3"])
        assert all(np.array_equal(loaded[k], v) for k, v in tensors.items()), "safetensors changed the tensors"
        del tensors, loaded
        best = dict.fromkeys(layouts, float("inf"))
        for _ in range(args.repeats):
            for name, (_, load) in layouts.items():
                if args.cold:
                    os.sync()
                    Path("/proc/sys/vm/drop_caches").write_text("3\n")
                t0 = time.perf_counter()
                out = load(paths[name])
                best[name] = min(best[name], time.perf_counter() - t0)
                del out
        sizes_gb = {name: path.stat().st_size / 1e9 for name, path in paths.items()}
        with paths["safetensors+xxh3"].open("r+b") as f:  # the checksums are real: one flipped byte is refused
            f.seek(paths["safetensors+xxh3"].stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        try:
            load_checked(paths["safetensors+xxh3"])
            raise AssertionError("a flipped byte in a safetensors payload went unnoticed")
        except ValueError as e:
            assert "checksum" in str(e), e
    rows = [
        {
            "layout": name,
            "what": what,
            "gb": round(sizes_gb[name], 3),
            "load_s": round(best[name], 3),
            "gb_per_s": round(sizes_gb[name] / best[name], 3),
            "ratio": round(best[name] / best["v2"], 3),
            "save_s": round(saved[name], 3),
        }
        for name, (what, _) in layouts.items()
    ]
    out = {"gb": round(sizes_gb["v2"], 3), "cpus": os.cpu_count(), "cache": "cold" if args.cold else "warm"}
    out |= {"repeats": args.repeats, "baseline": "v2", "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'layout':<36}{'load s':>8}{'GB/s':>7}{'vs v2':>7}{'save s':>8}")
    for row in rows:
        print(f"{row['what']:<36}{row['load_s']:>8.2f}{row['gb_per_s']:>7.2f}{row['ratio']:>7.2f}{row['save_s']:>8.2f}")
    print(f"best of {args.repeats} on {out['gb']:.2f} GB, {out['cpus']} CPUs, {out['cache']} page cache")


if __name__ == "__main__":
    main()
