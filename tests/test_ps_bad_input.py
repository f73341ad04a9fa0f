"""Every bad push gets a precise error (in memory) or gRPC status (on the wire); the global model stays as it was."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import zstandard

from geofed_hpc import codec
from geofed_hpc.codec import frames, sparse
from geofed_hpc.codec.stream import _DATA, _END, piece_len
from geofed_hpc.config import CodecConfig
from geofed_hpc.errors import AuthError, CodecError, GeofedError, ProtocolError, StaleError
from geofed_hpc.ps.servicer import ParameterServerLogic
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from geofed_hpc.rpc.guard import bearer
from geofed_hpc.rpc.stream import digest, to_chunks
from tests.conftest import ps_config, small_params
from tests.test_ps_logic import init, joined, make, push_chunks

FP32 = CodecConfig(name="fp32")


def crafted(tensors: dict[str, np.ndarray], **entry_extra: str) -> bytes:
    """An fp32 payload framed by hand as codec/stream.py documents it, so it can carry what encode refuses
    (NaN, Inf, a dtype field). Every tensor fits in one piece."""
    sid = b"crafted!"
    entries = [{"name": k, "shape": list(v.shape), **entry_extra} for k, v in tensors.items()]
    header = {"codec": "fp32", "block_size": 64, "piece": piece_len(64), "tensors": entries}
    out = [frames.pack(frames.HEADER, sid + json.dumps(header).encode())]
    total = 0
    for ti, arr in enumerate(tensors.values()):
        flat = np.ascontiguousarray(arr, "<f4").reshape(-1)
        planes = flat.view(np.uint8).reshape(-1, 4).T.copy()  # fp32 content: the 4 byte planes
        blob = zstandard.ZstdCompressor().compress(planes.tobytes())
        out.append(frames.pack(frames.DATA, _DATA.pack(sid, ti, 0, 0, 1) + blob))
        total += flat.size
    out.append(frames.pack(frames.END, _END.pack(sid, len(out), total)))
    return b"".join(out)


def chunks_for(session: str, payload: bytes, *, base: int = 0, codec_name: str = "fp32", **kw) -> list[m.Chunk]:
    fields = dict(local_steps=3, tokens=30, push_id=f"bad-{len(payload)}-{base}-{codec_name}")
    fields.update(kw)
    header = m.PushHeader(session, base, codec=codec_name, total_bytes=len(payload), sha256=digest(payload), **fields)
    return list(to_chunks(header, payload, 4096))


def ones(params: dict) -> dict:
    return {k: np.ones_like(v) for k, v in params.items()}


def without(d: dict, name: str) -> dict:
    return {k: v for k, v in d.items() if k != name}


MODEL_HEADER = m.ModelHeader(0, "fp32", 3, digest(b"abc"))


def noisy(s: str, push_id: str) -> list[m.Chunk]:
    """A push of incompressible values: several chunks, so one can be dropped or damaged."""
    chunks = push_chunks(s, 0, small_params(seed=7), push_id=push_id)
    assert len(chunks) > 2
    return chunks


Case = Callable[[str, dict], list[m.Chunk]]
BAD, PRE, LOSS, AUTH = "INVALID_ARGUMENT", "FAILED_PRECONDITION", "DATA_LOSS", "UNAUTHENTICATED"


def _nan(s: str, p: dict) -> list[m.Chunk]:
    bad = ones(p)
    bad["blocks.0.w"][3, 3] = np.nan
    return chunks_for(s, crafted(bad))


def _inf(s: str, p: dict) -> list[m.Chunk]:
    bad = ones(p)
    bad["ln.bias"][0] = -np.inf
    return chunks_for(s, crafted(bad))


def _bad_checksum(s: str, p: dict) -> list[m.Chunk]:
    chunks = noisy(s, "sum")
    chunks[-1] = m.Chunk(data=bytes(len(chunks[-1].data)))
    return chunks


def _second_header(s: str, p: dict) -> list[m.Chunk]:
    chunks = noisy(s, "two")
    return [chunks[0], m.Chunk(data=chunks[1].data, push=chunks[0].push), *chunks[2:]]


def _too_long(s: str, p: dict) -> list[m.Chunk]:
    return [*noisy(s, "long"), m.Chunk(data=b"extra")]


def _oversize(s: str, p: dict) -> list[m.Chunk]:
    chunks = push_chunks(s, 0, ones(p), push_id="big")
    assert chunks[0].push is not None
    chunks[0].push.total_bytes = 1 << 40
    return chunks


SPARSE = CodecConfig(name="sparse", chunk=64, density=1 / 16, dense_below=0, mean_row=False)  # top-k: 4 of 64


def tampered_sparse(s: str, p: dict, part: str, at: int, value: int) -> list[m.Chunk]:
    """A valid sparse push of `p` whose first tensor's content byte `at` of `part` (gaps: the low bytes of the
    first chunk's gaps) is set to `value`, or whose header keeps `value` values per chunk (part "keep"). Frames
    are rebuilt with correct checksums: only the decoder can tell."""
    out = []
    for frame in frames.FrameReader([codec.encode(ones(p), SPARSE)]):
        body = bytes(frame.body)
        if frame.kind == frames.HEADER and part == "keep":
            head = json.loads(body[8:])
            head["sparse"]["keep"] = value
            body = body[:8] + json.dumps(head).encode()
        elif frame.kind == frames.DATA and frame.index == 1 and part == "gaps":
            content = bytearray(zstandard.ZstdDecompressor().decompress(body[_DATA.size :]))
            lay = sparse.Layout.of(4000, 64, 4, 2)  # wte.weight: 62 chunks of 64 and a tail of 32
            content[8 * lay.chunks + (lay.kept * 2 + 7) // 8 + at] = value
            body = body[: _DATA.size] + zstandard.ZstdCompressor().compress(bytes(content))
        out.append(frames.pack(frame.kind, body))
    return chunks_for(s, b"".join(out), codec_name="sparse", push_id=f"sparse-{part}-{at}-{value}")


# (id, build chunks from (session, params), error class in memory, gRPC status on the wire)
CASES: list[tuple[str, Case, type[GeofedError], str]] = [
    ("wrong-shape", lambda s, p: push_chunks(s, 0, ones(p) | {"ln.bias": np.ones(9, np.float32)}), ProtocolError, BAD),
    ("missing-name", lambda s, p: push_chunks(s, 0, without(ones(p), "ln.bias")), ProtocolError, BAD),
    ("extra-name", lambda s, p: push_chunks(s, 0, ones(p) | {"extra": np.ones(2, np.float32)}), ProtocolError, BAD),
    ("wrong-dtype", lambda s, p: chunks_for(s, crafted(ones(p), dtype="float16")), ProtocolError, BAD),
    ("nan", _nan, ProtocolError, BAD),
    ("inf", _inf, ProtocolError, BAD),
    ("not-a-delta", lambda s, p: chunks_for(s, b"PK\x03\x04 a zip file, not a delta"), ProtocolError, BAD),
    ("codec-mismatch", lambda s, p: chunks_for(s, codec.encode(ones(p), FP32), codec_name="int8"), ProtocolError, BAD),
    ("wrong-checksum", _bad_checksum, CodecError, LOSS),
    ("truncated", lambda s, p: noisy(s, "cut")[:-1], CodecError, LOSS),
    ("longer-than-announced", _too_long, ProtocolError, BAD),
    ("second-header", _second_header, ProtocolError, BAD),
    ("no-header", lambda s, p: noisy(s, "nohead")[1:], ProtocolError, BAD),
    ("empty-stream", lambda s, p: [], ProtocolError, BAD),
    ("oversize", _oversize, ProtocolError, BAD),
    ("model-header", lambda s, p: list(to_chunks(MODEL_HEADER, b"abc", 4096)), ProtocolError, BAD),
    ("negative-tokens", lambda s, p: push_chunks(s, 0, ones(p), tokens=-1), ProtocolError, BAD),
    ("future-version", lambda s, p: push_chunks(s, 5, ones(p)), StaleError, PRE),
    ("too-stale", lambda s, p: push_chunks(s, -9, ones(p)), StaleError, PRE),
    ("unknown-session", lambda s, p: push_chunks("0" * 32, 0, ones(p)), AuthError, AUTH),
    ("sparse-out-of-range", lambda s, p: tampered_sparse(s, p, "gaps", 3, 100), ProtocolError, BAD),
    ("sparse-not-increasing", lambda s, p: tampered_sparse(s, p, "gaps", 1, 0), ProtocolError, BAD),
    ("sparse-more-than-its-chunk", lambda s, p: tampered_sparse(s, p, "keep", 0, 65), ProtocolError, BAD),
]  # fmt: skip


def test_crafted_payloads_are_well_formed() -> None:
    params = small_params()
    decoded = codec.decode(crafted(params))
    assert all(decoded[k].tobytes() == params[k].tobytes() for k in params)


def staged_files(logic: ParameterServerLogic) -> list[Path]:
    return [p for p in logic.staging.directory.iterdir()]


@pytest.mark.parametrize("build, error, code", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_push_in_memory_leaves_model_untouched(build: Case, error: type, code: str) -> None:
    logic = make("async")
    (a,) = joined(logic, 1)
    params = init(logic, a)
    before = logic.model_hash()
    with pytest.raises(error) as info:
        logic.push_delta(iter(build(a, params)))
    assert str(info.value)
    assert logic.model_hash() == before and logic.version == 0 and logic.rounds.count == 0
    assert staged_files(logic) == []
    logic.staging.close()


def test_refusals_are_counted_and_a_good_push_still_works() -> None:
    logic = make("async", outer_optimizer="fednova")
    (a,) = joined(logic, 1)
    params = init(logic, a)
    with pytest.raises(ProtocolError, match="local_steps must be >= 1"):
        logic.push_delta(iter(push_chunks(a, 0, ones(params), steps=0)))
    tokens = make("sync", weighting="tokens")
    (b,) = joined(tokens, 1)
    init(tokens, b)
    with pytest.raises(ProtocolError, match="tokens must be >= 1"):
        tokens.push_delta(iter(push_chunks(b, 0, ones(params), tokens=0)))
    assert logic.status(m.StatusRequest()).sites[0].refused == 1
    assert logic.push_delta(iter(push_chunks(a, 0, ones(params)))).accepted
    assert logic.version == 1


def test_duplicate_push_is_answered_ok_and_not_applied() -> None:
    logic = make("async")
    (a,) = joined(logic, 1)
    params = init(logic, a)
    chunks = push_chunks(a, 0, ones(params), push_id="dup")
    logic.push_delta(iter(chunks))
    before = logic.model_hash()
    reply = logic.push_delta(iter(chunks))
    assert reply.duplicate and logic.model_hash() == before and logic.version == 1


@pytest.mark.parametrize("live_ps", [{"aggregation": "async"}], indirect=True)
def test_bad_pushes_over_grpc_get_precise_statuses(live_ps) -> None:
    logic = live_ps.logic
    with PSClient(ps_config(), live_ps.address) as client:
        a = client.join(m.JoinRequest("site-a")).session_id
        params = small_params()
        client.push_delta(m.PushHeader(a, 0, 0, 0, "fp32", 0, b"", "", init=True), codec.encode(params, FP32))
        before = logic.model_hash()
        raw = client._calls["PushDelta"]
        for name, build, _, code in CASES:
            with pytest.raises(grpc.RpcError) as info:
                raw(iter(build(a, params)), timeout=30, metadata=bearer(a))
            assert info.value.code().name == code, f"{name}: {info.value.code().name} {info.value.details()}"
            assert info.value.details(), name
        assert logic.model_hash() == before and logic.version == 0
        assert staged_files(logic) == []
        dup = m.PushHeader(a, 0, 1, 1, "fp32", 0, b"", "dup-wire")
        assert not client.push_delta(dup, codec.encode(ones(params), FP32)).duplicate
        assert client.push_delta(dup, codec.encode(ones(params), FP32)).duplicate
        assert logic.version == 1


@pytest.mark.parametrize("live_ps", [{"aggregation": "async"}], indirect=True)
def test_client_that_breaks_off_mid_stream_changes_nothing(live_ps) -> None:
    logic = live_ps.logic
    with PSClient(ps_config(), live_ps.address) as client:
        a = client.join(m.JoinRequest("site-a")).session_id
        params = small_params()
        client.push_delta(m.PushHeader(a, 0, 0, 0, "fp32", 0, b"", "", init=True), codec.encode(params, FP32))
        before = logic.model_hash()
        # random values, so the payload spans several chunks and the break falls before its last byte (a stream cut
        # after its last chunk carries a whole, verified delta, which the PS may rightly apply)
        chunks = push_chunks(a, 0, small_params(seed=1), push_id="broken")
        assert len(chunks) > 3

        def broken() -> Iterator[m.Chunk]:
            yield from chunks[:2]
            raise ConnectionError("the site's link dropped")

        with pytest.raises(grpc.RpcError) as info:
            client._calls["PushDelta"](broken(), timeout=30, metadata=bearer(a))
        assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE)
        assert logic.model_hash() == before
        # the retransmission (same push id) is applied once
        assert client._calls["PushDelta"](iter(chunks), timeout=30, metadata=bearer(a)).accepted
        assert logic.version == 1
        assert staged_files(logic) == []
