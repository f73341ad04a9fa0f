"""The parameter server's logic in memory (no network): joins, rounds, staleness, bad pushes."""

from __future__ import annotations

import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.config import CodecConfig
from geofed_hpc.errors import AuthError, CodecError, ProtocolError, StaleError
from geofed_hpc.ps.servicer import ParameterServerLogic
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.stream import collect, digest, to_chunks
from tests.conftest import ps_config, small_params

FP32 = CodecConfig(name="fp32")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def push_chunks(session: str, base: int, arrays: dict, *, init: bool = False, push_id: str = "", cfg=FP32) -> list:
    payload = codec.encode(arrays, cfg)
    header = m.PushHeader(
        session, base, 3, 30, cfg.name, len(payload), digest(payload), push_id or f"p{base}{session}", init=init
    )
    return list(to_chunks(header, payload, 4096))


def pull(logic: ParameterServerLogic, session: str, min_version: int = 0) -> tuple[int, dict]:
    header, payload = collect(logic.stream_model(m.ModelRequest(session, min_version, 0.0)), 1 << 30)
    return header.version, codec.decode(payload)


def make(aggregation: str = "sync", clock: Clock | None = None, **kw) -> ParameterServerLogic:
    return ParameterServerLogic(ps_config(**kw), m.RunSettings(aggregation=aggregation), clock=clock or Clock())


def joined(logic: ParameterServerLogic, n: int) -> list[str]:
    return [logic.join(m.JoinRequest(f"site{i}")).session_id for i in range(n)]


def init(logic: ParameterServerLogic, session: str) -> dict:
    params = small_params()
    reply = logic.push_delta(iter(push_chunks(session, 0, params, init=True, push_id="init")))
    assert reply.accepted
    return params


def test_sync_round_applies_global_lr_times_mean() -> None:
    logic = make(global_lr=0.5)
    a, b = joined(logic, 2)
    params = init(logic, a)
    da = {k: np.full_like(v, 1.0) for k, v in params.items()}
    db = {k: np.full_like(v, 3.0) for k, v in params.items()}
    assert logic.push_delta(iter(push_chunks(a, 0, da))).version == 0  # waits for b
    assert logic.version == 0
    reply = logic.push_delta(iter(push_chunks(b, 0, db)))
    assert reply.accepted and reply.version == 1
    version, new = pull(logic, a, 1)
    assert version == 1
    for k in params:
        np.testing.assert_allclose(new[k], params[k] + 0.5 * 2.0, rtol=1e-6)


def test_sync_round_closes_at_deadline_without_the_straggler() -> None:
    clock = Clock()
    logic = make(clock=clock, round_timeout="10s")
    a, _b = joined(logic, 2)
    params = init(logic, a)
    logic.push_delta(iter(push_chunks(a, 0, {k: np.ones_like(v) for k, v in params.items()})))
    clock.now += 9
    logic.tick()
    assert logic.version == 0
    clock.now += 2
    logic.tick()
    assert logic.version == 1


def test_heartbeat_tells_stragglers_to_sync_and_leaving_closes_round() -> None:
    logic = make()
    a, b = joined(logic, 2)
    params = init(logic, a)
    logic.push_delta(iter(push_chunks(a, 0, {k: np.ones_like(v) for k, v in params.items()})))
    assert logic.heartbeat(m.HeartbeatRequest(b)).sync_now
    assert not logic.heartbeat(m.HeartbeatRequest(a)).sync_now
    logic.heartbeat(m.HeartbeatRequest(b, leaving=True))
    assert logic.version == 1


def test_async_applies_on_arrival_with_staleness_discount() -> None:
    logic = make("async", max_staleness=2)
    a, b = joined(logic, 2)
    params = init(logic, a)
    ones = {k: np.ones_like(v) for k, v in params.items()}
    logic.push_delta(iter(push_chunks(a, 0, ones, push_id="1")))
    assert logic.version == 1
    reply = logic.push_delta(iter(push_chunks(b, 0, ones, push_id="2")))
    assert reply.staleness == 1 and logic.version == 2
    _, new = pull(logic, a)
    np.testing.assert_allclose(new["ln.bias"], 1.0 + 1.0 / np.sqrt(2.0), rtol=1e-6)
    logic.push_delta(iter(push_chunks(a, 2, ones, push_id="3")))
    with pytest.raises(StaleError, match="stale"):
        logic.push_delta(iter(push_chunks(b, 0, ones, push_id="4")))


