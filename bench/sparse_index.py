"""Index coding for codec=sparse: bits per kept position of each candidate on real deltas and a Gaussian control.

    python bench/sparse_index.py --json bench/results/sparse_index.json     # ~2 min on 2 cores

Candidates, per chunk of --chunk values keeping --chunk x --density: zstd (level 1) over the gaps between offsets
as two byte planes (what codec/sparse.py does); zstd over the offsets as two byte planes; zstd over the chunk's
bitmap; Elias-Fano, with and without zstd over it; Rice codes of the gaps (unary quotients and remainders of
floor(log2(chunk / k)) bits apart, so both decode vectorised); and log2 C(chunk, k) / k, the bound for positions
drawn uniformly (clustered positions go below it).
The real deltas are tiny_llama's (conf/model/tiny_llama.yaml) after --steps AdamW steps on the shipped text
(after --warmup steps), once as one delta and once as delta + residual after --rounds rounds of error feedback
with the sparse codec (what a site sends in steady state). Encode and decode MB/s count the float32 values
covered (4 bytes each), positions only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zstandard as zstd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from geofed_hpc import codec  # noqa: E402
from geofed_hpc.codec import sparse  # noqa: E402
from geofed_hpc.config import CodecConfig  # noqa: E402

Coder = Callable[[np.ndarray, int], tuple[bytes, Callable[[], object]]]


def _zstd(data: bytes) -> tuple[bytes, Callable[[], object]]:
    blob = zstd.ZstdCompressor(level=1).compress(data)
    return blob, lambda: zstd.ZstdDecompressor().decompress(blob)


def _planes(a: np.ndarray) -> bytes:
    u = a.astype("<u2").reshape(-1)
    return u.view(np.uint8).reshape(-1, 2).T.tobytes()


def ef_bits(offs: np.ndarray, c: int) -> tuple[np.ndarray, np.ndarray]:
    """Elias-Fano of (chunks, k) sorted offsets below c: l = floor(log2(c / k)) low bits each, and a vector of
    k + (c >> l) bits with a one at (offset >> l) + i for the i-th offset (unpacked bits, chunk after chunk)."""
    rows, k = offs.shape
    low = int(math.floor(math.log2(c / k)))
    lows = ((offs[:, :, None] >> np.arange(low - 1, -1, -1)) & 1).astype(np.uint8).reshape(-1)
    high = np.zeros((rows, k + (c >> low)), np.uint8)
    np.put_along_axis(high, (offs >> low) + np.arange(k), 1, axis=1)
    return lows, high.reshape(-1)


def ef_offsets(lows: np.ndarray, high: np.ndarray, rows: int, c: int, k: int) -> np.ndarray:
    low = int(math.floor(math.log2(c / k)))
    width = k + (c >> low)
    pos = np.flatnonzero(high.reshape(rows, width)).reshape(rows, k) % width
    offs = (pos - np.arange(k)) << low
    if low:
        offs |= lows.reshape(rows, k, low).astype(np.int64) @ (1 << np.arange(low - 1, -1, -1, dtype=np.int64))
    return offs


def elias_fano(offs: np.ndarray, c: int) -> tuple[bytes, Callable[[], object]]:
    lows, highs = ef_bits(offs, c)
    blob = np.packbits(lows).tobytes() + np.packbits(highs).tobytes()
    nl = (lows.size + 7) // 8

    def dec() -> object:
        raw = np.frombuffer(blob, np.uint8)
        lb = np.unpackbits(raw[:nl], count=lows.size)
        hb = np.unpackbits(raw[nl:], count=highs.size)
        return ef_offsets(lb, hb, offs.shape[0], c, offs.shape[1])

    return blob, dec


def elias_fano_zstd(offs: np.ndarray, c: int) -> tuple[bytes, Callable[[], object]]:
    return _zstd(elias_fano(offs, c)[0])


def offsets_zstd(offs: np.ndarray, c: int) -> tuple[bytes, Callable[[], object]]:
    return _zstd(_planes(offs))


def gaps_zstd(offs: np.ndarray, c: int) -> tuple[bytes, Callable[[], object]]:
    blob, dec = _zstd(_planes(sparse.gaps(offs)))

    def full() -> object:
        raw = np.frombuffer(dec(), np.uint8)  # type: ignore[arg-type]
        n = raw.size // 2
        g = (raw[:n].astype(np.uint16) | (raw[n:].astype(np.uint16) << 8)).reshape(offs.shape)
        return sparse.offsets(g, c, "bench")

    return blob, full


def bitmap_zstd(offs: np.ndarray, c: int) -> tuple[bytes, Callable[[], object]]:
    bits = np.zeros((offs.shape[0], c), np.uint8)
    np.put_along_axis(bits, offs, 1, axis=1)
    blob, dec = _zstd(np.packbits(bits.reshape(-1)).tobytes())

    def full() -> object:
        b = np.unpackbits(np.frombuffer(dec(), np.uint8)).reshape(offs.shape[0], c)  # type: ignore[arg-type]
        return np.flatnonzero(b) % c

    return blob, full


def rice(offs: np.ndarray, c: int) -> tuple[bytes, Callable[[], object]]:
    k = offs.shape[1]
    r = int(math.floor(math.log2(c / k)))
    v = np.diff(offs, axis=1, prepend=-1).reshape(-1) - 1
    q = v >> r
    unary = np.zeros(int(q.sum()) + q.size, np.uint8)  # q zeros then a one, per gap
    unary[np.cumsum(q + 1) - 1] = 1
    rem = ((v[:, None] >> np.arange(r - 1, -1, -1)) & 1).astype(np.uint8).reshape(-1)
    ub, rb = np.packbits(unary).tobytes(), np.packbits(rem).tobytes()

    def dec() -> object:
        u = np.unpackbits(np.frombuffer(ub, np.uint8))
        ends = np.flatnonzero(u)[: v.size]
        qq = np.diff(ends, prepend=-1) - 1
        rr = np.unpackbits(np.frombuffer(rb, np.uint8), count=v.size * r).reshape(-1, r).astype(np.int64)
        vv = (qq << r) | (rr @ (1 << np.arange(r - 1, -1, -1)))
        return np.cumsum((vv + 1).reshape(offs.shape), axis=1) - 1

    return ub + rb, dec


CANDIDATES: dict[str, Coder] = {
    "zstd(gaps u16)": gaps_zstd,
    "zstd(offsets u16)": offsets_zstd,
    "zstd(bitmap)": bitmap_zstd,
    "elias_fano": elias_fano,
    "elias_fano+zstd": elias_fano_zstd,
    "rice(gaps)": rice,
}


def positions(delta: dict[str, np.ndarray], chunk: int, keep: int) -> list[tuple[np.ndarray, int]]:
    """The kept offsets of every full chunk of every tensor (tails left out: the same for every candidate)."""
    out = []
    for v in delta.values():
        flat = v.reshape(-1)
        lay = sparse.Layout.of(flat.size - flat.size % chunk, chunk, keep, 2)
        if lay.full:
            for _, c, offs, _ in sparse.select(flat[: lay.full * chunk], lay):
                out.append((offs, c))
    return out


def measure(name: str, delta: dict[str, np.ndarray], chunk: int, keep: int, repeats: int) -> list[dict[str, Any]]:
    groups = positions(delta, chunk, keep)
    kept = sum(o.size for o, _ in groups)
    covered = sum(o.shape[0] * c for o, c in groups)
    bound = sum(
        o.shape[0] * (math.lgamma(c + 1) - math.lgamma(keep + 1) - math.lgamma(c - keep + 1)) for o, c in groups
    )
    rows = [{"data": name, "coding": "uniform bound", "bits_per_index": round(bound / math.log(2) / kept, 3)}]
    for coding, coder in CANDIDATES.items():
        best_enc = best_dec = math.inf
        size = 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            made = [coder(o, c) for o, c in groups]
            best_enc = min(best_enc, time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = [dec() for _, dec in made]
            best_dec = min(best_dec, time.perf_counter() - t0)
            size = sum(len(b) for b, _ in made)
        if coding != "elias_fano+zstd":  # zstd alone restores bytes; the others give the offsets back
            for (o, _), g in zip(groups, got, strict=True):
                if not isinstance(g, bytes):
                    assert np.array_equal(np.asarray(g).reshape(o.shape), o), coding
        rows.append(
            {
                "data": name,
                "coding": coding,
                "bits_per_index": round(8 * size / kept, 3),
                "bits_per_param": round(8 * size / covered, 4),
                "encode_mb_per_s": round(4 * covered / best_enc / 1e6, 1),
                "decode_mb_per_s": round(4 * covered / best_dec / 1e6, 1),
            }
        )
    return rows


def tiny_llama_deltas(args: argparse.Namespace) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(one delta, delta + residual after args.rounds rounds of sparse error feedback) of tiny_llama."""
    import torch
    import yaml

    from geofed_hpc.config import DataConfig, ModelConfig, from_dict
    from geofed_hpc.data import BatchSampler, load_tokens, split_tokens
    from geofed_hpc.models import build_model

    torch.set_num_threads(1)
    cfg = from_dict(ModelConfig, yaml.safe_load((ROOT / "conf/model/tiny_llama.yaml").read_text()))
    model = build_model(cfg, seed=0)
    train, _ = split_tokens(load_tokens(DataConfig()), 0.02)
    sampler = BatchSampler(train, 8, cfg.context, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def steps(n: int) -> None:
        for _ in range(n):
            x, y = sampler.next_batch()
            _, loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    def arrays() -> dict[str, np.ndarray]:
        return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}

    steps(args.warmup)
    # top-k alone on every tensor (no mean rows, no dense small tensors): the positions of every tensor's values
    cfg_sparse = CodecConfig(name="sparse", density=args.density, chunk=args.chunk, mean_row=False, dense_below=0)
    ef = codec.ErrorFeedback()
    first: dict[str, np.ndarray] = {}
    last: dict[str, np.ndarray] = {}
    for r in range(args.rounds):
        before = arrays()
        steps(args.steps)
        delta = {k: v - before[k] for k, v in arrays().items()}
        if r == 0:
            first = {k: v.copy() for k, v in delta.items()}
        last = {k: v + ef.residual.get(k, 0) for k, v in delta.items()}
        payload, residual = ef.encode(delta, cfg_sparse)
        ef.commit(residual)
        sent = codec.decode(payload)
        with torch.no_grad():  # one site: the model moves by what was sent (the rest waits in the residual)
            for n, p in model.named_parameters():
                p.copy_(torch.from_numpy(before[n] + sent[n]))
    return first, last


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=Path("sparse_index.json"))
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--density", type=float, default=1 / 64)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    keep = sparse.keep_of(args.chunk, args.density)
    first, steady = tiny_llama_deltas(args)
    rng = np.random.default_rng(1)
    gauss = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in first.items()}
    rows = []
    for name, delta in (("tiny_llama delta", first), ("tiny_llama delta + residual", steady), ("gaussian", gauss)):
        rows += measure(name, delta, args.chunk, keep, args.repeats)
    print(f"{'data':<30}{'coding':<20}{'bits/index':>11}{'bits/param':>11}{'enc MB/s':>10}{'dec MB/s':>10}")
    for r in rows:
        extra = "".join(f"{r[k]:>10}" for k in ("encode_mb_per_s", "decode_mb_per_s")) if "encode_mb_per_s" in r else ""
        bpp = f"{r.get('bits_per_param', ''):>11}"
        print(f"{r['data']:<30}{r['coding']:<20}{r['bits_per_index']:>11}{bpp}{extra}")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"config": config, "keep": keep, "rows": rows}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
