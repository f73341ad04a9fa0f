"""The downlink: sites holding a recent version get the encoded updates and stay bit-identical to the PS."""

from __future__ import annotations

import numpy as np

from geofed_hpc import codec
from geofed_hpc.client.replica import apply_updates
from geofed_hpc.config import CodecConfig
from geofed_hpc.ps.servicer import ParameterServerLogic
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.stream import collect
from tests.conftest import small_params
from tests.test_ps_logic import init, joined, make, push

INT8 = CodecConfig(name="int8", block_size=64)


def fetch(logic: ParameterServerLogic, session: str, have: int | None) -> tuple[m.ModelHeader, bytes]:
    request = m.ModelRequest(session, 0, 0.0, have_version=have or 0, want_updates=have is not None)
    header, payload = collect(logic.stream_model(request), 1 << 30)
    assert isinstance(header, m.ModelHeader)
    return header, payload


def global_model(logic: ParameterServerLogic) -> dict[str, np.ndarray]:
    assert logic.core.model.params is not None
    return {k: v.copy() for k, v in logic.core.model.params.items()}


def random_delta(params: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_t(4, size=v.shape) * 1e-3).astype(np.float32) for k, v in params.items()}


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == np.float32
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs"


def test_update_chain_keeps_a_replica_bit_identical() -> None:
    logic = make("async", run_codec="int8", global_lr=0.7)
    a, b = joined(logic, 2)
    params = init(logic, a)
    header, payload = fetch(logic, b, None)
    assert header.kind == "full" and header.version == 0
    replica = codec.decode(payload)
    for i in range(6):
        push(logic, a, i, random_delta(params, i), cfg=INT8, push_id=f"d{i}")
        if i % 2 == 1:  # the replica catches up every other version: chains of length 2
            header, payload = fetch(logic, b, header.version)
            assert header.kind == "updates" and header.codec == "int8" and len(header.segments) == 2
            replica = apply_updates(replica, header, payload)
            assert header.version == logic.version
            assert_bit_identical(replica, global_model(logic))
    assert max(header.segments) < sum(v.nbytes for v in params.values()) / 3  # int8 updates: far below fp32


def test_error_feedback_keeps_the_quantisation_error_from_adding_up() -> None:
    logic = make("async", run_codec="int8")
    (a,) = joined(logic, 1)
    params = init(logic, a)
    exact = {k: v.copy() for k, v in params.items()}
    for i in range(30):
        d = random_delta(params, 100 + i)
        push(logic, a, i, d, cfg=CodecConfig(name="fp32"), push_id=f"e{i}")
        for k in exact:
            exact[k] += d[k]
    residual = logic.core.model.downlink.residual
    got = global_model(logic)
    for k in exact:
        # what is missing from the global model is exactly what the PS still carries for the next update
        np.testing.assert_allclose(got[k] + residual[k], exact[k], rtol=2e-6, atol=1e-6)
        # and it is one quantisation step, not thirty: a fraction of one delta's range
        assert np.abs(residual[k]).max() < 0.02 * 30 * 1e-3


def test_full_model_when_updates_are_gone_newer_or_larger() -> None:
    logic = make("async", run_codec="int8", downlink_history=2)
    a, b = joined(logic, 2)
    params = init(logic, a)
    for i in range(3):
        push(logic, a, i, random_delta(params, i), cfg=INT8, push_id=f"f{i}")
    assert fetch(logic, b, 0)[0].kind == "full"  # 0 -> 1 is no longer kept
    header, payload = fetch(logic, b, 1)
    assert header.kind == "updates" and header.base_version == 1 and len(header.segments) == 2
    same = fetch(logic, b, 3)[0]
    assert same.kind == "updates" and same.segments == [] and same.total_bytes == 0
    future = fetch(logic, b, 7)[0]
    assert future.kind == "full" and future.version == 3
    lossless = make("async", run_codec="fp32", downlink_history=8)
    (c,) = joined(lossless, 1)
    noisy = {"w": np.zeros(4096, dtype=np.float32)}
    init(lossless, c, noisy)
    for i in range(3):
        push(lossless, c, i, random_delta(noisy, i), push_id=f"n{i}")
    # three incompressible fp32 updates outweigh one fp32 model: the model is sent instead
    assert fetch(lossless, c, 0)[0].kind == "full"
    assert fetch(lossless, c, 2)[0].kind == "updates"


def test_sync_rounds_serve_one_cached_chain_to_every_site() -> None:
    logic = make("sync", run_codec="int8")
    sessions = joined(logic, 3)
    params = init(logic, sessions[0])
    replicas = {s: codec.decode(fetch(logic, s, None)[1]) for s in sessions}
    for i, s in enumerate(sessions):
        push(logic, s, 0, random_delta(params, 10 + i), cfg=INT8)
    assert logic.version == 1
    for s in sessions:
        header, payload = fetch(logic, s, 0)
        replicas[s] = apply_updates(replicas[s], header, payload)
        assert_bit_identical(replicas[s], global_model(logic))
    assert logic.core.model.cached_chains() == [0]  # encoded once per version, hashed once, served to all
    assert small_params().keys() == replicas[sessions[0]].keys()
