"""Delta codec: round trips, the int8 error bound, compression, and refusal of every malformed payload."""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import numpy as np
import pytest
import zstandard as zstd
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from geofed_hpc.codec import codec_name, decode, encode, sections
from geofed_hpc.config import CodecConfig
from geofed_hpc.errors import CodecError

EPS = float(np.finfo(np.float32).eps)
TINY = 2.0**-149  # the smallest float32 subnormal


def adam_like(n: int, seed: int = 0) -> np.ndarray:
    """A delta after Adam steps: mostly normal * 1e-3, a few outliers two orders larger."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 1e-3
    spots = rng.choice(n, size=max(1, n // 10_000), replace=False)
    x[spots] = rng.standard_normal(spots.size) * 1e-1
    return x.astype(np.float32)


def error_bound(x: np.ndarray, block_size: int) -> np.ndarray:
    """Per element: scale/2 of its block (scale = (max - min) / 255), plus float32 rounding slack."""
    flat = x.reshape(-1).astype(np.float64)
    bound = np.empty_like(flat)
    for start in range(0, flat.size, block_size):
        block = flat[start : start + block_size]
        lo, scale = block.min(), (block.max() - block.min()) / 255
        bound[start : start + block_size] = scale / 2 + 4 * EPS * (abs(lo) + 255 * scale) + 256 * TINY
    return bound


def assert_within_bound(x: np.ndarray, y: np.ndarray, block_size: int) -> None:
    assert y.dtype == np.float32 and y.shape == x.shape
    err = np.abs(y.reshape(-1).astype(np.float64) - x.reshape(-1).astype(np.float64))
    bound = error_bound(x, block_size)
    worst = int(np.argmax(err - bound)) if err.size else 0
    assert np.all(err <= bound), f"error {err[worst]} > bound {bound[worst]} at {worst}"


def build(header: object, bodies: list[bytes], version: int = 1, magic: bytes = b"GFDC") -> bytes:
    """A container written by hand, with correct checksums, for payloads the encoder would never make."""
    raw = json.dumps(header).encode()
    parts = [struct.pack("<4sBII", magic, version, len(raw), zlib.crc32(raw)), raw]
    for body in bodies:
        parts += [struct.pack("<QI", len(body), zlib.crc32(body)), body]
    return b"".join(parts)


def section_spans(payload: bytes) -> dict[str, tuple[int, int]]:
    """Where each tensor's section body lies in a payload (walks the documented layout)."""
    _, _, size, _ = struct.unpack_from("<4sBII", payload)
    header = json.loads(payload[13 : 13 + size])
    spans, pos = {}, 13 + size
    for entry in header["tensors"]:
        length, _ = struct.unpack_from("<QI", payload, pos)
        spans[entry["name"]] = (pos + 12, pos + 12 + length)
        pos += 12 + length
    return spans


def sample() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "embed.weight": adam_like(700, seed=2).reshape(70, 10),
        "norm.bias": rng.standard_normal(5).astype(np.float32),
        "scalar": np.array(0.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }


FP32 = CodecConfig(name="fp32")
INT8 = CodecConfig(name="int8", block_size=64)


# --- round trips -------------------------------------------------------------------------------------------


def test_fp32_round_trip_is_exact() -> None:
    rng = np.random.default_rng(3)
    tensors = {
        **sample(),
        "wide": (rng.standard_normal((33, 17)) * 1e30).astype(np.float32),
        "tiny": np.array([1e-45, -3e-44, 1e-38], np.float32),
        "transposed": rng.standard_normal((6, 9)).astype(np.float32).T,
    }
    out = decode(encode(tensors, FP32))
    assert list(out) == list(tensors)
    for name, x in tensors.items():
        assert out[name].dtype == np.float32 and out[name].shape == x.shape
        np.testing.assert_array_equal(out[name], x)


