"""Deferred work after an unanswered push: its checkpoint round trip, and the arithmetic that lets the work
trained after a confirmed attempt go out on its own without losing what either codec pass dropped."""

from __future__ import annotations

import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.client.deferred import Deferred
from geofed_hpc.config import CodecConfig
from geofed_hpc.errors import CheckpointError
from geofed_hpc.rpc import messages as m

INT8 = CodecConfig(name="int8", block_size=64)


def header(push_id: str, steps: int) -> m.PushHeader:
    return m.PushHeader("s", 3, steps, steps * 10, "int8", 0, b"", push_id, train_loss=2.5)


def test_deferred_work_survives_a_checkpoint_with_its_attempt_bytes_and_confirmed_payloads() -> None:
    held = Deferred()
    assert held.to_meta() is None and held.tensors() == {}
    assert held.record(4, 8.0, (header("a", 4), b"first"))
    held.confirm()
    assert not held.record(9, 18.0, (header("b", 5), b"second"))
    meta, tensors = held.to_meta(), held.tensors()
    assert meta is not None and "payload" not in meta and "applied" not in meta
    back = Deferred.from_checkpoint(meta, tensors)
    assert (back.steps, back.intervals, back.applied_steps) == (9, 2, 4)
    assert back.attempt is not None and back.payload == b"second"
    assert (back.attempt["push_id"], back.attempt["local_steps"], back.attempt["tokens"]) == ("b", 5, 50)
    assert back.applied == [b"first"]
    with pytest.raises(CheckpointError, match="deferred/applied/0"):
        Deferred.from_checkpoint(meta, {"deferred/attempt": tensors["deferred/attempt"]})
    # an attempt whose bytes are gone is not asked about: the work goes out whole
    assert Deferred.from_checkpoint(meta, {"deferred/applied/0": tensors["deferred/applied/0"]}).attempt is None
    back.clear()
    assert not back.active and back.attempt is None and back.applied == [] and back.applied_steps == 0


def test_work_after_a_confirmed_attempt_plus_both_residuals_adds_up_to_all_the_work() -> None:
    """The site's old residual r0, an unanswered attempt U of d1 (the PS applied it), then d1 + d2 in total:
    the rest it pushes is (d1 + d2) - decode(U), with r0 added on encoding. What the PS received plus the new
    residual is exactly d1 + d2 + r0: nothing the codec dropped is lost, nothing counted twice."""
    rng = np.random.default_rng(3)
    r0 = {"w": rng.normal(0, 1e-3, 256).astype(np.float32)}
    d1 = {"w": rng.normal(0, 1e-2, 256).astype(np.float32)}
    d2 = {"w": rng.normal(0, 1e-2, 256).astype(np.float32)}
    fb = codec.ErrorFeedback()
    fb.commit({k: v.copy() for k, v in r0.items()})
    unanswered, _ = fb.encode({k: v.copy() for k, v in d1.items()}, INT8)  # never committed: no reply came
    applied = codec.decode(unanswered)["w"]
    rest = {"w": d1["w"] + d2["w"] - applied}
    payload, residual = fb.encode(rest, INT8)
    fb.commit(residual)
    total = applied + codec.decode(payload)["w"] + fb.residual["w"]
    np.testing.assert_allclose(total, d1["w"] + d2["w"] + r0["w"], rtol=0, atol=1e-7)


def test_keep_pushes_nothing_and_carries_the_remainder_on_the_residual() -> None:
    fb = codec.ErrorFeedback()
    fb.commit({"w": np.full(4, 0.5, np.float32)})
    fb.keep({"w": np.array([1.0, -0.5, 0.0, 2.0], np.float32), "b": np.zeros(2, np.float32)})
    assert set(fb.residual) == {"w"}  # an all-zero remainder is not kept
    np.testing.assert_array_equal(fb.residual["w"], [1.5, 0.0, 0.5, 2.5])
