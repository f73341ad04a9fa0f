"""Delta codec benchmark: per-block int8 vs the paper's global min-max int8 vs lossless fp32."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from geofed_hpc import codec
from geofed_hpc.config import CodecConfig


def adam_like_delta(numel: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Deltas after Adam steps: mostly ~lr-sized values, heavier tails, some rows untouched (zeros)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_t(df=4, size=numel) * 1e-3).astype(np.float32)
    x[rng.random(numel) < 0.2] = 0.0
    return {"delta": x}


def measure(name: str, tensors: dict[str, np.ndarray], cfg: CodecConfig, repeats: int) -> dict[str, float | str]:
    raw = sum(v.nbytes for v in tensors.values())
    enc_s, dec_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        payload = codec.encode(tensors, cfg)
        t1 = time.perf_counter()
        out = codec.decode(payload)
        t2 = time.perf_counter()
        enc_s.append(t1 - t0)
        dec_s.append(t2 - t1)
    err = max(float(np.max(np.abs(out[k] - v))) if v.size else 0.0 for k, v in tensors.items())
    rms = float(np.sqrt(np.mean([np.mean((out[k] - v) ** 2) for k, v in tensors.items()])))
    return {
        "codec": name,
        "bytes": len(payload),
        "bits_per_value": 8 * len(payload) / (raw / 4),
        "max_abs_error": err,
        "rms_error": rms,
        "encode_MBps": raw / 1e6 / min(enc_s),
        "decode_MBps": raw / 1e6 / min(dec_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=int, default=16_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("bench/results/codec.json"))
    args = parser.parse_args()
    tensors = adam_like_delta(args.numel)
    rows = [
        measure(
            "int8 global min-max (paper baseline)",
            tensors,
            CodecConfig(name="int8", block_size=args.numel),
            args.repeats,
        ),
        measure("int8 per-block 65536", tensors, CodecConfig(name="int8", block_size=65536), args.repeats),
        measure("int8 per-block 4096", tensors, CodecConfig(name="int8", block_size=4096), args.repeats),
        measure("fp32 lossless", tensors, CodecConfig(name="fp32"), args.repeats),
    ]
    base = rows[0]
    for r in rows:
        r["size_vs_baseline"] = float(r["bytes"]) / float(base["bytes"])
        r["rms_error_vs_baseline"] = float(r["rms_error"]) / float(base["rms_error"]) if base["rms_error"] else 0.0
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"numel": args.numel, "rows": rows}, indent=2))
    print(f"{'codec':<38}{'bits/val':>9}{'size':>7}{'rms err':>10}{'max err':>10}{'enc MB/s':>10}{'dec MB/s':>10}")
    for r in rows:
        print(
            f"{r['codec']:<38}{r['bits_per_value']:>9.2f}{r['size_vs_baseline']:>7.2f}{r['rms_error']:>10.2e}"
            f"{r['max_abs_error']:>10.2e}{r['encode_MBps']:>10.0f}{r['decode_MBps']:>10.0f}"
        )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