def test_other_float_dtypes_are_encoded_as_float32() -> None:
    x64 = np.linspace(-1, 1, 50)
    x16 = np.linspace(-1, 1, 50).astype(np.float16)
    out = decode(encode({"x64": x64, "x16": x16}, FP32))
    np.testing.assert_array_equal(out["x64"], x64.astype(np.float32))
    np.testing.assert_array_equal(out["x16"], x16.astype(np.float32))


@pytest.mark.parametrize("block_size", [64, 100, 1000, 65536])
@pytest.mark.parametrize("kind", ["uniform", "adam"])
def test_int8_error_within_half_a_block_scale(block_size: int, kind: str) -> None:
    rng = np.random.default_rng(block_size)
    x = rng.uniform(-3, 5, 20_011).astype(np.float32) if kind == "uniform" else adam_like(20_011)
    y = decode(encode({"w": x}, CodecConfig(name="int8", block_size=block_size)))["w"]
    assert_within_bound(x, y, block_size)


def test_one_block_is_the_papers_global_min_max() -> None:
    x = adam_like(5000, seed=7)
    y = decode(encode({"w": x}, CodecConfig(name="int8", block_size=8192)))["w"]
    lo, hi = np.float32(x.min()), np.float32(x.max())
    scale = np.float32((np.float64(hi) - np.float64(lo)) / 255)
    q = np.rint((x - lo) / scale)
    reference = (lo + q * scale).astype(np.float32)
    np.testing.assert_allclose(y, reference, rtol=0, atol=float(scale) * 1e-3)
    assert len(np.unique(y)) <= 256


def test_int8_bound_holds_at_the_edges_of_float32() -> None:
    big = float(np.finfo(np.float32).max)
    x = np.concatenate(
        [
            np.linspace(-big, big, 64),  # the range itself overflows float32
            np.linspace(-3.4024831e38, big, 64),  # min + 255 * scale rounds past the largest float32
            np.linspace(0.999 * big, big, 64),  # reconstruction lands right at the top of float32
            np.linspace(-big, -0.999 * big, 64),
            np.array([1e-45, 3e-45, -1e-45, 0.0] * 16),  # subnormal scales
        ]
    ).astype(np.float32)
    y = decode(encode({"w": x}, INT8))["w"]
    assert np.isfinite(y).all()
    assert_within_bound(x, y, 64)


def test_pieces_and_tail_blocks_line_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sections, "PIECE", 256)
    x = adam_like(5_003, seed=4)
    for block_size in (64, 100, 300):
        y = decode(encode({"w": x}, CodecConfig(name="int8", block_size=block_size)))["w"]
        assert_within_bound(x, y, block_size)
    assert np.array_equal(decode(encode({"w": x}, FP32))["w"], x)


@pytest.mark.parametrize("cfg", [FP32, INT8], ids=["fp32", "int8"])
def test_constant_scalar_and_empty_tensors(cfg: CodecConfig) -> None:
    tensors: dict[str, Any] = {
        "zeros": np.zeros((3, 50), np.float32),
        "const": np.full(130, -2.5, np.float32),
        "scalar": np.array(7.25, np.float32),
        "np_scalar": np.float32(-1.5),
        "empty": np.zeros(0, np.float32),
        "empty2d": np.zeros((4, 0), np.float32),
    }
    out = decode(encode(tensors, cfg))
    for name, x in tensors.items():
        assert out[name].shape == np.asarray(x).shape and out[name].dtype == np.float32
        np.testing.assert_array_equal(out[name], x)


def test_empty_mapping_round_trips() -> None:
    assert decode(encode({}, INT8)) == {}


def test_int8_shrinks_an_adam_delta_below_30_percent_of_fp32() -> None:
    x = adam_like(1 << 18, seed=5)
    int8 = encode({"w": x}, CodecConfig(name="int8"))
    assert len(int8) < 0.30 * x.nbytes
    assert len(encode({"w": x}, FP32)) > 0.8 * x.nbytes  # noise: lossless zstd barely helps


