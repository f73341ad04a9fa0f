"""Delta codec: round trips of every codec, streaming in pieces and frames, and refusal of malformed input."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest
import zstandard as zstd

from geofed_hpc import codec
from geofed_hpc.codec import frames, huffman, predict, stream
from geofed_hpc.codec.frames import DATA, END, HEADER
from geofed_hpc.config import WIRE_CODECS, CodecConfig
from geofed_hpc.errors import CodecError

SID = b"testsid!"


def adam_like(n: int, seed: int = 0) -> np.ndarray:
    """A delta after Adam steps: mostly normal * 1e-3, a few outliers two orders larger."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 1e-3
    spots = rng.choice(n, size=max(1, n // 10_000), replace=False)
    x[spots] = rng.standard_normal(spots.size) * 1e-1
    return x.astype(np.float32)


def sample() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "embed.weight": adam_like(700, seed=2).reshape(70, 10),
        "norm.bias": rng.standard_normal(5).astype(np.float32),
        "scalar": np.array(0.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }


def handmade(header: dict[str, Any], pieces: list[tuple[int, int, bytes]], sid: bytes = SID) -> bytes:
    """A stream written by hand with correct checksums: (tensor, piece, blob) per piece, one frame each."""
    out = [frames.pack(HEADER, sid, json.dumps(header).encode())]
    for t, p, blob in pieces:
        out.append(frames.pack(DATA, struct.pack("<8sIIIB", sid, t, p, 0, 1), blob))
    out.append(frames.pack(END, struct.pack("<8sQQ", sid, len(out), 0)))
    return b"".join(out)


def fp32_stream(tensors: dict[str, np.ndarray]) -> bytes:
    """An fp32 payload of raw float32 values, unchecked (so it can carry NaN, which the encoder refuses)."""
    header = {"codec": "fp32", "block_size": 64, "piece": 1 << 24, "tensors": []}
    pieces = []
    for i, (name, arr) in enumerate(tensors.items()):
        header["tensors"].append({"name": name, "shape": list(arr.shape)})
        planes = np.ascontiguousarray(arr, "<f4").reshape(-1).view(np.uint8).reshape(-1, 4).T.copy()
        if arr.size:
            pieces.append((i, 0, zstd.ZstdCompressor().compress(planes.tobytes())))
    payload = handmade(header, pieces)
    end = len(payload) - (frames.PREFIX.size + 24)
    total = sum(a.size for a in tensors.values())
    return payload[:end] + frames.pack(END, struct.pack("<8sQQ", SID, 1 + len(pieces), total))


def frame_spans(payload: bytes) -> list[tuple[int, int, int]]:
    """(kind, start, end) of every frame (walks the documented layout)."""
    spans, pos = [], 0
    while pos < len(payload):
        _, _, kind, size, _ = frames.PREFIX.unpack_from(payload, pos)
        spans.append((kind, pos, pos + frames.PREFIX.size + size))
        pos += frames.PREFIX.size + size
    return spans


FP32 = CodecConfig(name="fp32")
INT8 = CodecConfig(name="int8", block_size=64)
# sparse with its defaults sends these small tensors dense (int4); "sparse-all" sends every tensor sparse, with
# mean rows
ALL = [CodecConfig(name=n, block_size=64) for n in WIRE_CODECS] + [CodecConfig(name="sparse", dense_below=0)]
IDS = [*WIRE_CODECS, "sparse-all"]


# --- round trips -------------------------------------------------------------------------------------------


def test_fp32_round_trip_is_exact() -> None:
    rng = np.random.default_rng(3)
    tensors = {
        **sample(),
        "wide": (rng.standard_normal((33, 17)) * 1e30).astype(np.float32),
        "tiny": np.array([1e-45, -3e-44, 1e-38], np.float32),
        "transposed": rng.standard_normal((6, 9)).astype(np.float32).T,
    }
    out = codec.decode(codec.encode(tensors, FP32))
    assert list(out) == list(tensors)
    for name, x in tensors.items():
        assert out[name].dtype == np.float32 and out[name].shape == x.shape
        np.testing.assert_array_equal(out[name], x)


@pytest.mark.parametrize("cfg", ALL, ids=IDS)
def test_every_codec_round_trips_shapes_order_and_specials(cfg: CodecConfig) -> None:
    rng = np.random.default_rng(4)
    tensors: dict[str, Any] = {
        **sample(),
        "zeros": np.zeros((3, 50), np.float32),
        "const": np.full(130, -2.5, np.float32),
        "np_scalar": np.float32(-1.5),
        "f64": rng.standard_normal((4, 5)),
        "f16": rng.standard_normal(33).astype(np.float16),
        "strided": rng.standard_normal((40, 30)).astype(np.float32)[::2, ::3],
    }
    out = codec.decode(codec.encode(tensors, cfg))
    assert list(out) == list(tensors)
    for name, x in tensors.items():
        x = np.asarray(x)
        assert out[name].shape == x.shape and out[name].dtype == np.float32
    for name in ("zeros", "const", "empty", "np_scalar", "scalar"):
        if cfg.name == "sparse" and not cfg.dense_below and name == "const":  # 3 of its 130 values kept, the rest 0
            np.testing.assert_array_equal(np.sort(out[name]), [-2.5] * 3 + [0.0] * 127)
        elif cfg.name != "paper_int8":  # one global min-max: constants elsewhere land on its grid
            np.testing.assert_array_equal(out[name], np.asarray(tensors[name], np.float32))


def test_empty_mapping_round_trips() -> None:
    for cfg in ALL:
        assert codec.decode(codec.encode({}, cfg)) == {}


def test_one_block_is_the_papers_global_min_max() -> None:
    x = adam_like(5000, seed=7)
    lo, hi = np.float32(x.min()), np.float32(x.max())
    scale = np.float32((np.float64(hi) - np.float64(lo)) / 255)
    reference = (lo + np.rint((x - lo) / scale) * scale).astype(np.float32)
    for cfg in (CodecConfig(name="int8", block_size=8192), CodecConfig(name="paper_int8")):
        y = codec.decode(codec.encode({"w": x}, cfg))["w"]
        np.testing.assert_allclose(y, reference, rtol=0, atol=float(scale) * 1e-3)
        assert len(np.unique(y)) <= 256


def test_paper_int8_uses_one_grid_across_tensors() -> None:
    a, b = adam_like(3000, seed=1), adam_like(3000, seed=2) * 0.01
    out = codec.decode(codec.encode({"a": a, "b": b}, CodecConfig(name="paper_int8")))
    step = (max(a.max(), b.max()) - min(a.min(), b.min())) / 255
    assert np.abs(out["b"] - b).max() <= step / 2 * 1.001
    assert len(np.unique(out["b"])) < 10  # b spans a sliver of the global range, as in the paper


def test_narrow_blocks_never_get_a_step_above_the_global_one() -> None:
    x = np.concatenate([adam_like(4096, seed=3), adam_like(4096, seed=4) * 1e-3])
    y = codec.decode(codec.encode({"w": x}, CodecConfig(name="int8", block_size=4096)))["w"]
    global_step = (float(x.max()) - float(x.min())) / 255
    assert np.abs(y - x).max() <= global_step / 2 * 1.001
    narrow = np.abs(y[4096:] - x[4096:]).max()
    assert narrow <= global_step / 2 and len(np.unique(y[4096:])) < len(np.unique(y[:4096]))


@pytest.mark.parametrize("name", ["int16", "int8", "int4"])
def test_row_prediction_codes_alike_rows_smaller_and_exactly(name: str) -> None:
    rng = np.random.default_rng(5)
    rows = np.tile(rng.standard_normal(256).astype(np.float32), (512, 1))
    rows += rng.standard_normal(rows.shape).astype(np.float32) * 0.01
    cfg = CodecConfig(name=name, block_size=1 << 14)
    res: dict[str, np.ndarray] = {}
    predicted = codec.encode({"w": rows}, cfg, residual=res)
    flat = codec.encode({"w": rows.reshape(-1)}, cfg)  # 1-D: no rows, no prediction
    if name != "int4":  # at 4 bits the rows quantize identically, and zstd's matches already catch that
        assert len(predicted) < 0.8 * len(flat)
    y = codec.decode(predicted)["w"]
    np.testing.assert_array_equal(y, codec.decode(flat)["w"].reshape(rows.shape))
    np.testing.assert_array_equal(rows - y, res["w"])


def test_prediction_inverse_for_every_width_and_tail() -> None:
    rng = np.random.default_rng(6)
    for dtype, mask in ((np.uint8, 255), (np.uint8, 15), (np.uint16, 65535)):
        for size, block, row in ((1000, 100, 7), (1000, 128, 64), (999, 300, 3), (5000, 4096, 2048), (10, 64, 3)):
            q = rng.integers(0, mask + 1, size).astype(dtype)
            modes = rng.integers(0, 2, -(-size // block)).astype(np.uint8)
            r = q.copy()
            predict.apply(r, modes, block, row, mask)
            predict.undo(r, modes, block, row, mask)
            np.testing.assert_array_equal(r, q)


def test_huffman_is_a_prefix_code_that_round_trips() -> None:
    rng = np.random.default_rng(7)
    for n in (0, 1, 5, huffman.SEGMENT, huffman.SEGMENT + 1, 20_000):
        x = np.clip(np.rint(rng.normal(128, 20, n)), 0, 255).astype(np.uint8)
        counts = np.bincount(x, minlength=256)
        counts[0] += 1
        lengths = huffman.code_lengths(counts)
        huffman.check_lengths(lengths.tolist())
        blob = huffman.encode(x, lengths)
        np.testing.assert_array_equal(huffman.decode(memoryview(blob), n, lengths, "t"), x)
    skewed = huffman.code_lengths(np.array([10**12] + [1] * 255))
    assert skewed.max() <= huffman.MAX_LEN and np.sum(np.ldexp(1.0, -skewed.astype(int))) <= 1.0


def test_pieces_and_tail_blocks_line_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "PIECE", 256)
    x = adam_like(5_003, seed=4).reshape(-1, 1)
    for cfg in ALL + [CodecConfig(name="int8", block_size=300), CodecConfig(name="int8", block_size=100)]:
        whole = codec.decode(codec.encode({"w": x}, cfg))["w"]
        monkeypatch.setattr(stream, "PIECE", 1 << 24)
        assert np.abs(whole - codec.decode(codec.encode({"w": x}, cfg))["w"]).max() <= np.abs(x).max()
        monkeypatch.setattr(stream, "PIECE", 256)
    assert np.array_equal(codec.decode(codec.encode({"w": x}, FP32))["w"], x)


@pytest.mark.parametrize("cfg", ALL, ids=IDS)
def test_residual_is_exactly_what_decoding_loses(cfg: CodecConfig) -> None:
    tensors = {"a": adam_like(3000, seed=8).reshape(30, 100), "b": adam_like(77, seed=9), "e": np.zeros(0, np.float32)}
    res: dict[str, np.ndarray] = {}
    out = codec.decode(codec.encode(tensors, cfg, residual=res))
    for name, x in tensors.items():
        np.testing.assert_array_equal(res[name], x - out[name])


# --- streaming -------------------------------------------------------------------------------------------------


def test_frames_are_small_and_any_chunking_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "FRAME", 4096)
    tensors = {"w": adam_like(50_000, seed=10).reshape(500, 100), "b": adam_like(300, seed=11)}
    payload = codec.encode(tensors, CodecConfig(name="fp32"))
    spans = frame_spans(payload)
    assert [k for k, _, _ in spans][0] == HEADER and spans[-1][0] == END
    assert all(end - start <= 4096 + 64 for k, start, end in spans if k == DATA) and len(spans) > 40
    expected = codec.decode(payload)
    for size in (1, 13, 4096, 5000, len(payload)):
        out = codec.decode(payload[i : i + size] for i in range(0, len(payload), size))
        for name in tensors:
            np.testing.assert_array_equal(out[name], expected[name])


def test_encode_frames_and_stream_decoder_work_piece_by_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "PIECE", 1000)
    seen: list[tuple[int, int]] = []

    def read(start: int, stop: int) -> np.ndarray:
        seen.append((start, stop))
        return np.arange(start, stop, dtype=np.float64) * 1e-3

    source = codec.TensorSource((50, 70), read)
    frames_out = codec.encode_frames({"lazy": source}, CodecConfig(name="int8", block_size=100))
    dec = codec.StreamDecoder({"lazy": ((50, 70), "float32")})
    got = [(p.name, p.start, p.values.size) for p in dec.pieces(frames_out)]
    assert got == [("lazy", s, min(1000, 3500 - s)) for s in range(0, 3500, 1000)]
    assert seen[:4] == [(0, 1000), (1000, 2000), (2000, 3000), (3000, 3500)]  # the first pass (global range)


@pytest.mark.parametrize("cfg", [INT8, CodecConfig(name="sparse", dense_below=0)], ids=["int8", "sparse"])
def test_a_decoder_slot_reuses_its_decompressor_cleanly_after_a_stream_broke_mid_frame(
    cfg: CodecConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Scratch keeps one zstd decompressor for every piece it decodes; a stream cut off inside a zstd frame (its
    piece spread over several data frames) leaves it half-way, and the next payload still decodes exactly."""
    monkeypatch.setattr(stream, "FRAME", 512)
    first = codec.encode({"w": adam_like(400_000, seed=3).reshape(2000, 200)}, cfg)
    data = [(start, end) for kind, start, end in frame_spans(first) if kind == DATA]
    assert len(data) > 4  # the piece spans several data frames: the cut below falls inside one zstd frame
    scratch = stream.Scratch()
    dctx = scratch.dctx
    with pytest.raises(CodecError, match="truncated"):
        stream.decode_stream(first[: data[2][1]], sparse=True, scratch=scratch)
    second = codec.encode(sample(), cfg)
    _, got = stream.decode_stream(second, sparse=True, scratch=scratch)
    assert scratch.dctx is dctx
    want = codec.decode(second)
    for name, value in got.items():
        dense = value.dense() if isinstance(value, codec.SparseTensor) else value
        np.testing.assert_array_equal(dense, want[name])


def test_codec_name_reads_the_header_frame_only() -> None:
    for cfg in ALL:
        payload = codec.encode(sample(), cfg)
        header_end = frame_spans(payload)[0][2]
        assert codec.codec_name(payload[:header_end]) == cfg.name
        with pytest.raises(CodecError):
            codec.codec_name(payload[: header_end - 1])


def test_decode_accepts_any_bytes_like() -> None:
    payload = codec.encode(sample(), FP32)
    for view in (bytearray(payload), memoryview(payload)):
        assert list(codec.decode(view)) == list(sample())


# --- refusals at encode --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("cfg", ALL, ids=IDS)
def test_non_finite_values_are_refused_naming_the_tensor(bad: float, cfg: CodecConfig) -> None:
    x = np.zeros(300, np.float32)
    x[211] = bad
    with pytest.raises(CodecError, match=r"'layers\.3\.w'.*index 211"):
        codec.encode({"ok": np.ones(3, np.float32), "layers.3.w": x}, cfg)


def test_float64_beyond_float32_range_is_refused() -> None:
    with pytest.raises(CodecError, match="'big'"):
        codec.encode({"big": np.array([1.0, 1e300])}, INT8)


@pytest.mark.parametrize("value", [np.arange(4), np.ones(3, bool), [1.0, 2.0]], ids=["int", "bool", "list"])
def test_non_float_inputs_are_refused(value: object) -> None:
    with pytest.raises(CodecError, match="'w'"):
        codec.encode({"w": value}, INT8)


def test_bad_sources_and_adaptive_are_refused() -> None:
    short = codec.TensorSource((10,), lambda a, b: np.zeros(3, np.float32))
    with pytest.raises(CodecError, match="'s': source gave 3 values"):
        codec.encode({"s": short}, INT8)
    ints = codec.TensorSource((4,), lambda a, b: np.arange(a, b))
    with pytest.raises(CodecError, match="'i'.*not a floating dtype"):
        codec.encode({"i": ints}, FP32)
    with pytest.raises(CodecError, match="adaptive.*not a wire codec"):
        codec.encode({}, CodecConfig(name="adaptive"))
    with pytest.raises(CodecError, match="names must be strings"):
        codec.encode({3: np.ones(2, np.float32)}, INT8)  # type: ignore[dict-item]


# --- refusals at decode --------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", ALL, ids=IDS)
def test_every_truncation_is_refused(cfg: CodecConfig) -> None:
    payload = codec.encode(sample(), cfg)
    for cut in range(len(payload)):
        with pytest.raises(CodecError):
            codec.decode(payload[:cut])


@pytest.mark.parametrize("cfg", ALL, ids=IDS)
def test_every_flipped_byte_is_refused(cfg: CodecConfig) -> None:
    payload = codec.encode({"a": adam_like(200).reshape(20, 10), "b": np.array(1.0, np.float32)}, cfg)
    for pos in range(len(payload)):
        broken = bytearray(payload)
        broken[pos] ^= 0xFF
        with pytest.raises(CodecError):
            codec.decode(bytes(broken))


def test_a_corrupt_data_frame_names_the_tensor_it_belongs_to() -> None:
    payload = codec.encode(sample(), INT8)
    data = [(s, e) for k, s, e in frame_spans(payload) if k == DATA]
    names = ["embed.weight", "norm.bias", "scalar"]
    for (start, end), name in zip(data, names, strict=True):
        broken = bytearray(payload)
        broken[(start + end) // 2] ^= 0x40
        with pytest.raises(CodecError, match=f"crc32 mismatch.*tensor '{name}'|tensor '{name}'.*crc32"):
            codec.decode(bytes(broken))


def test_random_garbage_only_ever_raises_codec_error() -> None:
    rng = np.random.default_rng(9)
    payload = bytearray(codec.encode(sample(), INT8))
    for _ in range(300):
        broken = bytearray(payload)
        for pos in rng.integers(0, len(broken), size=rng.integers(1, 4)):
            broken[pos] = int(rng.integers(0, 256))
        if broken == payload:
            continue
        with pytest.raises(CodecError):
            codec.decode(bytes(broken))
    for size in (0, 1, 13, 14, 100):
        with pytest.raises(CodecError):
            codec.decode(rng.bytes(size))


def test_bad_magic_version_trailing_bytes_and_types() -> None:
    payload = codec.encode(sample(), INT8)
    with pytest.raises(CodecError, match="bad magic"):
        codec.decode(b"XXXX" + payload[4:])
    with pytest.raises(CodecError, match="version 1 is not supported"):
        codec.decode(payload[:4] + b"\x01" + payload[5:])
    with pytest.raises(CodecError, match="truncated"):
        codec.decode(payload + b"abc")
    with pytest.raises(CodecError, match="trailing frame"):
        codec.decode(payload + frames.pack(DATA, b"x" * 30))
    with pytest.raises(CodecError, match="expected bytes"):
        codec.decode("not bytes")
    with pytest.raises(CodecError, match="expected bytes"):
        codec.decode([b"ok", 3])


def test_frames_from_another_payload_or_order_are_refused() -> None:
    tensors = {"w": adam_like(3000, seed=12).reshape(30, 100), "b": adam_like(100, seed=13)}
    a, b = codec.encode(tensors, INT8), codec.encode(tensors, INT8)
    sa, sb = frame_spans(a), frame_spans(b)
    spliced = a[: sa[1][1]] + b[sb[1][1] : sb[1][2]] + a[sa[1][2] :]
    with pytest.raises(CodecError, match="another payload"):
        codec.decode(spliced)
    other_codec = codec.encode(tensors, CodecConfig(name="int16", block_size=64))
    so = frame_spans(other_codec)
    with pytest.raises(CodecError, match="another payload"):
        codec.decode(a[: sa[1][1]] + other_codec[so[1][1] :])
    swapped = a[: sa[1][1]] + a[sa[2][1] : sa[2][2]] + a[sa[1][1] : sa[1][2]] + a[sa[3][1] :]
    with pytest.raises(CodecError, match="expected tensor 'w' piece 0 part 0"):
        codec.decode(swapped)
    dropped = a[: sa[1][1]] + a[sa[2][1] :]
    with pytest.raises(CodecError, match="expected tensor 'w'"):
        codec.decode(dropped)
    no_end = a[: sa[-1][1]]
    with pytest.raises(CodecError, match="expected the end frame"):
        codec.decode(no_end)


def test_expected_shapes_and_names_are_enforced() -> None:
    tensors = sample()
    payload = codec.encode(tensors, INT8)
    expected = {name: (x.shape, "float32") for name, x in tensors.items()}
    assert list(codec.decode(payload, expected)) == list(tensors)
    with pytest.raises(CodecError, match=r"mismatched: 'norm\.bias' is \[5\] float32, expected \[6\] float32"):
        codec.decode(payload, {**expected, "norm.bias": ((6,), "float32")})
    with pytest.raises(CodecError, match=r"mismatched: 'scalar'.*float16"):
        codec.decode(payload, {**expected, "scalar": ((), "float16")})
    with pytest.raises(CodecError, match=r"missing: 'head\.weight'"):
        codec.decode(payload, {**expected, "head.weight": ((2, 2), "float32")})
    with pytest.raises(CodecError, match=r"extra: 'empty'"):
        codec.decode(payload, {k: v for k, v in expected.items() if k != "empty"})


def _header(codec_name: str = "fp32", tensors: list[Any] | None = None, **kw: Any) -> dict[str, Any]:
    h = {"codec": codec_name, "block_size": 64, "piece": 1 << 24, "tensors": tensors or [], **kw}
    return h


def test_header_must_be_valid_and_well_typed() -> None:
    good = {"name": "w", "shape": [1]}
    lengths = [8] * 256
    bad_headers = [
        ([1, 2], "JSON object"),
        ({"codec": "fp32", "tensors": []}, "expected keys"),
        (_header("bf17"), "codec 'bf17'"),
        (_header(block_size=0), "block_size"),
        (_header(block_size=True), "block_size"),
        (_header(piece=100), "piece"),
        (_header(tensors={"w": good}), "tensors must be a list"),  # type: ignore[arg-type]
        (_header(tensors=[{**good, "name": 3}]), "name must be a string"),
        (_header(tensors=[{**good, "shape": [-1]}]), "'w': shape"),
        (_header(tensors=[{**good, "shape": [1.0]}]), "'w': shape"),
        (_header(tensors=[{**good, "shape": "1"}]), "'w': shape"),
        (_header(tensors=[{**good, "shape": [1 << 30, 1 << 30]}]), "more than"),
        (_header(tensors=[{**good, "dtype": "float32"}]), "tensors\\[0\\]"),
        (_header(tensors=[good, good]), "more than once"),
        (_header("paper_int8"), "expected keys"),
        (_header("paper_int8", huffman={"min": 0, "scale": -1, "lengths": lengths}), "scale"),
        (_header("paper_int8", huffman={"min": 0, "scale": 1, "lengths": [1] * 256}), "Kraft"),
        (_header("paper_int8", huffman={"min": 0, "scale": 1, "lengths": [30] * 256}), "0..20"),
    ]
    for header, message in bad_headers:
        with pytest.raises(CodecError, match=message):
            codec.decode(handmade(header, []))  # type: ignore[arg-type]
    raw = frames.pack(HEADER, SID, b"{not json")
    with pytest.raises(CodecError, match="not valid JSON"):
        codec.decode(raw)
    with pytest.raises(CodecError, match="header"):
        codec.decode(frames.pack(HEADER, SID, b"[" * 100_000))
    with pytest.raises(CodecError, match="expected the header frame"):
        codec.decode(frames.pack(END, struct.pack("<8sQQ", SID, 0, 0)))


def test_absurd_sizes_are_refused_before_allocating() -> None:
    header = _header(tensors=[{"name": "w", "shape": [1 << 38]}])
    with pytest.raises(CodecError, match="'w' is"):
        codec.decode(handmade(header, [(0, 0, b"")]), {"w": ((4,), "float32")})
    with pytest.raises(CodecError, match="frame .*exceeds"):
        codec.decode(struct.pack("<4sBBII", b"GFDC", 2, DATA, 1 << 30, 0))


def test_piece_contents_must_be_exactly_one_honest_zstd_frame() -> None:
    data = np.arange(16, dtype="<f4").view(np.uint8).reshape(-1, 4).T.copy().tobytes()
    cctx = zstd.ZstdCompressor()
    cases = [
        (cctx.compress(data)[:-3], "ends early|corrupt"),
        (b"\0" * 20, "corrupt"),
        (cctx.compress(data[:-4]), "ends early"),
        (cctx.compress(data + data), "more than"),
        (cctx.compress(data) + b"junk", "corrupt"),
    ]
    for blob, message in cases:
        header = _header(tensors=[{"name": "w", "shape": [16]}])
        with pytest.raises(CodecError, match=f"tensor 'w': zstd.*({message})"):
            codec.decode(handmade(header, [(0, 0, blob)]))


def test_non_finite_decoded_values_and_bad_block_params_are_refused() -> None:
    with pytest.raises(CodecError, match="'w': decoded value at flat index 1 is NaN"):
        codec.decode(fp32_stream({"w": np.array([1.0, np.nan], np.float32)}))
    for mins, scales in (([np.nan], [1.0]), ([0.0], [np.inf]), ([0.0], [-1.0])):
        content = np.array(mins, "<f4").tobytes() + np.array(scales, "<f4").tobytes() + b"\0" + b"\1\2"
        header = _header("int8", [{"name": "w", "shape": [2]}])
        with pytest.raises(CodecError, match="'w': block minima or scales"):
            codec.decode(handmade(header, [(0, 0, zstd.ZstdCompressor().compress(content))]))
    content = np.zeros(2, "<f4").tobytes() + b"\7" + b"\1\2"
    header = _header("int8", [{"name": "w", "shape": [2]}])
    with pytest.raises(CodecError, match="'w': a block's prediction mode is 7"):
        codec.decode(handmade(header, [(0, 0, zstd.ZstdCompressor().compress(content))]))


def test_corrupt_huffman_streams_are_refused() -> None:
    payload = codec.encode({"w": adam_like(10_000, seed=14)}, CodecConfig(name="paper_int8"))
    header = json.loads(frame_spans_body(payload, 0)[8:])
    blob = frame_spans_body(payload, 1)[21:]
    for broken, message in (
        (blob[:-1], "stream is"),
        (blob + b"\0", "stream is|longer"),
        (blob[:8] + bytes(len(blob) - 8), "no codeword|do not end"),  # 4 segment lengths, then zeros
    ):
        with pytest.raises(CodecError, match=f"'w'.*huffman.*({message})|'w'.*({message})"):
            codec.decode(handmade(header, [(0, 0, broken)]))


def frame_spans_body(payload: bytes, index: int) -> bytes:
    _, start, end = frame_spans(payload)[index]
    return payload[start + frames.PREFIX.size : end]
