"""codec=sparse: top-k per chunk, kept values within a step, the residual holds exactly what was not sent."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from geofed_hpc import codec
from geofed_hpc.codec import frames, sparse, stream
from geofed_hpc.codec.schemes import MEAN_ROW_MIN_KEPT
from geofed_hpc.codec.stream import _DATA, _END, piece_len
from geofed_hpc.config import CodecConfig, PSConfig, RunConfig
from geofed_hpc.errors import CodecError, ConfigError

finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
arrays = hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=300), elements=finite)
# (chunk, density): the kept count chunk x density is whole; a tail chunk keeps ceil(its length x density)
SHAPES = st.sampled_from([(64, 1 / 64), (64, 1 / 8), (128, 0.5), (256, 1 / 64), (4096, 1 / 64)])
TOP_K_ONLY = {"dense_below": 0, "mean_row": False}  # every tensor sparse, no mean rows: top-k alone


def kept_bound(kept: np.ndarray, bits: int) -> float:
    """The quantization step of a chunk's kept values (half of it when rounding to one of several levels), plus
    float32 rounding slack."""
    mag = np.abs(kept.astype(np.float64))
    levels = 1 << (bits - 1)
    span = float(mag.max() - mag.min()) if mag.size else 0.0
    step = span / (levels - 1) if levels > 1 else span
    share = 0.5 if levels > 1 else 1.0
    return share * step * (1 + 1e-6) + 4 * float(np.finfo(np.float32).eps) * float(mag.max(initial=0)) + 1e-44


@settings(max_examples=150, deadline=None)
@given(x=arrays, shape=SHAPES, bits=st.integers(1, 4))
def test_top_k_per_chunk_within_a_step_and_the_residual_is_exactly_what_was_not_sent(
    x: np.ndarray, shape: tuple[int, float], bits: int
) -> None:
    chunk, density = shape
    cfg = CodecConfig(name="sparse", chunk=chunk, density=density, value_bits=bits, **TOP_K_ONLY)
    residual: dict[str, np.ndarray] = {}
    y = codec.decode(codec.encode({"t": x}, cfg, residual=residual))["t"]
    np.testing.assert_array_equal(residual["t"], x - y)  # the residual: what decoding does not give back
    flat, got, res = x.reshape(-1), y.reshape(-1), residual["t"].reshape(-1)
    keep = round(chunk * density)
    kept = codec.decode_sparse(codec.encode({"t": x}, cfg))["t"]
    assert isinstance(kept, codec.SparseTensor)
    sent = kept.indices
    for start in range(0, flat.size, chunk):
        stop = min(flat.size, start + chunk)
        k = min(stop - start, math.ceil((stop - start) * keep / chunk))
        mine = sent[(sent >= start) & (sent < stop)]
        assert mine.size == k  # exactly k positions per chunk, strictly increasing
        unsent = np.setdiff1d(np.arange(start, stop), mine)
        np.testing.assert_array_equal(got[unsent], 0)  # nothing else is sent ...
        np.testing.assert_array_equal(res[unsent], flat[unsent])  # ... so the residual holds those values whole
        if unsent.size:  # the kept ones are the largest magnitudes
            assert np.abs(flat[mine]).min() >= np.abs(flat[unsent]).max()
        err = np.abs(got[mine].astype(np.float64) - flat[mine])
        assert err.max(initial=0) <= kept_bound(flat[mine], bits)
        assert np.all((got[mine] == 0) | (np.signbit(got[mine]) == np.signbit(flat[mine])))


def drifting(n: int, seed: int = 0) -> list[np.ndarray]:
    """Deltas with a fixed direction plus noise: what a codec that drops most values would lose every round."""
    rng = np.random.default_rng(seed)
    drift = rng.standard_normal(8192).astype(np.float32) * 0.01
    return [(drift + 0.005 * rng.standard_normal(8192)).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("name", ["sparse", "int2"])
def test_error_feedback_over_many_rounds_tracks_the_true_sum(name: str) -> None:
    cfg = CodecConfig(name=name, chunk=1024, density=1 / 64, block_size=1024, dense_below=0)
    ef = codec.ErrorFeedback()
    true_sum = np.zeros(8192, np.float64)
    sent_sum = np.zeros(8192, np.float64)
    plain_sum = np.zeros(8192, np.float64)
    gaps, plain_gaps = [], []
    for d in drifting(400):
        true_sum += d
        payload, residual = ef.encode({"w": d.copy()}, cfg)
        ef.commit(residual)
        sent_sum += codec.decode(payload)["w"]
        plain_sum += codec.decode(codec.encode({"w": d}, cfg))["w"]
        # nothing lost, nothing counted twice: what was sent plus what waits is the true sum
        np.testing.assert_allclose(sent_sum + ef.residual.get("w", 0), true_sum, rtol=0, atol=1e-4)
        gaps.append(float(np.abs(sent_sum - true_sum).max()))
        plain_gaps.append(float(np.abs(plain_sum - true_sum).max()))
    assert max(gaps[300:]) <= 1.2 * max(gaps[100:200])  # bounded: the gap stops growing
    assert plain_gaps[-1] > 1.8 * plain_gaps[199] and plain_gaps[-1] > 10 * gaps[-1]  # without it: linear growth


# ---------------------------------------------------------------------------------------------- bad input
def crafted(content: bytes, n: int, chunk: int, keep: int, bits: int) -> bytes:
    """A sparse payload framed by hand (codec/stream.py's layout) around `content`, one tensor `w` of n values."""
    sid = b"sparse!!"
    header = {
        "codec": "sparse",
        "block_size": chunk,
        "piece": piece_len(chunk),
        "tensors": [{"name": "w", "shape": [n]}],
        "sparse": {"keep": keep, "bits": bits},
    }
    blob = zstandard.ZstdCompressor().compress(content)
    out = [frames.pack(frames.HEADER, sid + json.dumps(header).encode())]
    out.append(frames.pack(frames.DATA, _DATA.pack(sid, 0, 0, 0, 1) + blob))
    out.append(frames.pack(frames.END, _END.pack(sid, 2, n)))
    return b"".join(out)


def content(gaps: list[list[int]], lo: float = 1.0, step: float = 0.5, bits: int = 2) -> bytes:
    rows = len(gaps)
    k = len(gaps[0])
    g = np.array(gaps, np.uint16).reshape(-1)
    sym = np.zeros(rows * k, np.uint8)
    parts = [np.full(rows, lo, "<f4").tobytes(), np.full(rows, step, "<f4").tobytes()]
    parts.append(sparse.pack_bits(sym, bits).tobytes())
    parts.append((g & 0xFF).astype(np.uint8).tobytes() + (g >> 8).astype(np.uint8).tobytes())
    return b"".join(parts)


BAD_SPARSE = {
    "out of range": (content([[3, 10, 60]]), "past its 64 values"),  # positions 3, 13, 73 in a 64-value chunk
    "not increasing": (content([[3, 0, 5]]), "not strictly increasing"),
    "negative scale": (content([[1, 2, 3]], lo=-1.0), "NaN, Inf or negative"),
    "NaN step": (content([[1, 2, 3]], step=float("nan")), "NaN, Inf or negative"),
    "short": (content([[1, 2, 3]])[:-1], "ends early"),
    "long": (content([[1, 2, 3]]) + b"\0", "more than the"),
}


@pytest.mark.parametrize("case", BAD_SPARSE.values(), ids=BAD_SPARSE.keys())
def test_a_corrupt_sparse_piece_is_refused_by_name(case: tuple[bytes, str]) -> None:
    body, message = case
    with pytest.raises(CodecError, match=message):
        codec.decode(crafted(body, 64, 64, 3, 2))
    with pytest.raises(CodecError, match=message):
        codec.decode_sparse(crafted(body, 64, 64, 3, 2))


def test_the_crafted_payload_is_valid_when_its_positions_are() -> None:
    got = codec.decode_sparse(crafted(content([[3, 10, 20]]), 64, 64, 3, 2))["w"]
    assert isinstance(got, codec.SparseTensor)
    np.testing.assert_array_equal(got.indices, [3, 13, 33])
    np.testing.assert_array_equal(got.values, [1.0, 1.0, 1.0])


def test_each_chunk_may_keep_its_first_value_but_no_position_twice() -> None:
    """A row's first gap is its first position (0 is fine); a zero gap anywhere else repeats a position."""
    rows = content([[3, 10, 20], [0, 5, 6]])
    got = codec.decode_sparse(crafted(rows, 128, 64, 3, 2))["w"]
    assert isinstance(got, codec.SparseTensor)
    np.testing.assert_array_equal(got.indices, [3, 13, 33, 64, 69, 75])
    with pytest.raises(CodecError, match="sparse chunk 1: positions are not strictly increasing"):
        codec.decode_sparse(crafted(content([[0, 1, 2], [4, 0, 1]]), 128, 64, 3, 2))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_dequantized_values_are_the_signed_level_rounded_once(bits: int) -> None:
    """+-(lo + q * step) in float64, rounded once to float32, a sign bit of zero magnitude included (-0.0): what
    sites and the PS compute alike, bit for bit; and symbols unpack to exactly what was packed."""
    rng = np.random.default_rng(bits)
    rows, k = 50, 16
    lo = np.abs(rng.standard_normal(rows)).astype(np.float32)
    lo[:5] = 0.0
    step = (np.abs(rng.standard_normal(rows)) / 3).astype(np.float32)
    step[5:10] = 0.0
    sym = rng.integers(0, 1 << bits, (rows, k)).astype(np.uint8)
    unpacked = sparse.unpack_bits(sparse.pack_bits(sym.reshape(-1), bits), sym.size, bits)
    np.testing.assert_array_equal(unpacked, sym.reshape(-1))
    q = (sym & ((1 << (bits - 1)) - 1)).astype(np.float64)
    mag = (lo.astype(np.float64)[:, None] + q * step.astype(np.float64)[:, None]).astype(np.float32)
    want = np.where(sym >> (bits - 1) == 1, -mag, mag)
    got = sparse.dequantize(lo, step, sym, bits)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    negative_zero = got[:5][sym[:5] == 1 << (bits - 1)]  # the sign set on a zero level (lo = 0, q = 0)
    assert negative_zero.size and (negative_zero == 0).all() and np.signbit(negative_zero).all()


@pytest.mark.parametrize(
    "keep, bits, chunk, message",
    [
        (65, 2, 64, "sparse.keep must be 1..64"),  # a frame claiming more values than its chunk
        (0, 2, 64, "sparse.keep must be 1..64"),
        (3, 5, 64, "sparse.bits must be 1..4"),
        (3, 0, 64, "sparse.bits must be 1..4"),
        (3, 2, 1 << 17, "at most 65536 values"),
    ],
)
def test_a_sparse_header_out_of_bounds_is_refused(keep: int, bits: int, chunk: int, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        codec.decode(crafted(content([[1, 2, 3]]), 64, chunk, keep, bits))


@pytest.mark.parametrize(
    "fields, key",
    [
        ({"density": 0.01}, "codec.density"),  # 4096 x 0.01 = 40.96 values per chunk
        ({"chunk": 100}, "codec.density"),  # 100 / 64
        ({"density": 0.75}, "codec.density"),
        ({"chunk": 32}, "codec.chunk"),
        ({"value_bits": 5}, "codec.value_bits"),
        ({"value_bits": 0}, "codec.value_bits"),
        ({"dense_codec": "int3"}, "codec.dense_codec"),
        ({"dense_below": (1 << 24) + 1}, "codec.dense_below"),
        ({"dense_below": -1}, "codec.dense_below"),
    ],
)
def test_config_refuses_a_density_chunk_or_value_bits_that_do_not_fit(fields: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        CodecConfig(name="sparse", **fields)


def test_config_refuses_a_downlink_density_that_does_not_divide_the_chunk() -> None:
    with pytest.raises(ConfigError, match="ps.downlink_density"):
        RunConfig(ps=PSConfig(downlink_codec="sparse", downlink_density=0.01))
    assert RunConfig(ps=PSConfig(downlink_codec="sparse", downlink_density=1 / 16)).ps.downlink_density == 1 / 16


def test_sparse_and_int2_are_far_smaller_than_int8() -> None:
    rng = np.random.default_rng(0)
    x = {"w": rng.standard_normal(1 << 16).astype(np.float32)}
    bits = {n: 8 * len(codec.encode(x, CodecConfig(name=n))) / (1 << 16) for n in ("int8", "int4", "int2", "sparse")}
    assert bits["sparse"] < 0.25 and bits["int2"] < 2.2 and bits["int4"] < 4.2 < 6 < bits["int8"]


@settings(max_examples=300, deadline=None)
@given(data=st.binary(min_size=0, max_size=200), n=st.integers(1, 300), keep=st.integers(1, 64), bits=st.integers(1, 4))
def test_any_sparse_content_decodes_to_valid_positions_or_is_refused(data: bytes, n: int, keep: int, bits: int) -> None:
    size = sparse.Layout.of(n, 64, keep, bits).size()
    body = (data * (size // max(1, len(data)) + 1))[:size] if data else bytes(size)
    try:
        got = codec.decode_sparse(crafted(body, n, 64, keep, bits))["w"]
    except CodecError as exc:
        assert str(exc)
        return
    assert isinstance(got, codec.SparseTensor)
    assert got.indices.size == 0 or (np.diff(got.indices) > 0).all() and 0 <= got.indices[0] and got.indices[-1] < n
    assert np.isfinite(got.values).all()


# ---------------------------------------------------------------------------------------------- mean rows, dense
def tall(chunk: int, density: float, cols: int) -> st.SearchStrategy[np.ndarray]:
    """Matrices tall enough to send a mean row (rows x density >= 64), of any finite values up to 1e30."""
    least = round(MEAN_ROW_MIN_KEPT / density)
    values = st.floats(float(np.float32(-1e30)), float(np.float32(1e30)), width=32)
    return st.integers(least, least + 40).flatmap(
        lambda rows: hnp.arrays(np.float32, (rows, cols), elements=values, fill=values)
    )


def with_mean_row(x: np.ndarray, cfg: CodecConfig) -> tuple[np.ndarray, codec.SparseTensor]:
    """(what decoding gives, what the PS holds) of matrix `x`; the residual is exactly what decoding loses, and the
    PS's sparse tensor is the site's decoded one, bit for bit."""
    residual: dict[str, np.ndarray] = {}
    payload = codec.encode({"t": x}, cfg, residual=residual)
    y = codec.decode(payload)["t"]
    np.testing.assert_array_equal(residual["t"], x - y)
    got = codec.decode_sparse(payload)["t"]
    assert isinstance(got, codec.SparseTensor)
    np.testing.assert_array_equal(got.dense(), y)
    return y, got


@settings(max_examples=60, deadline=None)
@given(data=st.data(), shift=st.floats(-1e3, 1e3, width=32), shape=SHAPES, bits=st.integers(1, 4))
def test_a_matrix_sends_its_mean_row_and_top_k_of_what_is_left(
    data: st.DataObject, shift: float, shape: tuple[int, float], bits: int
) -> None:
    chunk, density = shape
    x = data.draw(tall(chunk, density, data.draw(st.integers(1, 5))))
    x = x + np.float32(shift) * np.arange(x.shape[-1], dtype=np.float32)  # a common part in every row
    y, got = with_mean_row(x, CodecConfig(name="sparse", chunk=chunk, density=density, value_bits=bits, dense_below=0))
    assert got.mean is not None
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    np.testing.assert_allclose(got.mean, rows.mean(axis=0), rtol=1e-6, atol=1e-30 + 1e-6 * np.abs(rows).max())
    left = (rows - got.mean).reshape(-1)  # what top-k picks from
    flat = y.reshape(-1).astype(np.float64) - np.resize(got.mean.astype(np.float64), y.size)
    keep = round(chunk * density)
    for start in range(0, left.size, chunk):
        stop = min(left.size, start + chunk)
        mine = got.indices[(got.indices >= start) & (got.indices < stop)]
        assert mine.size == min(stop - start, math.ceil((stop - start) * keep / chunk))
        unsent = np.setdiff1d(np.arange(start, stop), mine)
        np.testing.assert_array_equal(y.reshape(-1)[unsent], np.resize(got.mean, y.size)[unsent])  # the mean alone
        if unsent.size:
            assert np.abs(left[mine]).min() >= np.abs(left[unsent]).max() * (1 - 1e-6)
        err = np.abs(flat[mine] - left[mine])
        assert err.max(initial=0) <= kept_bound(left[mine], bits) + 4e-7 * np.abs(rows).max()


def test_the_mean_row_carries_a_shared_shift_that_top_k_alone_leaves_behind() -> None:
    """An embedding-like delta: every row moves along one direction, a few rows more. With its mean row the codec
    sends the shared part of the quiet rows; top-k alone spends its budget on the loud rows and leaves the shift
    of the others in the residual."""
    rng = np.random.default_rng(5)
    x = np.tile(rng.standard_normal(64).astype(np.float32) * 1e-3, (4096, 1))
    loud = rng.choice(4096, 40, replace=False)
    x[loud] += rng.standard_normal((40, 64)).astype(np.float32) * 1e-2
    quiet = np.setdiff1d(np.arange(4096), loud)
    errors = {}
    for mean_row in (True, False):
        residual: dict[str, np.ndarray] = {}
        codec.encode({"w": x}, CodecConfig(name="sparse", mean_row=mean_row), residual=residual)
        errors[mean_row] = float(np.linalg.norm(residual["w"][quiet]) / np.linalg.norm(x[quiet]))
    assert errors[True] < 0.05 and errors[False] > 0.9


def test_a_mean_row_lines_up_across_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "PIECE", 256)  # 910 values in rows of 7: four pieces, three starting mid-row
    x = (np.random.default_rng(6).standard_normal((130, 7)) + np.arange(7)).astype(np.float32)
    cfg = CodecConfig(name="sparse", chunk=64, density=0.5, dense_below=0)  # a mean row from 128 rows on
    y, got = with_mean_row(x, cfg)
    assert got.mean is not None
    np.testing.assert_allclose(got.mean, x.astype(np.float64).mean(axis=0), rtol=1e-6)
    assert np.abs(x - y).max() < np.abs(x - x.mean(axis=0)).max()
    short = codec.decode_sparse(codec.encode({"w": x[:127]}, cfg))["w"]  # 127 rows x 0.5 < 64: no mean row
    assert isinstance(short, codec.SparseTensor) and short.mean is None


@pytest.mark.parametrize(
    "col, start, n", [(7, 0, 350), (7, 256, 94), (7, 3, 2), (64, 4095, 70), (1, 5, 9), (5, 4, 1), (3, 0, 0)]
)
def test_column_sums_and_tile_line_up_at_any_start(col: int, start: int, n: int) -> None:
    x = np.random.default_rng(col + start).standard_normal(n).astype(np.float32)
    want = np.zeros(col, np.float64)
    np.add.at(want, (start + np.arange(n)) % col, x)
    got = np.zeros(col, np.float64)
    sparse.column_sums(x, start, col, got)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    mean = np.arange(col, dtype=np.float32)
    np.testing.assert_array_equal(sparse.tile(mean, start, n), mean[(start + np.arange(n)) % col])


def test_a_sparse_tensor_with_a_mean_row_adds_scales_and_measures_as_its_dense_self() -> None:
    rng = np.random.default_rng(7)
    t = codec.SparseTensor(
        (6, 4),
        np.array([1, 6, 23]),
        rng.standard_normal(3).astype(np.float32),
        rng.standard_normal(4).astype(np.float32),
    )
    dense = t.dense()
    assert np.isclose(t.sq_norm(), float((dense.astype(np.float64) ** 2).sum()), rtol=1e-6)
    for factor in (1.0, np.float32(0.3)):
        target = rng.standard_normal((6, 4)).astype(np.float32)
        want = target + (dense if factor == 1 else np.float32(factor) * dense)
        t.add_into(target, factor)
        np.testing.assert_array_equal(target, want)  # the same float32 adds as the dense tensor's
    t.scale(np.float32(2.0))
    np.testing.assert_array_equal(t.dense(), 2 * dense)


def test_small_tensors_go_dense_with_the_dense_codec() -> None:
    rng = np.random.default_rng(8)
    x = {"big": rng.standard_normal((300, 64)).astype(np.float32), "small": rng.standard_normal((40, 64))}
    x["small"] = x["small"].astype(np.float32)
    cfg = CodecConfig(name="sparse", dense_below=10_000, dense_codec="int4", block_size=512)
    residual: dict[str, np.ndarray] = {}
    payload = codec.encode(x, cfg, residual=residual)
    got = codec.decode_sparse(payload)
    assert isinstance(got["big"], codec.SparseTensor) and isinstance(got["small"], np.ndarray)
    alone = codec.decode(codec.encode({"small": x["small"]}, CodecConfig(name="int4", block_size=512)))["small"]
    np.testing.assert_array_equal(got["small"], alone)  # exactly what int4 gives it
    np.testing.assert_array_equal(residual["small"], x["small"] - alone)
    assert np.abs(residual["small"]).max() <= (x["small"].max() - x["small"].min()) / 15  # within a step of 15
    assert np.count_nonzero(residual["big"]) > 0.9 * x["big"].size  # the big one: top-k, most values wait


def sparse_header(extra: dict) -> bytes:
    header = {"codec": "sparse", "block_size": 64, "piece": piece_len(64), "tensors": [{"name": "w", "shape": [4, 16]}]}
    body = json.dumps({**header, "sparse": {"keep": 3, "bits": 2, **extra}}).encode()
    return frames.pack(frames.HEADER, b"sparse!!" + body) + frames.pack(frames.END, _END.pack(b"sparse!!", 1, 0))


DENSE = {"codec": "int4", "block_size": 64, "below": 100}


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"mean": 1, "dense": DENSE}, "sparse.mean must be true or false"),
        ({"mean": True, "dense": {**DENSE, "codec": "fp32"}}, "sparse.dense.codec must be one of"),
        ({"mean": True, "dense": {**DENSE, "block_size": 0}}, "sparse.dense.block_size must be"),
        ({"mean": True, "dense": {**DENSE, "below": -1}}, "sparse.dense.below must be"),
        ({"mean": True, "dense": {"codec": "int4"}}, "sparse.dense must be an object"),
        ({"mean": True}, "sparse must be an object"),
    ],
)
def test_a_sparse_header_with_bad_mean_or_dense_fields_is_refused(extra: dict, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        codec.decode(sparse_header(extra))


def mean_payload(mean: np.ndarray) -> bytes:
    """A sparse payload framed by hand around one (512, 2) matrix (chunks of 64 keeping 8: tall enough for a mean
    row): its mean row, then the sparse content (positions 1..8 of each chunk, each value 1.0)."""
    sid = b"sparse!!"
    header = {
        "codec": "sparse",
        "block_size": 64,
        "piece": piece_len(64),
        "tensors": [{"name": "w", "shape": [512, 2]}],
        "sparse": {"keep": 8, "bits": 2, "mean": True, "dense": {**DENSE, "below": 0}},
    }
    blob = zstandard.ZstdCompressor().compress(mean.astype("<f4").tobytes() + content([[1] * 8] * 16))
    return b"".join(
        [
            frames.pack(frames.HEADER, sid + json.dumps(header).encode()),
            frames.pack(frames.DATA, _DATA.pack(sid, 0, 0, 0, 1) + blob),
            frames.pack(frames.END, _END.pack(sid, 2, 1024)),
        ]
    )


def test_a_non_finite_mean_row_is_refused_by_name() -> None:
    mean = np.zeros(2, np.float32)
    for bad in (np.nan, np.inf):
        mean[1] = bad
        for decode in (codec.decode, codec.decode_sparse):
            with pytest.raises(CodecError, match="tensor 'w': its mean row holds NaN or Inf"):
                decode(mean_payload(mean))
    mean[1] = 0.5
    got = codec.decode_sparse(mean_payload(mean))["w"]
    assert isinstance(got, codec.SparseTensor) and got.mean is not None and list(got.mean) == [0.0, 0.5]
    np.testing.assert_array_equal(got.indices[:9], [1, 2, 3, 4, 5, 6, 7, 8, 65])
    dense = codec.decode(mean_payload(mean))["w"]
    np.testing.assert_array_equal(dense, got.dense())
    assert dense[0, 0] == 0.0 and dense[0, 1] == 1.5 and dense[1, 0] == 1.0 and dense[10, 1] == 0.5


def test_values_near_the_float32_limit_send_a_zero_mean_row_rather_than_overflow() -> None:
    big = float(np.finfo(np.float32).max)
    x = np.ones((128, 3), np.float32)  # tall enough for a mean row at density 0.5
    x[:2] = [[big, -big, 1.0], [-big, big, 2.0]]
    residual: dict[str, np.ndarray] = {}
    payload = codec.encode(
        {"w": x}, CodecConfig(name="sparse", chunk=64, density=0.5, dense_below=0), residual=residual
    )
    got = codec.decode_sparse(payload)["w"]
    assert isinstance(got, codec.SparseTensor) and got.mean is not None and not got.mean.any()
    y = codec.decode(payload)["w"]
    assert np.isfinite(y).all() and np.isfinite(residual["w"]).all()
    np.testing.assert_array_equal(residual["w"], x - y)