def test_codec_name_reads_the_header_only() -> None:
    payload = encode(sample(), INT8)
    header_end = 13 + struct.unpack_from("<I", payload, 5)[0]
    assert codec_name(payload[:header_end]) == "int8"
    assert codec_name(encode(sample(), FP32)) == "fp32"
    with pytest.raises(CodecError):
        codec_name(payload[: header_end - 1])


def test_decode_accepts_any_bytes_like() -> None:
    payload = encode(sample(), FP32)
    for view in (bytearray(payload), memoryview(payload)):
        assert list(decode(view)) == list(sample())  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    x=hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=30),
        elements=st.floats(allow_nan=False, allow_infinity=False, width=32),
    ),
    block_size=st.sampled_from([64, 97, 256, 65536]),
)
def test_property_round_trip_within_bound(x: np.ndarray, block_size: int) -> None:
    y = decode(encode({"t": x}, CodecConfig(name="int8", block_size=block_size)))["t"]
    assert np.isfinite(y).all()
    assert_within_bound(x, y, block_size)
    np.testing.assert_array_equal(decode(encode({"t": x}, FP32))["t"], x)


# --- refusals at encode --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("cfg", [FP32, INT8], ids=["fp32", "int8"])
def test_non_finite_values_are_refused_naming_the_tensor(bad: float, cfg: CodecConfig) -> None:
    x = np.zeros(300, np.float32)
    x[211] = bad
    with pytest.raises(CodecError, match=r"'layers\.3\.w'.*index 211"):
        encode({"ok": np.ones(3, np.float32), "layers.3.w": x}, cfg)


def test_float64_beyond_float32_range_is_refused() -> None:
    with pytest.raises(CodecError, match="'big'"):
        encode({"big": np.array([1.0, 1e300])}, INT8)


@pytest.mark.parametrize("value", [np.arange(4), np.ones(3, bool), [1.0, 2.0]], ids=["int", "bool", "list"])
def test_non_float_inputs_are_refused(value: object) -> None:
    with pytest.raises(CodecError, match="'w'"):
        encode({"w": value}, INT8)  # type: ignore[dict-item]


# --- refusals at decode --------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [FP32, INT8], ids=["fp32", "int8"])
def test_every_truncation_is_refused(cfg: CodecConfig) -> None:
    payload = encode(sample(), cfg)
    for cut in range(len(payload)):
        with pytest.raises(CodecError):
            decode(payload[:cut])


