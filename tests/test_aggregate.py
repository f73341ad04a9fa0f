"""Aggregation math against hand-computed results: folding, robust rules, clipping, outer optimizers, rounds."""

import numpy as np
import pytest

from geofed_hpc.ps.aggregate import (
    MeanAccumulator,
    OuterOptimizer,
    RelativeWork,
    WeightedSum,
    add_update,
    buffer_full,
    clip_scale,
    coordinate_median,
    global_norm,
    robust_rule,
    round_complete,
    staleness_discount,
    trimmed_mean,
)


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_mean_accumulator_equals_weighted_mean() -> None:
    rng = np.random.default_rng(0)
    deltas = [
        {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)} for _ in range(5)
    ]
    weights = [1.0, 2.0, 0.5, 1.0, 3.0]
    acc = MeanAccumulator()
    for d, w in zip(deltas, weights, strict=True):
        acc.fold(d, w)
    assert acc.count == 5
    mean, _ = acc.take_mean()
    for key in ("w", "b"):
        expected = sum(w * d[key] for d, w in zip(deltas, weights, strict=True)) / sum(weights)
        np.testing.assert_allclose(mean[key], expected, rtol=1e-5, atol=1e-6)
    assert acc.count == 0


def test_scale_is_not_normalised_away_and_fednova_factor() -> None:
    # weights 1 and 3, scales 1 and 0.5, steps 2 and 6: mean = (1*1*[4] + 3*0.5*[8]) / 4 = [4]
    acc = MeanAccumulator()
    acc.fold({"x": f32(4.0)}, weight=1.0, scale=1.0, steps=2)
    acc.fold({"x": f32(8.0)}, weight=3.0, scale=0.5, steps=6)
    mean, tau_eff = acc.take_mean()
    np.testing.assert_array_equal(mean["x"], f32(4.0))
    assert tau_eff == pytest.approx((1 * 2 + 3 * 6) / 4)


def test_weighted_sum_is_handed_over_before_the_mean_and_parts_add_up() -> None:
    """A round folded in two parts (as peers would) has the sum, weights and count of one fold of everything."""
    deltas = [f32(1.0, 2.0), f32(3.0, -1.0), f32(5.0, 0.0)]
    weights, steps = [1.0, 2.0, 3.0], [2, 4, 6]
    whole, left, right = MeanAccumulator(), MeanAccumulator(), MeanAccumulator()
    for i, (d, w, n) in enumerate(zip(deltas, weights, steps, strict=True)):
        whole.fold({"x": d}, w, steps=n)
        (left if i < 1 else right).fold({"x": d}, w, steps=n)
    a, b = left.take_sum(), right.take_sum()
    assert left.count == 0 and right.count == 0  # taking hands the sum over and starts afresh
    joined = WeightedSum({"x": a.total["x"] + b.total["x"]}, a.weight + b.weight, a.weighted_steps + b.weighted_steps,
                         a.count + b.count)  # fmt: skip
    expected = whole.take_sum()
    assert (joined.weight, joined.weighted_steps, joined.count) == (expected.weight, expected.weighted_steps, 3)
    np.testing.assert_allclose(joined.total["x"], expected.total["x"], rtol=1e-6)
    mean, tau_eff = joined.mean()
    np.testing.assert_allclose(mean["x"], sum(w * d for d, w in zip(deltas, weights, strict=True)) / 6, rtol=1e-6)
    assert tau_eff == pytest.approx((2 + 8 + 18) / 6)
    with pytest.raises(ValueError, match="no delta folded"):
        MeanAccumulator().take_sum()


def test_accumulator_does_not_alias_unless_consuming() -> None:
    d = {"w": np.ones(3, dtype=np.float32)}
    acc = MeanAccumulator()
    acc.fold(d, scale=2.0)
    acc.fold(d, scale=2.0)
    np.testing.assert_array_equal(d["w"], np.ones(3))
    owned = {"w": np.ones(3, dtype=np.float32)}
    acc.fold(owned, scale=4.0, consume=True)
    np.testing.assert_array_equal(acc.take_mean()[0]["w"], np.full(3, 8.0 / 3.0, dtype=np.float32))


def test_accumulator_rejects_mismatched_names_and_bad_weight() -> None:
    acc = MeanAccumulator()
    acc.fold({"a": np.zeros(2, dtype=np.float32)})
    with pytest.raises(ValueError, match="names"):
        acc.fold({"b": np.zeros(2, dtype=np.float32)})
    with pytest.raises(ValueError, match="weight"):
        acc.fold({"a": np.zeros(2, dtype=np.float32)}, 0.0)
    acc.reset()
    with pytest.raises(ValueError, match="no delta"):
        acc.take_mean()


def test_trimmed_mean_and_median_by_hand() -> None:
    stack = np.array([[1, 10], [2, 20], [3, 30], [100, -1000], [4, 40]], dtype=np.float32)
    # f=0.2 drops one value at each end per column: col0 {2,3,4} -> 3; col1 {10,20,30} -> 20
    np.testing.assert_array_equal(trimmed_mean(stack, 0.2), f32(3.0, 20.0))
    np.testing.assert_array_equal(trimmed_mean(stack, 0.0), stack.mean(axis=0))
    np.testing.assert_array_equal(coordinate_median(stack), f32(3.0, 20.0))
    np.testing.assert_array_equal(coordinate_median(stack[:4]), f32(2.5, 15.0))
    # never trims everything: with 2 rows and f=0.49 nothing is dropped
    np.testing.assert_array_equal(trimmed_mean(stack[:2], 0.49), f32(1.5, 15.0))
    np.testing.assert_array_equal(robust_rule("median", stack, 0.1), coordinate_median(stack))
    with pytest.raises(ValueError, match="unknown robust rule"):
        robust_rule("mode", stack, 0.1)