def test_duplicate_push_is_not_applied_twice() -> None:
    logic = make("async")
    (a,) = joined(logic, 1)
    params = init(logic, a)
    chunks = push_chunks(a, 0, {k: np.ones_like(v) for k, v in params.items()}, push_id="same")
    logic.push_delta(iter(chunks))
    reply = logic.push_delta(iter(chunks))
    assert reply.duplicate and logic.version == 1


@pytest.mark.parametrize(
    "mutate, error",
    [
        (lambda d: {**d, "ln.bias": np.zeros(9, dtype=np.float32)}, CodecError),
        (lambda d: {k: v for k, v in d.items() if k != "ln.bias"}, CodecError),
        (lambda d: {**d, "extra": np.zeros(2, dtype=np.float32)}, CodecError),
    ],
    ids=["wrong-shape", "missing-name", "extra-name"],
)
def test_bad_delta_leaves_global_model_untouched(mutate, error) -> None:
    logic = make("async")
    (a,) = joined(logic, 1)
    params = init(logic, a)
    with pytest.raises(error):
        logic.push_delta(iter(push_chunks(a, 0, mutate({k: np.ones_like(v) for k, v in params.items()}))))
    version, now = pull(logic, a)
    assert version == 0
    for k in params:
        np.testing.assert_array_equal(now[k], params[k])


def test_truncated_and_corrupt_streams_are_refused() -> None:
    logic = make("async")
    (a,) = joined(logic, 1)
    init(logic, a)
    chunks = push_chunks(a, 0, small_params(seed=7), push_id="t")
    assert len(chunks) > 1
    with pytest.raises(CodecError, match="truncated"):
        logic.push_delta(iter(chunks[:-1]))
    bad = list(chunks)
    bad[-1] = m.Chunk(data=bytes(len(bad[-1].data)))
    with pytest.raises(CodecError, match="checksum"):
        logic.push_delta(iter(bad))
    with pytest.raises(ProtocolError, match="header"):
        logic.push_delta(iter(chunks[1:]))
    assert logic.version == 0


def test_future_base_version_and_unknown_session() -> None:
    logic = make("async")
    (a,) = joined(logic, 1)
    params = init(logic, a)
    with pytest.raises(ProtocolError, match="newer"):
        logic.push_delta(iter(push_chunks(a, 5, params)))
    with pytest.raises(AuthError, match="unknown session"):
        logic.push_delta(iter(push_chunks("nope", 0, params)))


def test_rejoin_token_is_one_time_and_enroll_token_checked() -> None:
    logic = make(enroll_token="s3cret")
    with pytest.raises(AuthError, match="enrollment"):
        logic.join(m.JoinRequest("osc", "wrong"))
    first = logic.join(m.JoinRequest("osc", "s3cret"))
    second = logic.join(m.JoinRequest("osc", first.rejoin_token, resume_session=first.session_id))
    assert second.session_id == first.session_id and second.rejoin_token != first.rejoin_token
    with pytest.raises(AuthError, match="already used"):
        logic.join(m.JoinRequest("osc", first.rejoin_token, resume_session=first.session_id))


def test_second_init_is_refused_and_uninitialized_push_is_stale() -> None:
    logic = make()
    a, b = joined(logic, 2)
    with pytest.raises(StaleError, match="not initialized"):
        logic.push_delta(iter(push_chunks(a, 0, small_params())))
    init(logic, a)
    reply = logic.push_delta(iter(push_chunks(b, 0, small_params(1), init=True, push_id="init-b")))
    assert not reply.accepted and "already" in reply.reason
    _, now = pull(logic, b)
    np.testing.assert_array_equal(now["wte.weight"], small_params()["wte.weight"])


def test_snapshot_restores_after_restart(tmp_path) -> None:
    logic = make("async", state_dir=str(tmp_path))
    (a,) = joined(logic, 1)
    params = init(logic, a)
    logic.push_delta(iter(push_chunks(a, 0, {k: np.ones_like(v) for k, v in params.items()})))
    restarted = make("async", state_dir=str(tmp_path))
    assert restarted.version == 1
    (c,) = joined(restarted, 1)
    _, now = pull(restarted, c)
    np.testing.assert_allclose(now["ln.bias"], 1.0)


def test_int8_delta_is_accepted() -> None:
    logic = make("async")
    (a,) = joined(logic, 1)
    params = init(logic, a)
    delta = {k: np.random.default_rng(1).normal(size=v.shape).astype(np.float32) * 1e-3 for k, v in params.items()}
    logic.push_delta(iter(push_chunks(a, 0, delta, cfg=CodecConfig(name="int8", block_size=64))))
    _, now = pull(logic, a)
    for k in params:
        np.testing.assert_allclose(now[k], params[k] + delta[k], atol=2e-5)