@pytest.mark.parametrize("cfg", [FP32, INT8], ids=["fp32", "int8"])
def test_a_flipped_byte_in_a_section_names_its_tensor(cfg: CodecConfig) -> None:
    payload = encode(sample(), cfg)
    for name, (start, end) in section_spans(payload).items():
        for pos in sorted({start, (start + end) // 2, end - 1}):
            broken = bytearray(payload)
            broken[pos] ^= 0x40
            with pytest.raises(CodecError, match=f"tensor '{name}'.*crc32"):
                decode(bytes(broken))


@pytest.mark.parametrize("cfg", [FP32, INT8], ids=["fp32", "int8"])
def test_every_flipped_byte_is_refused(cfg: CodecConfig) -> None:
    payload = encode({"a": adam_like(200), "b": np.array(1.0, np.float32)}, cfg)
    for pos in range(len(payload)):
        broken = bytearray(payload)
        broken[pos] ^= 0xFF
        with pytest.raises(CodecError):
            decode(bytes(broken))


def test_random_garbage_only_ever_raises_codec_error() -> None:
    rng = np.random.default_rng(9)
    payload = bytearray(encode(sample(), INT8))
    for _ in range(300):
        broken = bytearray(payload)
        for pos in rng.integers(0, len(broken), size=rng.integers(1, 4)):
            broken[pos] = int(rng.integers(0, 256))
        if broken == payload:
            continue
        with pytest.raises(CodecError):
            decode(bytes(broken))
    for size in (0, 1, 12, 13, 100):
        with pytest.raises(CodecError):
            decode(rng.bytes(size))


def test_bad_magic_version_and_trailing_bytes() -> None:
    payload = encode(sample(), INT8)
    with pytest.raises(CodecError, match="bad magic"):
        decode(b"XXXX" + payload[4:])
    with pytest.raises(CodecError, match="version 2"):
        decode(payload[:4] + b"\x02" + payload[5:])
    with pytest.raises(CodecError, match="3 trailing bytes"):
        decode(payload + b"abc")
    with pytest.raises(CodecError, match="expected bytes"):
        decode("not bytes")  # type: ignore[arg-type]


def test_expected_shapes_and_names_are_enforced() -> None:
    tensors = sample()
    payload = encode(tensors, INT8)
    expected = {name: (x.shape, "float32") for name, x in tensors.items()}
    assert list(decode(payload, expected)) == list(tensors)
    with pytest.raises(CodecError, match=r"mismatched: 'norm\.bias' is \[5\] float32, expected \[6\] float32"):
        decode(payload, {**expected, "norm.bias": ((6,), "float32")})
    with pytest.raises(CodecError, match=r"mismatched: 'scalar'.*float16"):
        decode(payload, {**expected, "scalar": ((), "float16")})
    with pytest.raises(CodecError, match=r"missing: 'head\.weight'"):
        decode(payload, {**expected, "head.weight": ((2, 2), "float32")})
    fewer = {k: v for k, v in expected.items() if k != "empty"}
    with pytest.raises(CodecError, match=r"extra: 'empty'"):
        decode(payload, fewer)


def test_expected_shapes_are_checked_before_allocating() -> None:
    frame = zstd.ZstdCompressor().compress(b"")
    header = {
        "codec": "fp32",
        "block_size": 64,
        "tensors": [{"name": "w", "shape": [1 << 38], "dtype": "float32", "bytes": len(frame)}],
    }
    with pytest.raises(CodecError, match="'w' is"):
        decode(build(header, [frame]), {"w": ((4,), "float32")})


def _header(codec: str, entries: list[dict[str, object]], block_size: int = 64) -> dict[str, object]:
    return {"codec": codec, "block_size": block_size, "tensors": entries}


def _entry(name: str, shape: list[int], body: bytes) -> dict[str, object]:
    return {"name": name, "shape": shape, "dtype": "float32", "bytes": len(body)}


def test_header_json_must_be_valid_and_well_typed() -> None:
    raw = b"{not json"
    with pytest.raises(CodecError, match="not valid JSON"):
        decode(struct.pack("<4sBII", b"GFDC", 1, len(raw), zlib.crc32(raw)) + raw)
    raw = b'{"codec": "\xff\xfe"}'
    with pytest.raises(CodecError, match="not valid JSON"):
        decode(struct.pack("<4sBII", b"GFDC", 1, len(raw), zlib.crc32(raw)) + raw)
    raw = b"[" * 100_000
    with pytest.raises(CodecError, match="header"):
        decode(struct.pack("<4sBII", b"GFDC", 1, len(raw), zlib.crc32(raw)) + raw)
    body = zstd.ZstdCompressor().compress(b"\0" * 4)
    good = _entry("w", [1], body)
    bad_headers = [
        ([1, 2], "JSON object"),
        ({"codec": "fp32", "tensors": []}, "expected keys"),
        (_header("bf16", [good]), "codec 'bf16'"),
        (_header("int8", [good], block_size=0), "block_size"),
        (_header("int8", [good], block_size=True), "block_size"),  # type: ignore[arg-type]
        (_header("fp32", {"w": good}), "tensors must be a list"),  # type: ignore[arg-type]
        (_header("fp32", [{**good, "name": 3}]), "name must be a string"),
        (_header("fp32", [{**good, "shape": [-1]}]), "'w': shape"),
        (_header("fp32", [{**good, "shape": [1.0]}]), "'w': shape"),
        (_header("fp32", [{**good, "shape": "1"}]), "'w': shape"),
        (_header("fp32", [{**good, "shape": [1 << 30, 1 << 30]}]), "more than"),
        (_header("fp32", [{**good, "dtype": "float16"}]), "'w': dtype"),
        (_header("fp32", [{**good, "bytes": -1}]), "'w': bytes"),
        (_header("fp32", [{**good, "extra": 1}]), "tensors\\[0\\]"),
        (_header("fp32", [good, good]), "more than once"),
    ]
    for header, message in bad_headers:
        with pytest.raises(CodecError, match=message):
            decode(build(header, [body]))


def test_absurd_sizes_are_refused_before_allocating() -> None:
    small = zstd.ZstdCompressor().compress(b"\0" * 64)
    for codec in ("fp32", "int8"):
        body = small if codec == "fp32" else struct.pack("<2f", 0.0, 0.0) + small
        header = _header(codec, [_entry("huge", [1 << 20, 1 << 19], body)], block_size=1 << 31)
        with pytest.raises(CodecError, match="'huge'.*(regenerate|holds|cannot hold)"):
            decode(build(header, [body]))
    body = b"\0" * 8 + small
    with pytest.raises(CodecError, match="'huge': section of"):
        decode(build(_header("int8", [_entry("huge", [1 << 36], body)]), [body]))


def test_sections_must_hold_exactly_one_honest_zstd_frame() -> None:
    cctx = zstd.ZstdCompressor()
    data = np.arange(16, dtype="<f4").tobytes()
    frame = cctx.compress(data)
    cases = [
        (frame + b"\0", "1 stray bytes"),
        (frame + frame, "stray bytes"),
        (frame[:-1], "cut short|ends early|corrupt"),
        (b"\0" * len(frame), "bad magic"),
        (cctx.compress(data[:-4]), "holds 60 bytes, the header says 64"),
        (cctx.compress(data + data), "holds 128 bytes"),
    ]
    for body, message in cases:
        header = _header("fp32", [_entry("w", [16], body)])
        with pytest.raises(CodecError, match=f"tensor 'w': zstd.*({message})"):
            decode(build(header, [body]))
    unsized = zstd.ZstdCompressor(write_content_size=False)
    for short_or_long in (data[:-4], data + data):
        body = unsized.compress(short_or_long)
        with pytest.raises(CodecError, match="tensor 'w'"):
            decode(build(_header("fp32", [_entry("w", [16], body)]), [body]))


def test_non_finite_decoded_values_are_refused() -> None:
    body = zstd.ZstdCompressor().compress(np.array([1.0, np.nan], "<f4").tobytes())
    with pytest.raises(CodecError, match="'w': decoded value at flat index 1 is NaN"):
        decode(build(_header("fp32", [_entry("w", [2], body)]), [body]))
    q = zstd.ZstdCompressor().compress(b"\1\2")
    for mins, scales in (([np.nan], [1.0]), ([0.0], [np.inf]), ([0.0], [-1.0])):
        body = np.array(mins, "<f4").tobytes() + np.array(scales, "<f4").tobytes() + q
        with pytest.raises(CodecError, match="'w': block minima or scales"):
            decode(build(_header("int8", [_entry("w", [2], body)]), [body]))


def test_section_length_must_agree_with_the_header() -> None:
    payload = bytearray(encode({"w": np.ones(10, np.float32)}, FP32))
    start, _ = section_spans(bytes(payload))["w"]
    struct.pack_into("<Q", payload, start - 12, struct.unpack_from("<Q", payload, start - 12)[0] + 1)
    with pytest.raises(CodecError, match="'w': section length"):
        decode(bytes(payload))
