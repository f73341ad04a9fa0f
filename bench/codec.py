"""Delta codec benchmark: every codec on a real LM delta and a Gaussian control, against the paper's int8 + Huffman.

    python bench/codec.py --json bench/results/codec.json             # ~30M-parameter GPT, 10 + 10 AdamW steps
    python bench/codec.py --big-codecs "" --json /tmp/codec.json      # skip the 1.2B-parameter streamed row

The real delta is a GPT's weights after minus before `--steps` AdamW steps on the shipped text (after `--warmup`
steps, so it is a mid-training delta); the control is Gaussian noise of the same shapes and RMS. Each (data,
codec) row runs in a fresh single-threaded process: first a streamed round trip (frames straight into the
decoder, pieces dropped) whose peak RSS above the RSS with the input loaded is `peak_extra_rss_mb`, then
`--repeats` timed whole-payload encodes and decodes (best of). MB/s count float32 input bytes (4 per
parameter). The 1.2B row streams a synthetic delta generated piece by piece (never held whole).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from geofed_hpc import codec
from geofed_hpc.config import WIRE_CODECS, CodecConfig

TARGET_SIZE = 0.92  # int8 bits/param <= this * paper_int8's, with rel_rms_error no larger
TARGET_ENCODE, TARGET_DECODE = 300.0, 500.0  # int8 MB/s of float32, one core
TARGET_RSS = 600.0  # MB of extra peak RSS for a 1.2B-parameter delta, streamed
SINGLE = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _status_mb(key: str) -> float:
    match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    assert match, f"no {key} in /proc/self/status (Linux only)"
    return int(match.group(1)) / 1024


def rss_mark() -> float:
    """Reset this process's peak-RSS mark to its current RSS (Linux clear_refs) and return that RSS in MB.

    (ru_maxrss would not do: a child started by fork/exec inherits its parent's peak there.)
    """
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mb("VmRSS")


def peak_rss() -> float:
    """The peak RSS (MB) since the last rss_mark."""
    return _status_mb("VmHWM")


# ------------------------------------------------------------------------------------------------ inputs


def real_delta(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """Weights after minus before `args.steps` AdamW steps of a fresh GPT on the shipped text."""
    import torch

    from geofed_hpc.config import DataConfig, ModelConfig
    from geofed_hpc.data import BatchSampler, load_tokens, split_tokens
    from geofed_hpc.models import build_model, num_params

    torch.set_num_threads(args.threads)
    cfg = ModelConfig(
        name="bench",
        arch=args.arch,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        d_ff=4 * args.d_model,
        context=args.context,
    )
    model = build_model(cfg, seed=0)
    train, _ = split_tokens(load_tokens(DataConfig(tokenizer="gpt2")), 0.02)
    sampler = BatchSampler(train, args.batch, cfg.context, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    print(f"model: {num_params(model) / 1e6:.1f}M parameters; {args.warmup} warm-up + {args.steps} AdamW steps")
    t0 = time.perf_counter()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            before = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        x, y = sampler.next_batch()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    print(f"trained in {time.perf_counter() - t0:.0f}s, last loss {loss.item():.3f}")
    return {n: p.detach().numpy() - before[n] for n, p in model.named_parameters()}


def gaussian_like(tensors: dict[str, np.ndarray], seed: int = 1) -> dict[str, np.ndarray]:
    """Gaussian noise with the same shapes and overall RMS."""
    rms = math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in tensors.values()) / numel(tensors))
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(v.shape, dtype=np.float32) * np.float32(rms)) for k, v in tensors.items()}


def numel(tensors: dict[str, np.ndarray]) -> int:
    return sum(int(v.size) for v in tensors.values())


def llama_like(params: float) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a Llama-3-style model near `params` parameters (2048 wide, 128256 vocabulary)."""
    d, ff, kv, vocab = 2048, 8192, 512, 128256
    layer = {"q": (d, d), "k": (kv, d), "v": (kv, d), "o": (d, d), "gate": (ff, d), "up": (ff, d), "down": (d, ff)}
    per_layer = sum(math.prod(s) for s in layer.values()) + 2 * d
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, d)}
    for i in range(max(1, math.ceil((params - vocab * d - d) / per_layer))):
        shapes.update({f"layers.{i}.{k}": s for k, s in layer.items()})
        shapes.update({f"layers.{i}.norm1": (d,), f"layers.{i}.norm2": (d,)})
    shapes["norm"] = (d,)
    return shapes