def test_norm_clipping() -> None:
    d = {"a": f32(3.0), "b": f32(4.0)}
    assert global_norm(d) == pytest.approx(5.0)
    assert clip_scale(5.0, 0.0) == 1.0
    assert clip_scale(5.0, 10.0) == 1.0
    assert clip_scale(5.0, 2.5) == pytest.approx(0.5)


def test_plain_and_fednova_outer_steps_scale_by_lr() -> None:
    for kind in ("plain", "fednova"):
        opt = OuterOptimizer(kind, lr=0.5)
        np.testing.assert_array_equal(opt.step({"x": f32(2.0, -4.0)})["x"], f32(1.0, -2.0))
        assert opt.state() == {}


def test_nesterov_matches_hand_computation_and_torch_convention() -> None:
    opt = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    # step 1: m = 1; u = 0.7 * (1 + 0.9*1) = 1.33
    np.testing.assert_allclose(opt.step({"x": f32(1.0)})["x"], f32(1.33), rtol=1e-6)
    # step 2: m = 0.9*1 + 2 = 2.9; u = 0.7 * (2 + 0.9*2.9) = 3.227
    np.testing.assert_allclose(opt.step({"x": f32(2.0)})["x"], f32(3.227), rtol=1e-6)
    np.testing.assert_allclose(opt.state()["x"], f32(2.9), rtol=1e-6)
    # the same as torch.optim.SGD(nesterov=True) on the outer gradient -delta
    torch = pytest.importorskip("torch")
    p = torch.zeros(1, requires_grad=True)
    sgd = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    for d in (1.0, 2.0):
        p.grad = torch.tensor([-d])
        sgd.step()
    assert float(p.detach()) == pytest.approx(1.33 + 3.227, rel=1e-6)
    with pytest.raises(ValueError, match="outer optimizer"):
        OuterOptimizer("adam", 1.0)


def test_staleness_discount_decreases() -> None:
    assert staleness_discount(0) == 1.0
    assert staleness_discount(3) == pytest.approx(0.5)
    assert staleness_discount(1) > staleness_discount(2) > staleness_discount(8)
    with pytest.raises(ValueError):
        staleness_discount(-1)


def test_relative_work_weighs_tokens_against_the_recent_mean() -> None:
    work = RelativeWork(window=3)
    assert work.weight(100) == 1.0  # the first delta is its own mean
    assert work.weight(300) == pytest.approx(1.5)  # 300 / mean(100, 300)
    assert work.weight(200) == pytest.approx(1.0)  # 200 / mean(100, 300, 200)
    assert work.weight(100) == pytest.approx(0.5)  # the window dropped the first 100: 100 / mean(300, 200, 100)
    fresh = RelativeWork(window=3)
    one_round = [fresh.weight(t) for t in (150, 300, 600)]  # sites at speeds 1 : 2 : 4, one push each
    assert one_round == pytest.approx([1.0, 4 / 3, 1.714], abs=1e-3)  # the window fills as they arrive
    one_round = [fresh.weight(t) for t in (150, 300, 600)]  # the next round: every weight against mean 350
    assert sum(one_round) / 3 == pytest.approx(1.0) and one_round == pytest.approx([0.429, 0.857, 1.714], abs=1e-3)
    for bad in (0, -5):
        with pytest.raises(ValueError, match="tokens must be positive"):
            work.weight(bad)
    with pytest.raises(ValueError, match="window must be at least 1"):
        RelativeWork(window=0)


def test_add_update_adds_exactly_and_checks_shapes() -> None:
    params = {"w": np.full((2, 2), 2.0, dtype=np.float32)}
    add_update(params, {"w": np.full((2, 2), 0.25, dtype=np.float32)})
    np.testing.assert_array_equal(params["w"], np.full((2, 2), 2.25))
    with pytest.raises(ValueError, match="shape"):
        add_update(params, {"w": np.zeros(4, dtype=np.float32)})


def test_round_complete_and_buffer_full_rules() -> None:
    assert not round_complete(set(), {"a"}, now=100.0, deadline=1.0)
    assert round_complete({"a", "b"}, {"a", "b"}, now=0.0, deadline=None)
    assert not round_complete({"a"}, {"a", "b"}, now=0.0, deadline=10.0)
    assert round_complete({"a"}, {"a", "b"}, now=10.0, deadline=10.0)
    assert round_complete({"a"}, set(), now=0.0, deadline=10.0)
    assert not buffer_full(0, 2, now=100.0, deadline=1.0)
    assert not buffer_full(1, 2, now=0.0, deadline=10.0)
    assert buffer_full(2, 2, now=0.0, deadline=10.0)
    assert buffer_full(1, 2, now=10.0, deadline=10.0)
