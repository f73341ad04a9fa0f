"""Sparse deltas at the PS: scatter-added, never densified for mean rules; error feedback on both ends accounts for
every delta exactly once with each outer optimizer, across a resend, a requeue and a PS restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.client.replica import apply_updates
from geofed_hpc.codec import SparseTensor
from geofed_hpc.config import CodecConfig
from geofed_hpc.ps.aggregate import OuterOptimizer
from geofed_hpc.ps.servicer import ParameterServerLogic
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.stream import digest, to_chunks
from tests.conftest import ps_config
from tests.test_ps_downlink import assert_bit_identical, fetch, global_model
from tests.test_ps_logic import Clock, init, joined

# every tensor sparse; 16 of every 64 values kept, so wte.weight (500 x 8) sends a mean row too
SPARSE = CodecConfig(name="sparse", chunk=64, density=1 / 4, block_size=64, dense_below=0)


def make(aggregation: str = "sync", run: CodecConfig = SPARSE, **kw: Any) -> ParameterServerLogic:
    settings = m.RunSettings(aggregation=aggregation, codec=run.name, block_size=64)
    return ParameterServerLogic(ps_config(aggregation=aggregation, **kw), settings, clock=Clock(), codec=run)


def send(logic: ParameterServerLogic, session: str, base: int, payload: bytes, push_id: str, **kw: Any) -> m.PushReply:
    fields = {"local_steps": 3, "tokens": 30, **kw}
    sha, size = digest(payload), len(payload)
    header = m.PushHeader(session, base, codec="sparse", total_bytes=size, sha256=sha, push_id=push_id, **fields)
    return logic.push_delta(iter(to_chunks(header, payload, 4096)))


def deltas(params: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_t(4, size=v.shape) * 1e-2 + 3e-3).astype(np.float32) for k, v in params.items()}


def test_sparse_deltas_are_scatter_added_and_never_densified(monkeypatch: pytest.MonkeyPatch) -> None:
    logic = make(downlink_codec="fp32")
    sessions = joined(logic, 3)
    params = init(logic, sessions[0])
    payloads = [codec.encode(deltas(params, i), SPARSE) for i in range(3)]

    def never(self: SparseTensor) -> np.ndarray:
        raise AssertionError("a sparse delta was densified")

    monkeypatch.setattr(SparseTensor, "dense", never)
    for i, (s, p) in enumerate(zip(sessions, payloads, strict=True)):
        assert send(logic, s, 0, p, f"s{i}").accepted
    assert logic.version == 1
    decoded = [codec.decode(p) for p in payloads]
    for k, v in params.items():
        total = np.zeros_like(v)
        for d in decoded:
            total += d[k]
        total *= np.float32(1 / 3)
        np.testing.assert_array_equal(global_model(logic)[k], v + total)


def test_a_robust_rule_densifies_sparse_deltas_one_at_a_time_into_its_spool() -> None:
    logic = make(robust="trimmed_mean", trim_fraction=0.34, downlink_codec="fp32")
    sessions = joined(logic, 3)
    params = init(logic, sessions[0])
    payloads = [codec.encode(deltas(params, 10 + i), SPARSE) for i in range(3)]
    for i, (s, p) in enumerate(zip(sessions, payloads, strict=True)):
        assert send(logic, s, 0, p, f"r{i}").accepted
    decoded = [codec.decode(p) for p in payloads]
    for k, v in params.items():  # 3 deltas, one trimmed at each end: the coordinate median
        median = np.median(np.stack([d[k] for d in decoded]), axis=0).astype(np.float32)
        np.testing.assert_allclose(global_model(logic)[k], v + median, rtol=0, atol=1e-7)


def test_a_sparse_downlink_keeps_replicas_bit_identical_and_the_model_is_the_sum_of_what_was_published() -> None:
    logic = make("async", downlink_density=1 / 8, global_lr=0.7)
    a, b = joined(logic, 2)
    params = init(logic, a)
    header, payload = fetch(logic, b, None)
    replica = codec.decode(payload)
    replayed = {k: v.copy() for k, v in replica.items()}
    for i in range(6):
        assert send(logic, a, i, codec.encode(deltas(params, 20 + i), SPARSE), f"d{i}").accepted
        header, payload = fetch(logic, b, header.version)
        assert header.kind == "updates" and header.codec == "sparse"
        replica = apply_updates(replica, header, payload)
        assert_bit_identical(replica, global_model(logic))
    for v in logic.core.model.downlink.versions():  # adding every published update rebuilds the model bit for bit
        data = logic.core.model.downlink.chain(v, v + 1, 1 << 30)
        assert data is not None
        for k, u in codec.decode(data[0]).items():
            replayed[k] += u
    assert_bit_identical(replayed, global_model(logic))
    assert len(payload) < sum(v.nbytes for v in params.values()) / 8  # far below the fp32 model (framing included)


class Site:
    """A site's side of error feedback: its residual, and the sums of what it trained and what it sent."""

    def __init__(self, session: str, steps: int, tokens: int) -> None:
        self.session, self.steps, self.tokens = session, steps, tokens
        self.ef = codec.ErrorFeedback()
        self.trained: dict[str, np.ndarray] = {}
        self.sent: dict[str, np.ndarray] = {}

    def train(self, delta: dict[str, np.ndarray]) -> None:
        for k, v in delta.items():
            self.trained[k] = self.trained.get(k, 0) + v.astype(np.float64)

    def encode(self, delta: dict[str, np.ndarray]) -> tuple[bytes, dict[str, np.ndarray]]:
        return self.ef.encode({k: v.copy() for k, v in delta.items()}, SPARSE)

    def accepted(self, payload: bytes, residual: dict[str, np.ndarray]) -> None:
        self.ef.commit(residual)
        for k, v in codec.decode(payload).items():
            self.sent[k] = self.sent.get(k, 0) + v.astype(np.float64)