# ------------------------------------------------------------------------------------------------ workers


def streamed(tensors: dict[str, Any], cfg: CodecConfig) -> tuple[int, int]:
    """Encode frame by frame straight into the decoder, dropping each decoded piece: (payload bytes, values)."""
    sent = 0

    def counted(frames: Any) -> Any:
        nonlocal sent
        for f in frames:
            sent += len(f)
            yield f

    values = 0
    for piece in codec.StreamDecoder().pieces(counted(codec.encode_frames(tensors, cfg))):
        values += piece.values.size
    return sent, values


def warm_up(cfg: CodecConfig) -> None:
    codec.decode(codec.encode({"w": np.linspace(-1, 1, 4096, dtype=np.float32).reshape(64, 64)}, cfg))
    gc.collect()


def measure(path: str, name: str, block_size: int, repeats: int) -> dict[str, Any]:
    """One (data, codec) row, in this (fresh) process."""
    cfg = CodecConfig(name=name, block_size=block_size)
    with np.load(path, allow_pickle=False) as npz:
        tensors = {k: npz[k] for k in npz.files}
    n = numel(tensors)
    warm_up(cfg)
    before = rss_mark()
    streamed(tensors, cfg)
    extra = peak_rss() - before
    enc, dec = math.inf, math.inf
    for _ in range(repeats if name != "paper_int8" else 1):  # the Huffman baseline is slow; one run
        t0 = time.perf_counter()
        payload = codec.encode(tensors, cfg)
        t1 = time.perf_counter()
        out = codec.decode(payload)
        t2 = time.perf_counter()
        enc, dec = min(enc, t1 - t0), min(dec, t2 - t1)
    err2 = sum(float(np.sum((out[k].astype(np.float64) - v) ** 2)) for k, v in tensors.items())
    sq = sum(float(np.sum(v.astype(np.float64) ** 2)) for v in tensors.values())
    return {
        "codec": name,
        "bits_per_param": 8 * len(payload) / n,
        "rel_rms_error": math.sqrt(err2 / sq) if sq else 0.0,
        "encode_mb_per_s": 4 * n / 1e6 / enc,
        "decode_mb_per_s": 4 * n / 1e6 / dec,
        "peak_extra_rss_mb": extra,
    }


def big(name: str, block_size: int, params: float) -> dict[str, Any]:
    """A synthetic delta of `params` parameters, generated piece by piece, streamed through encode and decode."""
    shapes = llama_like(params)

    def reader(index: int) -> Any:
        def read(start: int, stop: int) -> np.ndarray:
            x = np.random.default_rng([index, start]).standard_normal(stop - start, dtype=np.float32)
            x *= np.float32(1e-3)
            return x

        return read

    sources = {k: codec.TensorSource(s, reader(i)) for i, (k, s) in enumerate(shapes.items())}
    n = sum(math.prod(s) for s in shapes.values())
    cfg = CodecConfig(name=name, block_size=block_size)
    warm_up(cfg)
    before = rss_mark()
    t0 = time.perf_counter()
    sent, values = streamed(sources, cfg)
    seconds = time.perf_counter() - t0
    assert values == n
    return {
        "codec": name,
        "params": n,
        "bits_per_param": 8 * sent / n,
        "seconds_with_generation": seconds,
        "peak_extra_rss_mb": peak_rss() - before,
    }


