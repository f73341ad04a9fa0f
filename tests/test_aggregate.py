"""Aggregation math: mean folding, staleness discount, updates, round completion."""

import numpy as np
import pytest

from geofed_hpc.ps.aggregate import MeanAccumulator, apply_update, round_complete, staleness_discount


def test_mean_accumulator_equals_weighted_mean() -> None:
    rng = np.random.default_rng(0)
    deltas = [
        {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)} for _ in range(5)
    ]
    weights = [1.0, 2.0, 0.5, 1.0, 3.0]
    acc = MeanAccumulator()
    for d, w in zip(deltas, weights, strict=True):
        acc.fold(d, w)
    mean = acc.mean()
    for key in ("w", "b"):
        expected = sum(w * d[key] for d, w in zip(deltas, weights, strict=True)) / sum(weights)
        np.testing.assert_allclose(mean[key], expected, rtol=1e-5, atol=1e-6)
    assert acc.count == 5


def test_accumulator_does_not_alias_the_first_delta() -> None:
    d = {"w": np.ones(3, dtype=np.float32)}
    acc = MeanAccumulator()
    acc.fold(d)
    acc.fold({"w": np.ones(3, dtype=np.float32)})
    np.testing.assert_array_equal(d["w"], np.ones(3))


def test_accumulator_rejects_mismatched_names_and_bad_weight() -> None:
    acc = MeanAccumulator()
    acc.fold({"a": np.zeros(2, dtype=np.float32)})
    with pytest.raises(ValueError, match="names"):
        acc.fold({"b": np.zeros(2, dtype=np.float32)})
    with pytest.raises(ValueError, match="weight"):
        acc.fold({"a": np.zeros(2, dtype=np.float32)}, 0.0)
    acc.reset()
    with pytest.raises(ValueError, match="no delta"):
        acc.mean()


def test_staleness_discount_decreases() -> None:
    assert staleness_discount(0) == 1.0
    assert staleness_discount(3) == pytest.approx(0.5)
    assert staleness_discount(1) > staleness_discount(2) > staleness_discount(8)
    with pytest.raises(ValueError):
        staleness_discount(-1)


def test_apply_update_scales_by_lr_and_checks_shapes() -> None:
    params = {"w": np.ones((2, 2), dtype=np.float32)}
    apply_update(params, {"w": np.full((2, 2), 2.0, dtype=np.float32)}, 0.5)
    np.testing.assert_array_equal(params["w"], np.full((2, 2), 2.0))
    with pytest.raises(ValueError, match="shape"):
        apply_update(params, {"w": np.zeros(4, dtype=np.float32)}, 1.0)


def test_round_complete_rules() -> None:
    assert not round_complete(set(), {"a"}, now=100.0, deadline=1.0)
    assert round_complete({"a", "b"}, {"a", "b"}, now=0.0, deadline=None)
    assert not round_complete({"a"}, {"a", "b"}, now=0.0, deadline=10.0)
    assert round_complete({"a"}, {"a", "b"}, now=10.0, deadline=10.0)
    assert round_complete({"a"}, set(), now=0.0, deadline=10.0)
