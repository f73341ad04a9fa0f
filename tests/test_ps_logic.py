"""The parameter server's logic in memory: every mode and outer optimizer against hand-computed results."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.config import CodecConfig
from geofed_hpc.errors import AuthError, ProtocolError, StaleError
from geofed_hpc.ps.servicer import ParameterServerLogic
from geofed_hpc.ps.sessions import handle_of
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.stream import collect, digest, to_chunks
from tests.conftest import ps_config, small_params
from tests.site_procs import wait_for

FP32 = CodecConfig(name="fp32")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def push_chunks(
    session: str,
    base: int,
    arrays: dict,
    *,
    init: bool = False,
    push_id: str = "",
    cfg: CodecConfig = FP32,
    steps: int = 3,
    tokens: int = 30,
) -> list[m.Chunk]:
    payload = codec.encode(arrays, cfg)
    pid = push_id or f"p{base}{session}{steps}{tokens}"
    header = m.PushHeader(session, base, steps, tokens, cfg.name, len(payload), digest(payload), pid, init=init)
    return list(to_chunks(header, payload, 4096))


def push(logic: ParameterServerLogic, session: str, base: int, arrays: dict, **kw: Any) -> m.PushReply:
    return logic.push_delta(iter(push_chunks(session, base, arrays, **kw)))


def pull(logic: ParameterServerLogic, session: str, min_version: int = 0) -> tuple[int, dict]:
    header, payload = collect(logic.stream_model(m.ModelRequest(session, min_version, 0.0)), 1 << 30)
    assert isinstance(header, m.ModelHeader) and header.kind == "full"
    return header.version, codec.decode(payload)


def make(
    aggregation: str = "sync", clock: Clock | None = None, run_codec: str = "fp32", **kw: Any
) -> ParameterServerLogic:
    settings = m.RunSettings(aggregation=aggregation, codec=run_codec, block_size=64)
    return ParameterServerLogic(ps_config(aggregation=aggregation, **kw), settings, clock=clock or Clock())


def joined(logic: ParameterServerLogic, n: int) -> list[str]:
    return [logic.join(m.JoinRequest(f"site{i}")).session_id for i in range(n)]


def init(logic: ParameterServerLogic, session: str, params: dict | None = None, version: int = 0) -> dict:
    params = params if params is not None else small_params()
    reply = push(logic, session, version, params, init=True, push_id=f"init-{session}")
    assert reply.accepted, reply.reason
    return params


def full(params: dict, value: float) -> dict:
    return {k: np.full_like(v, value) for k, v in params.items()}


def expect(logic: ParameterServerLogic, session: str, expected: dict, version: int, atol: float = 1e-7) -> None:
    got_version, got = pull(logic, session)
    assert got_version == version
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-6, atol=atol)


def test_sync_round_applies_global_lr_times_mean() -> None:
    logic = make(global_lr=0.5)
    a, b = joined(logic, 2)
    params = init(logic, a)
    assert push(logic, a, 0, full(params, 1.0)).version == 0  # waits for b
    reply = push(logic, b, 0, full(params, 3.0))
    assert reply.accepted and reply.version == 1
    expect(logic, a, {k: v + 0.5 * 2.0 for k, v in params.items()}, 1)


def test_sync_weighted_by_tokens() -> None:
    logic = make(weighting="tokens")
    a, b = joined(logic, 2)
    params = init(logic, a)
    push(logic, a, 0, full(params, 1.0), tokens=10)
    push(logic, b, 0, full(params, 3.0), tokens=30)
    expect(logic, a, {k: v + (10 * 1.0 + 30 * 3.0) / 40 for k, v in params.items()}, 1)


def test_sync_round_closes_at_deadline_without_the_straggler() -> None:
    clock = Clock()
    logic = make(clock=clock, round_timeout="10s")
    a, _b = joined(logic, 2)
    params = init(logic, a)
    push(logic, a, 0, full(params, 1.0))
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
    push(logic, a, 0, full(params, 1.0))
    assert logic.heartbeat(m.HeartbeatRequest(b)).sync_now
    assert not logic.heartbeat(m.HeartbeatRequest(a)).sync_now
    logic.heartbeat(m.HeartbeatRequest(b, leaving=True))
    assert logic.version == 1
    assert {s.site: s.state for s in logic.status(m.StatusRequest()).sites} == {"site0": "active", "site1": "left"}


def test_async_applies_on_arrival_with_staleness_discount_and_refuses_too_stale() -> None:
    logic = make("async", max_staleness=2)
    a, b = joined(logic, 2)
    params = init(logic, a)
    push(logic, a, 0, full(params, 1.0), push_id="1")
    assert logic.version == 1
    reply = push(logic, b, 0, full(params, 1.0), push_id="2")
    assert reply.staleness == 1 and logic.version == 2
    expect(logic, a, {k: v + 1.0 + 1.0 / np.sqrt(2.0) for k, v in params.items()}, 2)
    push(logic, a, 2, full(params, 1.0), push_id="3")
    with pytest.raises(StaleError, match="3 versions stale"):
        push(logic, b, 0, full(params, 1.0), push_id="4")
    assert logic.version == 3


def test_async_token_weighting_scales_each_delta_by_its_tokens_against_recent_deltas() -> None:
    logic = make("async", weighting="tokens", max_staleness=4)
    a, b = joined(logic, 2)
    params = init(logic, a)
    push(logic, a, 0, full(params, 1.0), push_id="1", tokens=100)  # alone in the window: x 1
    push(logic, b, 1, full(params, 1.0), push_id="2", tokens=300)  # 300 / mean(100, 300) = 1.5
    push(logic, a, 1, full(params, 1.0), push_id="3", tokens=200)  # 200 / 200 = 1, then x 1/sqrt(2) stale
    expect(logic, a, {k: v + 1.0 + 1.5 + 1.0 / np.sqrt(2.0) for k, v in params.items()}, 3)
    uniform = make("async", max_staleness=4)  # the same pushes, uniform: each counts 1
    a, b = joined(uniform, 2)
    params = init(uniform, a)
    for i, (site, base, tokens) in enumerate([(a, 0, 100), (b, 1, 300), (a, 1, 200)]):
        push(uniform, site, base, full(params, 1.0), push_id=str(i), tokens=tokens)
    expect(uniform, a, {k: v + 2.0 + 1.0 / np.sqrt(2.0) for k, v in params.items()}, 3)


def test_buffered_applies_after_k_deltas_or_deadline() -> None:
    clock = Clock()
    logic = make("buffered", clock=clock, buffer_size=3, round_timeout="10s")
    a, b = joined(logic, 2)
    params = init(logic, a)
    push(logic, a, 0, full(params, 1.0), push_id="1")
    push(logic, b, 0, full(params, 2.0), push_id="2")
    assert logic.version == 0 and logic.rounds.count == 2
    push(logic, a, 0, full(params, 6.0), push_id="3")  # the same site may fill the buffer twice
    assert logic.version == 1
    expect(logic, a, {k: v + 3.0 for k, v in params.items()}, 1)
    push(logic, b, 1, full(params, 1.0), push_id="4")
    clock.now += 11
    logic.tick()
    expect(logic, a, {k: v + 4.0 for k, v in params.items()}, 2)


def test_nesterov_outer_optimizer_by_hand() -> None:
    logic = make("async", outer_optimizer="nesterov", global_lr=0.7, momentum=0.9)
    (a,) = joined(logic, 1)
    params = init(logic, a)
    push(logic, a, 0, full(params, 1.0), push_id="1")  # update 0.7 * (1 + 0.9 * 1) = 1.33
    push(logic, a, 1, full(params, 2.0), push_id="2")  # m = 2.9; update 0.7 * (2 + 0.9 * 2.9) = 3.227
    expect(logic, a, {k: v + np.float32(1.33) + np.float32(3.227) for k, v in params.items()}, 2)


def test_fednova_normalises_by_local_steps() -> None:
    logic = make(outer_optimizer="fednova")
    a, b = joined(logic, 2)
    params = init(logic, a)
    # d/steps: 2/2 = 1 and 12/6 = 2 -> mean 1.5; tau_eff = (2 + 6) / 2 = 4 -> update 6
    push(logic, a, 0, full(params, 2.0), steps=2)
    push(logic, b, 0, full(params, 12.0), steps=6)
    expect(logic, a, {k: v + 6.0 for k, v in params.items()}, 1)


@pytest.mark.parametrize(
    "rule, extra, expected",
    [("trimmed_mean", {"trim_fraction": 0.2}, 2.0), ("median", {}, 2.0)],
)
def test_robust_rules_ignore_an_outlier_and_clean_their_spool(tmp_path, rule, extra, expected) -> None:
    logic = make(robust=rule, staging_dir=str(tmp_path / "staging"), **extra)
    sessions = joined(logic, 5)
    params = init(logic, sessions[0])
    for sid, value in zip(sessions, (1.0, 2.0, 3.0, 1000.0, -50.0), strict=True):
        push(logic, sid, 0, full(params, value))
    # sorted per coordinate: -50, 1, 2, 3, 1000 -> trimmed (f=0.2) mean of 1, 2, 3 = 2; median = 2
    expect(logic, sessions[0], {k: v + expected for k, v in params.items()}, 1)
    assert list((tmp_path / "staging").iterdir()) == []


def test_robust_rule_reads_in_slices(monkeypatch) -> None:
    import geofed_hpc.ps.rounds as rounds

    monkeypatch.setattr(rounds, "ROBUST_SLICE_BYTES", 3 * 4 * 7)  # 7 values per slice with 3 deltas
    logic = make(robust="median")
    sessions = joined(logic, 3)
    params = init(logic, sessions[0])
    rng = np.random.default_rng(5)
    deltas = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in sessions]
    for sid, d in zip(sessions, deltas, strict=True):
        push(logic, sid, 0, d)
    median = {k: np.median(np.stack([d[k] for d in deltas]), axis=0) for k in params}
    expect(logic, sessions[0], {k: params[k] + median[k] for k in params}, 1)


def test_norm_clipping_scales_a_large_delta_down() -> None:
    logic = make("async", clip_norm=1.0)
    (a,) = joined(logic, 1)
    params = {"w": np.zeros(4, dtype=np.float32)}
    init(logic, a, params)
    push(logic, a, 0, {"w": np.array([3.0, 4.0, 0.0, 0.0], dtype=np.float32)})  # norm 5 -> 1
    expect(logic, a, {"w": np.array([0.6, 0.8, 0.0, 0.0], dtype=np.float32)}, 1)


def test_duplicate_push_is_not_applied_twice() -> None:
    logic = make("async")
    (a,) = joined(logic, 1)
    params = init(logic, a)
    chunks = push_chunks(a, 0, full(params, 1.0), push_id="same")
    logic.push_delta(iter(chunks))
    before = logic.model_hash()
    reply = logic.push_delta(iter(chunks))
    assert reply.accepted and reply.duplicate and "applied once" in reply.reason
    assert logic.version == 1 and logic.model_hash() == before


def test_heartbeat_says_whether_an_unanswered_push_is_held() -> None:
    """A site whose push got no reply asks about its id: not held, arriving (a stream of it is still being
    received), applied; a refused push is not held (its work must go out again)."""
    logic = make("async")
    (a,) = joined(logic, 1)
    params = init(logic, a)

    def asked(push_id: str) -> str:
        return logic.heartbeat(m.HeartbeatRequest(a, push_id=push_id)).push

    assert asked("p1") == "" and logic.heartbeat(m.HeartbeatRequest(a)).push == ""
    chunks = push_chunks(a, 0, full(params, 1.0), push_id="p1")
    arrived, go_on = threading.Event(), threading.Event()

    def slow() -> Iterator[m.Chunk]:
        yield chunks[0]
        arrived.set()
        go_on.wait(30)
        yield from chunks[1:]

    pushing = threading.Thread(target=lambda: logic.push_delta(slow()))
    pushing.start()
    assert arrived.wait(30)
    assert asked("p1") == "receiving"
    go_on.set()
    pushing.join(30)
    assert asked("p1") == "applied" and logic.version == 1
    with pytest.raises(ProtocolError):  # a tensor the model does not have: refused, not remembered
        push(logic, a, 1, {"nope": np.ones(3, np.float32)}, push_id="p2")
    assert asked("p2") == "" and logic.version == 1


def test_rejoin_token_is_one_time_and_enroll_token_checked() -> None:
    logic = make(enroll_token="s3cret")
    with pytest.raises(AuthError, match="enrollment"):
        logic.join(m.JoinRequest("osc", "wrong"))
    first = logic.join(m.JoinRequest("osc", "s3cret"))
    second = logic.join(m.JoinRequest("osc", first.rejoin_token, resume_session=first.session_id))
    # the same session (its handle), with a new secret: the credential of before acts no more
    assert handle_of(second.session_id) == handle_of(first.session_id) and second.session_id != first.session_id
    assert second.rejoin_token != first.rejoin_token
    assert logic.heartbeat(m.HeartbeatRequest(second.session_id)).version == 0
    with pytest.raises(AuthError, match="unknown session"):
        logic.heartbeat(m.HeartbeatRequest(first.session_id))
    with pytest.raises(AuthError, match="already used"):
        logic.join(m.JoinRequest("osc", first.rejoin_token, resume_session=first.session_id))


def test_second_init_is_refused_and_uninitialized_push_is_stale() -> None:
    logic = make()
    a, b = joined(logic, 2)
    with pytest.raises(StaleError, match="not initialized"):
        push(logic, a, 0, small_params())
    init(logic, a)
    reply = push(logic, b, 0, small_params(1), init=True, push_id="init-b")
    assert not reply.accepted and "already initialized" in reply.reason
    _, now = pull(logic, b)
    np.testing.assert_array_equal(now["wte.weight"], small_params()["wte.weight"])


def test_int8_delta_is_accepted() -> None:
    logic = make("async")
    (a,) = joined(logic, 1)
    params = init(logic, a)
    delta = {k: np.random.default_rng(1).normal(size=v.shape).astype(np.float32) * 1e-3 for k, v in params.items()}
    push(logic, a, 0, delta, cfg=CodecConfig(name="int8", block_size=64))
    expect(logic, a, {k: params[k] + delta[k] for k in params}, 1, atol=2e-5)


def test_status_reports_sites_and_ps() -> None:
    clock = Clock()
    logic = make("async", clock=clock)
    a, b = joined(logic, 2)
    params = init(logic, a)
    push(logic, a, 0, full(params, 1.0), tokens=64)
    clock.now += 5
    pull(logic, a)
    st = logic.status(m.StatusRequest())
    assert (st.version, st.initialized, st.aggregation, st.outer_optimizer, st.active_sites) == (
        1,
        True,
        "async",
        "plain",
        2,
    )
    rows = {s.site: s for s in st.sites}
    assert rows["site0"].pushes == 1 and rows["site0"].tokens == 64 and rows["site0"].last_push_s == 5.0
    assert rows["site0"].version == 1 and rows["site0"].bytes_received > 0 and rows["site0"].state == "active"
    assert rows["site1"].pushes == 0 and rows["site1"].last_push_s == -1.0


def test_a_push_waits_for_a_receive_slot_and_gives_up_busy_with_a_retry_hint() -> None:
    import threading

    from geofed_hpc.errors import LimitError

    logic = make("async", max_concurrent_pushes=1, stream_idle_timeout="1s")
    a, b = joined(logic, 2)
    params = init(logic, a)
    chunks = push_chunks(a, 0, small_params(seed=3), push_id="slow")
    release = threading.Event()

    def slow():
        yield chunks[0]
        release.wait(timeout=30)
        yield from chunks[1:]

    replies: list = []
    holder = threading.Thread(target=lambda: replies.append(logic.push_delta(slow())))
    holder.start()
    wait_for(lambda: logic._receiving.in_use == 1, 30, "the slow push to hold the receiving slot")
    with pytest.raises(LimitError, match="busy with other pushes") as busy:  # after ps.stream_idle_timeout
        push(logic, b, 0, full(params, 1.0))
    assert busy.value.retry_after is not None
    release.set()
    holder.join(timeout=30)
    assert replies[0].accepted and logic.version == 1
    assert push(logic, b, 1, full(params, 1.0)).accepted  # the slot is free again


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"aggregation": "async", "robust": "median"}, "ps.robust: median needs several deltas"),
        ({"robust": "trimmed_mean", "weighting": "tokens"}, "ps.weighting: robust rule trimmed_mean is unweighted"),
        ({"outer_optimizer": "adam"}, "ps.outer_optimizer: must be one of plain, nesterov, fednova"),
        ({"momentum": 1.0}, "ps.momentum: must be in [0, 1)"),
        ({"trim_fraction": 0.5}, "ps.trim_fraction"),
        ({"buffer_size": 0}, "ps.buffer_size: must be at least 1"),
        ({"stream_window_bytes": 1000}, "ps.stream_window_bytes"),
        ({"downlink_codec": "int3"}, "ps.downlink_codec"),
        ({"shutdown_grace": "soon"}, "ps.shutdown_grace: expected a duration"),
    ],
)
def test_ps_config_errors_name_the_field(overrides: dict, message: str) -> None:
    from geofed_hpc.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        ps_config(**overrides)