def worker(argv: list[str]) -> dict[str, Any]:
    """Run one measurement in a fresh single-threaded process; its JSON row comes back on stdout's last line."""
    env = {**os.environ, **SINGLE}
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", *argv], capture_output=True, text=True, env=env, timeout=3600
    )
    if proc.returncode != 0:
        raise SystemExit(f"worker {argv} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ report


def targets(rows: list[dict[str, Any]], big_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    real = {r["codec"]: r for r in rows if r["data"] == "real"}
    out = []
    if "int8" in real and "paper_int8" in real:
        mine, paper = real["int8"], real["paper_int8"]
        ratio = mine["bits_per_param"] / paper["bits_per_param"]
        out.append(
            {"target": f"int8 bits/param <= {TARGET_SIZE} x paper_int8", "value": ratio, "ok": ratio <= TARGET_SIZE}
        )
        out.append({
            "target": "int8 rel_rms_error <= paper_int8's",
            "value": mine["rel_rms_error"] / paper["rel_rms_error"],
            "ok": mine["rel_rms_error"] <= paper["rel_rms_error"],
        })  # fmt: skip
    if "int8" in real:
        enc, dec = real["int8"]["encode_mb_per_s"], real["int8"]["decode_mb_per_s"]
        out.append({"target": f"int8 encode >= {TARGET_ENCODE:g} MB/s", "value": enc, "ok": enc >= TARGET_ENCODE})
        out.append({"target": f"int8 decode >= {TARGET_DECODE:g} MB/s", "value": dec, "ok": dec >= TARGET_DECODE})
    for r in big_rows:
        label = f"{r['codec']} peak extra RSS, {r['params'] / 1e9:.2f}B params streamed < {TARGET_RSS:g} MB"
        out.append({"target": label, "value": r["peak_extra_rss_mb"], "ok": r["peak_extra_rss_mb"] < TARGET_RSS})
    return out


def print_table(rows: list[dict[str, Any]], big_rows: list[dict[str, Any]], goals: list[dict[str, Any]]) -> None:
    paper = {r["data"]: r["bits_per_param"] for r in rows if r["codec"] == "paper_int8"}
    head = f"{'data':<9}{'codec':<12}{'bits/param':>11}{'vs paper':>9}{'rel rms err':>13}{'enc MB/s':>10}"
    print(head + f"{'dec MB/s':>10}{'peak +RSS MB':>14}")
    for r in rows:
        vs = f"{r['bits_per_param'] / paper[r['data']]:.3f}" if r["data"] in paper else "-"
        print(
            f"{r['data']:<9}{r['codec']:<12}{r['bits_per_param']:>11.3f}{vs:>9}{r['rel_rms_error']:>13.3e}"
            f"{r['encode_mb_per_s']:>10.0f}{r['decode_mb_per_s']:>10.0f}{r['peak_extra_rss_mb']:>14.0f}"
        )
    for r in big_rows:
        print(
            f"{'synth':<9}{r['codec']:<12}{r['bits_per_param']:>11.3f}{'-':>9}{'-':>13}"
            f"{4 * r['params'] / 1e6 / r['seconds_with_generation']:>10.0f}{'(enc+dec+gen)':>10}"
            f"{r['peak_extra_rss_mb']:>14.0f}   {r['params'] / 1e9:.2f}B params streamed"
        )
    for g in goals:
        print(f"{'PASS' if g['ok'] else 'FAIL'}  {g['target']}: {g['value']:.3f}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        kind, *rest = sys.argv[2:]
        row = (
            measure(rest[0], rest[1], int(rest[2]), int(rest[3]))
            if kind == "measure"
            else big(rest[0], int(rest[1]), float(rest[2]))
        )
        print(json.dumps(row))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=Path("bench/results/codec.json"))
    p.add_argument("--codecs", default=",".join(WIRE_CODECS))
    p.add_argument("--block-size", type=int, default=CodecConfig().block_size)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--arch", default="gpt2", choices=["gpt2", "llama"])
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2, help="torch threads for training the model (not the codec)")
    p.add_argument("--big-codecs", default="int8", help="codecs for the streamed 1.2B row ('' to skip)")
    p.add_argument("--big-params", type=float, default=1.2e9)
    args = p.parse_args()
    if args.steps < 10:
        p.error("--steps: the benchmark measures a delta of at least 10 AdamW steps")
    names = [c for c in args.codecs.split(",") if c]
    real = real_delta(args)
    n = numel(real)
    if n < 20_000_000:
        p.error(f"the model has {n} parameters; the benchmark needs at least 20M (raise --d-model or --layers)")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for data, tensors in (("real", real), ("gaussian", gaussian_like(real))):
            path = str(Path(tmp) / f"{data}.npz")
            np.savez(path, **tensors)
            for name in names:
                row = {"data": data, **worker(["measure", path, name, str(args.block_size), str(args.repeats)])}
                rows.append(row)
                print(f"  {data:<9}{name:<12}{row['bits_per_param']:7.3f} bits/param", flush=True)
    big_rows = []
    for name in [c for c in args.big_codecs.split(",") if c]:
        print(f"  streaming a {args.big_params / 1e9:g}B-parameter synthetic delta with {name} ...", flush=True)
        big_rows.append(worker(["big", name, str(args.block_size), str(args.big_params)]))
    goals = targets(rows, big_rows)
    print_table(rows, big_rows, goals)
    config = {k: v for k, v in vars(args).items() if k != "json"}
    report = {"params": n, "config": config, "rows": rows, "big": big_rows, "targets": goals}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