def aggregate(decoded: list[dict[str, np.ndarray]], sites: list[Site], outer: str, tokens: bool) -> dict:
    """The round's aggregated delta as ps/rounds.py defines it (staleness 0 in sync rounds)."""
    weights = [float(s.tokens) if tokens else 1.0 for s in sites]
    norm = [float(s.steps) if outer == "fednova" else 1.0 for s in sites]
    out = {}
    for k in decoded[0]:
        out[k] = sum(w * d[k].astype(np.float64) / n for w, d, n in zip(weights, decoded, norm, strict=True))
        out[k] /= sum(weights)
        if outer == "fednova":
            out[k] *= sum(w * s.steps for w, s in zip(weights, sites, strict=True)) / sum(weights)
    return out


@pytest.mark.parametrize(
    "outer, weighting", [("plain", "uniform"), ("nesterov", "uniform"), ("fednova", "uniform"), ("plain", "tokens")]
)
def test_error_feedback_with_the_outer_optimizer_loses_nothing_and_counts_nothing_twice(
    tmp_path: Path, outer: str, weighting: str
) -> None:
    kw = {"state_dir": str(tmp_path), "outer_optimizer": outer, "weighting": weighting, "global_lr": 0.8}
    kw |= {"downlink_density": 1 / 8, "momentum": 0.5}
    logic = make(**kw)
    a, b = joined(logic, 2)
    params = init(logic, a)
    theta0 = {k: v.astype(np.float64) for k, v in params.items()}
    sites = [Site(a, 3, 30), Site(b, 5, 70)]
    shadow = OuterOptimizer(outer, 0.8, 0.5)
    applied = {k: np.zeros_like(v) for k, v in theta0.items()}  # the sum of the outer optimizer's updates
    for r in range(8):
        decoded = []
        for i, site in enumerate(sites):
            delta = deltas(params, 100 * r + i)
            site.train(delta)
            checkpoint = site.ef.state()  # the site's checkpoint before this push
            payload, residual = site.encode(delta)
            push_id, steps, tokens = f"r{r}-{i}", site.steps, site.tokens
            reply = send(logic, site.session, r, payload, push_id, local_steps=steps, tokens=tokens)
            assert reply.accepted and not reply.duplicate
            if r == 2 and i == 0:  # the reply was lost: the client resends the same bytes under the same push id
                assert send(logic, site.session, r, payload, push_id, local_steps=steps, tokens=tokens).duplicate
            if r == 5 and i == 1:  # killed after the push went in, before its checkpoint: the requeued job loads
                site.ef = codec.ErrorFeedback()  # the older checkpoint and encodes the same work again
                site.ef.load(checkpoint)
                payload, residual = site.encode(delta)
                assert send(logic, site.session, r, payload, push_id, local_steps=steps, tokens=tokens).duplicate
            if r == 4 and i == 0:  # the PS is killed with the round open: the restart replays it from its journal
                logic = make(**kw)
            site.accepted(payload, residual)
            decoded.append(codec.decode(payload))
        if r == 3:  # site b is requeued between syncs: its residual comes back from its checkpoint's tensors
            state = sites[1].ef.state()
            sites[1].ef = codec.ErrorFeedback()
            sites[1].ef.load(state)
        assert logic.version == r + 1
        d = aggregate(decoded, sites, outer, weighting == "tokens")
        for k, u in shadow.step({k: v.astype(np.float32) for k, v in d.items()}).items():
            applied[k] += u
    got = global_model(logic)
    waiting = logic.core.model.downlink.residual  # what the downlink has yet to publish
    for k in theta0:
        # the PS: the global model plus what it still holds back is the start plus every update, once
        np.testing.assert_allclose(got[k] + waiting[k] - theta0[k], applied[k], rtol=0, atol=2e-5)
    for site in sites:  # each site: what it sent plus what it still holds back is what it trained, once
        for k in theta0:
            np.testing.assert_allclose(site.sent[k] + site.ef.residual.get(k, 0), site.trained[k], rtol=0, atol=1e-5)
