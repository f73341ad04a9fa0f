"""Property tests: every codec's round-trip error stays within its quantization step, for any finite float32 input."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from geofed_hpc import codec
from geofed_hpc.config import WIRE_CODECS, CodecConfig

EPS = float(np.finfo(np.float32).eps)
TINY = 2.0**-149  # the smallest float32 subnormal
BF16_MAX = float(np.array(0x7F7F0000, np.uint32).view(np.float32))
LEVELS = {"int16": 65535, "int8": 255, "int4": 15, "int2": 3, "paper_int8": 255}
DENSE = tuple(c for c in WIRE_CODECS if c != "sparse")  # sparse sends a few values per chunk: its own tests

arrays = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=24),
    elements=st.floats(allow_nan=False, allow_infinity=False, width=32),
)


def bound(x: np.ndarray, name: str, block_size: int, global_range: float, lo: float, stochastic: bool) -> np.ndarray:
    """Per value: half a step (a whole one when rounding stochastically), plus float32 rounding slack."""
    flat = x.reshape(-1).astype(np.float64)
    share = 1.0 if stochastic else 0.5
    if name == "fp32":
        return np.zeros_like(flat)
    if name == "bf16":  # one bfloat16 ulp is at most 2**-7 |x| (2**-133 below the normal range)
        ulp = np.abs(flat) * 2.0**-7 + 2.0**-133
        return np.where(np.abs(flat) > BF16_MAX, ulp, share * ulp)
    levels = LEVELS[name]
    out = np.empty_like(flat)
    size = max(1, flat.size) if name == "paper_int8" else block_size
    for start in range(0, flat.size, size):
        block = flat[start : start + size]
        base = lo if name == "paper_int8" else block.min()
        span = global_range if name == "paper_int8" else block.max() - block.min()
        step = min(span, global_range / levels)  # never above the global step, never above the block's span
        out[start : start + size] = share * step + 4 * EPS * (abs(base) + levels * step) + 256 * TINY
    return out


@settings(max_examples=150, deadline=None)
@given(
    x=arrays,
    other=arrays,
    name=st.sampled_from(DENSE),
    block_size=st.sampled_from([64, 97, 256, 65536]),
    stochastic=st.booleans(),
)
def test_round_trip_error_is_within_one_quantization_step(
    x: np.ndarray, other: np.ndarray, name: str, block_size: int, stochastic: bool
) -> None:
    cfg = CodecConfig(name=name, block_size=block_size, stochastic_rounding=stochastic)
    tensors = {"t": x, "other": other}
    residual: dict[str, np.ndarray] = {}
    out = codec.decode(codec.encode(tensors, cfg, residual=residual))
    values = np.concatenate([x.reshape(-1), other.reshape(-1)]).astype(np.float64)
    lo = float(values.min()) if values.size else 0.0
    global_range = float(values.max()) - lo if values.size else 0.0
    stochastic = stochastic and name != "paper_int8"  # the paper's baseline always rounds to nearest
    for key, arr in tensors.items():
        y = out[key]
        assert y.dtype == np.float32 and y.shape == arr.shape and np.isfinite(y).all()
        err = np.abs(y.reshape(-1).astype(np.float64) - arr.reshape(-1).astype(np.float64))
        limit = bound(arr, name, block_size, global_range, lo, stochastic)
        worst = int(np.argmax(err - limit)) if err.size else 0
        assert np.all(err <= limit), f"{name}: error {err[worst]} > bound {limit[worst]} at {worst} of {key}"
        np.testing.assert_array_equal(residual[key], (arr.astype(np.float32) - y).astype(np.float32))


def test_bounds_hold_at_the_edges_of_float32() -> None:
    big = float(np.finfo(np.float32).max)
    x = np.concatenate(
        [
            np.linspace(-big, big, 64),  # the range itself overflows float32
            np.linspace(-3.4024831e38, big, 64),  # min + 255 * scale rounds past the largest float32
            np.linspace(0.999 * big, big, 64),  # reconstruction lands right at the top of float32
            np.linspace(-big, -0.999 * big, 64),
            np.array([1e-45, 3e-45, -1e-45, 0.0] * 16),  # subnormal steps
            np.array([2.39357e-40, 0.0] * 32),
        ]
    ).astype(np.float32)
    for name in DENSE:
        for stochastic in (False, True):
            for block_size in (64, 1 << 16):
                y = codec.decode(codec.encode({"w": x}, CodecConfig(name, block_size, stochastic_rounding=stochastic)))
                err = np.abs(y["w"].astype(np.float64) - x)
                lo, rng = float(x.min()), float(x.max()) - float(x.min())
                limit = bound(x, name, block_size, rng, lo, stochastic and name != "paper_int8")
                assert np.isfinite(y["w"]).all() and np.all(err <= limit), name
