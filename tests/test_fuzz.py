"""Hypothesis sends thousands of malformed requests and streams to a real PS over gRPC: it stays up, unchanged."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geofed_hpc import codec
from geofed_hpc.config import RunConfig
from geofed_hpc.ps.app import ParameterServer
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc import serde
from geofed_hpc.rpc.client import PSClient
from geofed_hpc.rpc.guard import bearer
from geofed_hpc.rpc.stream import digest, to_chunks
from tests.conftest import ps_config, small_params
from tests.test_ps_bad_input import FP32, crafted, ones

TOKEN = "fuzz-enroll-secret"
LIMIT = 1 << 20  # message and delta limit of the fuzzed PS: oversize inputs are cheap to make
FUZZ = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
# Codes a malformed input may get. INTERNAL and UNKNOWN mean a crash (an exception no check caught), never bad input:
# request bytes are parsed inside the handler, so bytes that do not parse are INVALID_ARGUMENT.
ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
}


class Target:
    """The fuzzed PS: initialized, one delta applied (push id `applied`), its model hash remembered."""

    def __init__(self) -> None:
        cfg = ps_config(
            aggregation="async",
            enroll_token=TOKEN,
            max_message_bytes=LIMIT,
            max_delta_bytes=LIMIT,
            max_sessions=64,
            max_sessions_per_site=4,
            rpc_timeout="5s",
            round_timeout="10m",  # the fuzzer's own session stays active throughout
        )
        self.server = ParameterServer(replace(RunConfig(), ps=cfg))
        self.client = PSClient(cfg, self.server.address)
        self.client.connect()
        self.session = self.client.join(m.JoinRequest("fuzz", TOKEN)).session_id
        self.auth = bearer(self.session)  # the metadata of the fuzzer's own session: its calls pass the gate
        self.params = small_params()
        init = m.PushHeader(self.session, 0, 0, 0, "fp32", 0, b"", "init", init=True)
        assert self.client.push_delta(init, codec.encode(self.params, FP32)).accepted
        good = m.PushHeader(self.session, 0, 1, 1, "fp32", 0, b"", "applied")
        assert self.client.push_delta(good, codec.encode(ones(self.params), FP32)).accepted
        self.version = self.server.logic.version
        self.hash = self.server.logic.model_hash()
        unlimited = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self.raw = grpc.insecure_channel(self.server.address, options=unlimited)  # oversize reaches the server
        self.push = self.raw.stream_unary(
            serde.METHODS[[x.name for x in serde.METHODS].index("PushDelta")].path,
            request_serializer=serde.serializer(m.Chunk),
            response_deserializer=serde.deserializer(m.PushReply),
        )
        self.calls = 0

    def unchanged(self) -> None:
        self.calls += 1
        assert self.server.logic.version == self.version
        assert self.server.logic.model_hash() == self.hash

    def close(self) -> None:
        self.raw.close()
        self.client.close()
        self.server.stop()


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    t = Target()
    TARGET_SESSION[0] = t.session
    yield t
    t.close()


def expect_refused(call: Any) -> Any:
    """Run a call that must fail with one of the ALLOWED codes or succeed harmlessly; return its result."""
    try:
        return call()
    except grpc.RpcError as exc:
        assert exc.code() in ALLOWED, f"{exc.code()}: {exc.details()}"
        return None


def carried(credential: str, fallback: str = "") -> tuple[tuple[str, str], ...]:
    """The metadata a call with `credential` carries; one a header cannot hold (not printable ASCII) is sent as
    `fallback`'s (the fuzzed PS's own session by default), so the request still reaches the PS and must be refused
    there."""
    if credential.isascii() and credential.isprintable():
        return bearer(credential)
    return bearer(fallback or TARGET_SESSION[0])


TARGET_SESSION = [""]  # the fuzzed PS's own session, once it joined


# ---------------------------------------------------------------- raw bytes at the method level
METHODS = {meth.name: meth for meth in serde.METHODS}
ident = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}


@FUZZ
@given(name=st.sampled_from(["Join", "Heartbeat", "Status", "StreamModel", "FetchAux"]), body=st.binary(max_size=2048))
def test_raw_garbage_unary_requests(target: Target, name: str, body: bytes) -> None:
    path, auth = METHODS[name].path, bearer(TOKEN) if name in ("Join", "Status") else target.auth
    if METHODS[name].server_streaming:
        call = target.raw.unary_stream(path, **ident)
        expect_refused(lambda: list(call(body, timeout=10, metadata=auth)))
    else:
        call = target.raw.unary_unary(path, **ident)
        expect_refused(lambda: call(body, timeout=10, metadata=auth))
    target.unchanged()


def test_bytes_that_do_not_parse_are_bad_input_named_not_a_crash(target: Target) -> None:
    for name, kind in [("Join", "JoinRequest"), ("Heartbeat", "HeartbeatRequest"), ("StreamModel", "ModelRequest")]:
        call = (target.raw.unary_stream if METHODS[name].server_streaming else target.raw.unary_unary)(
            METHODS[name].path, **ident
        )
        with pytest.raises(grpc.RpcError) as err:
            result = call(b"\xff\xff\xff", timeout=10, metadata=bearer(TOKEN) if name == "Join" else target.auth)
            if METHODS[name].server_streaming:
                list(result)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"malformed {kind} message" in str(err.value.details())
    push = target.raw.stream_unary(METHODS["PushDelta"].path, **ident)
    with pytest.raises(grpc.RpcError) as err:
        push(iter([b"\xff\xff\xff"]), timeout=10, metadata=target.auth)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed Chunk message" in str(
        err.value.details()
    )
    target.unchanged()


@FUZZ
@given(
    messages=st.lists(
        st.one_of(
            st.binary(max_size=4096),
            st.builds(lambda n, b: bytes([b]) * n, st.integers(LIMIT - 64, LIMIT + 64), st.integers(0, 255)),
        ),
        max_size=6,
    )
)
def test_raw_garbage_push_streams(target: Target, messages: list[bytes]) -> None:
    call = target.raw.stream_unary(METHODS["PushDelta"].path, **ident)
    reply = expect_refused(lambda: call(iter(messages), timeout=10, metadata=target.auth))
    if reply is not None:  # bytes that happen to parse as a push are never an applied delta
        parsed = serde.deserializer(m.PushReply)(reply)
        assert parsed.duplicate or not parsed.accepted
    target.unchanged()


@FUZZ
@given(method=st.sampled_from(["/geofed.v1.ParameterServer/Nope", "/other.Service/Join", "/", "bad"]))
def test_unknown_methods(target: Target, method: str) -> None:
    expect_refused(lambda: target.raw.unary_unary(method, **ident)(b"\x00", timeout=10))
    target.unchanged()


# ---------------------------------------------------------------- well-framed messages with bad contents
text = st.text(max_size=80)
ints = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-5, 5))
floats = st.floats(allow_nan=True, allow_infinity=True)


@FUZZ
@given(site=text, token=st.one_of(text, st.just(TOKEN)), resume=st.one_of(st.just(""), text))
def test_joins_with_bad_or_random_fields(target: Target, site: str, token: str, resume: str) -> None:
    join = target.client._calls["Join"]
    expect_refused(lambda: join(m.JoinRequest(site, token, "", resume), timeout=10, metadata=carried(token)))
    assert len(target.server.logic.core.sessions.sessions) <= 64
    target.unchanged()


@FUZZ
@given(
    session=st.one_of(text, st.just("valid")),
    version=ints,
    steps=ints,
    val=floats,
    min_version=ints,
    wait=st.one_of(floats, st.floats(0, 0.05)),
    have=ints,
    leaving=st.booleans(),
)
def test_heartbeats_and_model_requests_with_bad_fields(
    target: Target, session: str, version: int, steps: int, val: float, min_version: int, wait: float, have: int,
    leaving: bool,
) -> None:  # fmt: skip
    sid = target.session if session == "valid" else session
    hb = m.HeartbeatRequest(sid, version, steps, leaving and sid != target.session, val)
    expect_refused(lambda: target.client._calls["Heartbeat"](hb, timeout=10, metadata=carried(sid)))
    if sid == target.session and not (math.isfinite(wait) and 0 <= wait <= 0.05):
        wait = 0.0  # a valid session may long-poll: keep the fuzz fast
    req = m.ModelRequest(sid, min_version, wait, have, True)
    expect_refused(lambda: list(target.client._calls["StreamModel"](req, timeout=10, metadata=carried(sid))))
    target.unchanged()


def _tensors(params: dict[str, np.ndarray], kind: str, rnd: np.random.Generator) -> bytes:
    bad = {k: np.ones_like(v) for k, v in params.items()}
    if kind == "nan":
        bad["blocks.0.w"].flat[int(rnd.integers(64))] = np.nan
        return crafted(bad)
    if kind == "inf":
        bad["ln.bias"][int(rnd.integers(8))] = -np.inf
        return crafted(bad)
    if kind == "shape":
        return codec.encode(bad | {"ln.bias": np.ones(int(rnd.integers(9, 40)), np.float32)}, FP32)
    if kind == "extra":
        return codec.encode(bad | {"extra.w": np.ones(3, np.float32)}, FP32)
    if kind == "missing":
        return codec.encode({k: v for k, v in bad.items() if k != "ln.bias"}, FP32)
    if kind == "dtype":
        return crafted(bad, dtype=str(rnd.choice(["float16", "int8", "bfloat16", "object"])))
    return rnd.bytes(int(rnd.integers(0, 5000)))  # "garbage": random bytes with a correct checksum


DEFECTS = (
    "checksum", "length", "truncate", "extend", "codec", "future", "stale", "steps", "tokens", "session", "no_id",
    "duplicate", "init", "second_header", "model_header", "no_header", "oversize_chunk", "oversize_announce",
    "nan", "inf", "shape", "extra", "missing", "dtype", "garbage", "flip_unverified",
)  # fmt: skip


@FUZZ
@given(
    defects=st.lists(st.sampled_from(DEFECTS), min_size=1, max_size=4, unique=True),
    seed=st.integers(0, 2**32 - 1),
    chunk=st.sampled_from([7, 100, 4096, 65536]),
    loss=floats,
)
def test_malformed_pushes(target: Target, defects: list[str], seed: int, chunk: int, loss: float) -> None:
    rnd = np.random.default_rng(seed)
    kinds = [d for d in defects if d in ("nan", "inf", "shape", "extra", "missing", "dtype", "garbage")]
    payload = _tensors(target.params, kinds[0], rnd) if kinds else codec.encode(ones(target.params), FP32)
    name = "int8" if "codec" in defects else "fp32"
    header = m.PushHeader(
        "0" * 32 if "session" in defects else target.session,
        target.version + int(rnd.integers(1, 10**6)) if "future" in defects else target.version,
        -int(rnd.integers(1, 100)) if "steps" in defects else 1,
        -int(rnd.integers(1, 100)) if "tokens" in defects else 1,
        name,
        len(payload),
        digest(payload),
        "" if "no_id" in defects else "applied" if "duplicate" in defects else os.urandom(8).hex(),
        init="init" in defects,
        train_loss=loss,
    )
    if "stale" in defects:
        header.base_version = target.version - 5 - int(rnd.integers(0, 100))
    if "checksum" in defects:
        header.sha256 = rnd.bytes(int(rnd.choice([32, 0, 31, 64])))
    if "length" in defects:
        header.total_bytes = len(payload) + int(rnd.choice([-1, 1, 1000]))
    if "oversize_announce" in defects:
        header.total_bytes = LIMIT + 1 + int(rnd.integers(0, 2**40))
    if "flip_unverified" in defects and payload:  # one byte changed after the checksum was taken
        flipped = bytearray(payload)
        flipped[int(rnd.integers(len(flipped)))] ^= 1 + int(rnd.integers(255))
        payload = bytes(flipped)
    chunks = list(to_chunks(header, payload, chunk))
    if "truncate" in defects:
        chunks = chunks[: max(1, len(chunks) - 1 - int(rnd.integers(0, len(chunks))))]
        if len(chunks) == 1 and chunk >= len(payload):
            chunks[0] = m.Chunk(data=chunks[0].data[: len(chunks[0].data) // 2], push=header)
    if "extend" in defects:
        chunks.append(m.Chunk(data=rnd.bytes(int(rnd.integers(1, 100)))))
    if "second_header" in defects:
        chunks.insert(min(1, len(chunks)), m.Chunk(data=b"", push=header))
    if "model_header" in defects:
        chunks[0] = m.Chunk(data=chunks[0].data, model=m.ModelHeader(0, "fp32", len(payload), digest(payload)))
    if "no_header" in defects:
        chunks[0] = m.Chunk(data=chunks[0].data)
    if "oversize_chunk" in defects:  # before the payload is complete: once it is, the push is whole and verified,
        # and gRPC may end the stream on the oversize message as if the client had closed it (then it is applied)
        first = chunks[0]
        chunks[0] = m.Chunk(data=b"", push=first.push, model=first.model)
        chunks[1:1] = [m.Chunk(data=b"\0" * (LIMIT + 1)), m.Chunk(data=first.data)]
    reply = expect_refused(lambda: target.push(iter(chunks), timeout=20, metadata=target.auth))
    if reply is not None:  # only a duplicate or a second init may be answered, and neither is applied
        assert reply.duplicate or not reply.accepted, (defects, reply)
    target.unchanged()
    assert not list(target.server.logic.staging.directory.iterdir())


def test_after_the_fuzz_the_ps_is_alive_unchanged_and_takes_a_valid_push(
    target: Target, request: pytest.FixtureRequest
) -> None:
    here = [item for item in request.session.items if item.module is request.module and "target" in item.fixturenames]
    if len(here) == 7:  # every test of the fuzzed PS ran (not a -k selection)
        assert target.calls >= 2000, f"only {target.calls} malformed inputs were sent"
    assert target.client.health() == "SERVING"
    target.unchanged()
    good = m.PushHeader(target.session, target.version, 1, 1, "fp32", 0, b"", "after-the-fuzz")
    assert target.client.push_delta(good, codec.encode(ones(target.params), FP32)).accepted
    assert target.server.logic.version == target.version + 1
    assert target.server.logic.model_hash() != target.hash


# ---------------------------------------------------------------- split learning's RPCs, on a PS with a server part
class SplitTarget:
    """A fsl_sage PS with its server part (nothing uploaded yet) and a session of it."""

    def __init__(self) -> None:
        from tests.test_split import split_cfg

        cfg = split_cfg()
        cfg = replace(cfg, ps=replace(cfg.ps, max_message_bytes=LIMIT, max_delta_bytes=LIMIT, rpc_timeout="5s"))
        self.server = ParameterServer(cfg)
        assert self.server.split is not None
        self.part = self.server.split
        self.client = PSClient(cfg.ps, self.server.address)
        self.client.connect()
        self.session = self.client.join(m.JoinRequest("fuzz", paradigm=cfg.paradigm.describe())).session_id
        self.auth = bearer(self.session)
        self.digest = self.part.digest()
        unlimited = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self.raw = grpc.insecure_channel(self.server.address, options=unlimited)
        self.calls = 0

    def unchanged(self) -> None:
        self.calls += 1
        assert self.part.digest() == self.digest
        assert self.part.server.steps == 0 and self.part.server.alignments == 0 and not self.part.server.kept.items

    def close(self) -> None:
        self.raw.close()
        self.client.close()
        self.server.stop()


@pytest.fixture(scope="module")
def split_target() -> Iterator[SplitTarget]:
    t = SplitTarget()
    yield t
    t.close()


def test_split_bytes_that_do_not_parse_are_bad_input_named_not_a_crash(split_target: SplitTarget) -> None:
    split = split_target.raw.stream_stream(METHODS["Split"].path, **ident)
    with pytest.raises(grpc.RpcError) as err:
        list(split(iter([b"\xff\xff\xff"]), timeout=10, metadata=split_target.auth))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed Chunk message" in str(err.value.details())
    fetch = split_target.raw.unary_stream(METHODS["FetchAux"].path, **ident)
    with pytest.raises(grpc.RpcError) as err:
        list(fetch(b"\xff\xff\xff", timeout=10, metadata=split_target.auth))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed AuxRequest message" in str(err.value.details())
    split_target.unchanged()


@FUZZ
@given(
    messages=st.lists(st.binary(max_size=4096), max_size=6),
    body=st.binary(max_size=2048),
)
def test_raw_garbage_split_streams_and_aux_requests(
    split_target: SplitTarget, messages: list[bytes], body: bytes
) -> None:
    split = split_target.raw.stream_stream(METHODS["Split"].path, **ident)
    expect_refused(lambda: list(split(iter(messages), timeout=10, metadata=split_target.auth)))
    fetch = split_target.raw.unary_stream(METHODS["FetchAux"].path, **ident)
    expect_refused(lambda: list(fetch(body, timeout=10, metadata=split_target.auth)))
    split_target.unchanged()


@FUZZ
@given(
    session=st.one_of(text, st.just("valid")),
    kind=st.one_of(text, st.sampled_from(["train", "eval", "gradient", "aux"])),
    cut=ints,
    shape=st.lists(ints, max_size=4),
    codec_name=st.one_of(text, st.sampled_from(["bf16", "int8", "fp32"])),
    acts_bytes=ints,
    announce=ints,
    seed=st.integers(0, 2**32 - 1),
    version=ints,
)
def test_split_uploads_and_aux_requests_with_bad_fields(
    split_target: SplitTarget, session: str, kind: str, cut: int, shape: list[int], codec_name: str,
    acts_bytes: int, announce: int, seed: int, version: int,
) -> None:  # fmt: skip
    sid = split_target.session if session == "valid" else session
    payload = np.random.default_rng(seed).bytes(seed % 5000)
    header = m.SplitHeader(sid, kind, cut, shape, codec_name, announce, digest(payload), acts_bytes)
    auth = carried(sid, split_target.session)
    split = split_target.client._calls["Split"]
    expect_refused(lambda: list(split(iter(to_chunks(header, payload, 4096)), timeout=10, metadata=auth)))
    request = m.AuxRequest(sid, version, cut)
    expect_refused(lambda: list(split_target.client._calls["FetchAux"](request, timeout=10, metadata=auth)))
    split_target.unchanged()
