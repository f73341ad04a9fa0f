"""Aggregation strategies without gRPC or a PS: when a round closes, staleness, weights, restoring, sync now."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geofed_hpc.errors import ConfigError, ProtocolError, StaleError
from geofed_hpc.ps.aggregate import staleness_discount
from geofed_hpc.ps.staging import Staging
from geofed_hpc.ps.strategy import STRATEGIES, AsyncUpdates, BufferedUpdates, Strategy, SyncRounds, strategy_for
from geofed_hpc.rpc import messages as m
from tests.conftest import ps_config

SPEC = {"w": (4,)}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(tmp_path: Path, aggregation: str, clock: Clock | None = None, **kw: Any) -> Strategy:
    strategy = strategy_for(ps_config(aggregation=aggregation, **kw), Staging(tmp_path / "staging"), clock or Clock())
    strategy.reset(SPEC)
    return strategy


def admit(s: Strategy, session: str, value: float, base: int = 0, version: int = 0, tokens: int = 10) -> int:
    prepared = s.prepare({"w": np.full(4, value, np.float32)}, session, 1, tokens)
    return s.admit(prepared, base, version)


def header(base: int, steps: int = 1, tokens: int = 1) -> m.PushHeader:
    return m.PushHeader("s", base, steps, tokens, "fp32", 0, b"", "p")


def test_the_factory_picks_one_class_per_mode_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    assert {k: type(make(tmp_path, k)) for k in STRATEGIES} == {
        "sync": SyncRounds,
        "async": AsyncUpdates,
        "buffered": BufferedUpdates,
    }
    cfg = ps_config()
    cfg.aggregation = "gossip"  # past validation: the factory still refuses it
    with pytest.raises(ConfigError, match="ps.aggregation"):
        strategy_for(cfg, Staging(tmp_path), Clock())


def test_sync_with_min_sites_waits_for_that_many_pushes_or_the_deadline(tmp_path: Path) -> None:
    clock = Clock()
    s = make(tmp_path, "sync", clock, round_timeout="10s", min_sites=2)
    admit(s, "a", 1.0)
    assert not s.ready({"a"})  # a alone is every active site, but the round waits for a second one to join
    clock.now += 9.9
    assert not s.ready({"a"})
    admit(s, "b", 3.0)
    assert s.ready({"a", "b"})  # two pushed: every active site and enough
    assert not s.ready({"a", "b", "c"})  # c joined meanwhile: it is waited for as in any round
    clock.now += 0.1
    assert s.ready({"a", "b", "c"})
    s.close()
    admit(s, "a", 1.0)
    clock.now += 10
    assert s.ready({"a", "b"})  # the deadline closes a round of one, as without min_sites


def test_sync_closes_when_every_active_session_pushed_or_at_the_deadline(tmp_path: Path) -> None:
    clock = Clock()
    s = make(tmp_path, "sync", clock, round_timeout="10s")
    assert not s.ready({"a", "b"})  # nothing pushed: never ready, whatever the time
    clock.now += 100
    assert not s.ready({"a", "b"})
    admit(s, "a", 1.0)
    assert not s.ready({"a", "b"})
    assert s.ready({"a"})  # b went idle: a alone is everyone
    clock.now += 9.9
    assert not s.ready({"a", "b"})
    clock.now += 0.1
    assert s.ready({"a", "b"})  # the deadline passed: close without the straggler
    admit(s, "b", 3.0)
    delta, count = s.close()
    assert count == 2 and s.count == 0
    np.testing.assert_allclose(delta["w"], 2.0)


def test_sync_tells_a_site_the_round_waits_for_to_sync_now(tmp_path: Path) -> None:
    s = make(tmp_path, "sync")
    assert not s.sync_now("a") and not s.sync_now("b")  # no round open: nobody is late
    admit(s, "a", 1.0)
    assert s.sync_now("b") and not s.sync_now("a")
    s.close()
    assert not s.sync_now("b")


@pytest.mark.parametrize("aggregation", ["async", "buffered"])
def test_only_sync_says_sync_now(tmp_path: Path, aggregation: str) -> None:
    s = make(tmp_path, aggregation)
    admit(s, "a", 1.0)
    assert not s.sync_now("b")


def test_async_is_ready_with_any_delta(tmp_path: Path) -> None:
    s = make(tmp_path, "async")
    assert not s.ready(set())
    admit(s, "a", 1.0)
    assert s.ready({"a", "b", "c"})


def test_buffered_closes_after_k_deltas_or_at_the_deadline(tmp_path: Path) -> None:
    clock = Clock()
    s = make(tmp_path, "buffered", clock, buffer_size=3, round_timeout="10s")
    admit(s, "a", 1.0)
    admit(s, "a", 2.0)  # the same site twice counts twice
    assert not s.ready({"a"})
    admit(s, "b", 6.0)
    assert s.ready({"a", "b"})
    s.close()
    admit(s, "a", 1.0)
    clock.now += 10
    assert s.ready({"a", "b"})


@pytest.mark.parametrize(("aggregation", "robust"), [("sync", "none"), ("buffered", "median"), ("async", "none")])
def test_a_taken_round_is_put_back_whole_when_its_update_cannot_be_made(
    tmp_path: Path, aggregation: str, robust: str
) -> None:
    s = make(tmp_path, aggregation, robust=robust)
    for session, value in [("a", 1.0), ("b", 3.0), ("c", 8.0)][: 1 if aggregation == "async" else 3]:
        admit(s, session, value)
    count = s.count
    totals = s.take()
    assert s.count == 0 and totals.count == count
    first = s.aggregate(totals)
    s.restore(totals)  # the update was not made (a full disk): the round is open again, nothing consumed
    assert s.count == count
    totals = s.take()
    np.testing.assert_array_equal(s.aggregate(totals)["w"], first["w"])
    s.release(totals)
    assert not list((tmp_path / "staging").iterdir())  # the spooled deltas go once the round is done


def test_async_token_weights_survive_a_snapshot(tmp_path: Path) -> None:
    s = make(tmp_path, "async", weighting="tokens")
    for tokens in (150, 300, 600):
        s.scale(0, tokens)
    again = make(tmp_path, "async", weighting="tokens")
    again.load_state(s.state())
    assert again.scale(0, 300) == s.scale(0, 300)  # a replayed journal weighs its deltas as they were weighed
    assert make(tmp_path, "sync").state() == {}


def test_staleness_is_refused_beyond_the_limit_and_from_the_future(tmp_path: Path) -> None:
    s = make(tmp_path, "async", max_staleness=2)
    assert s.check(header(3), 5) == 2
    with pytest.raises(StaleError, match="3 versions stale"):
        s.check(header(2), 5)
    with pytest.raises(StaleError, match="newer than the global version 5"):
        s.check(header(6), 5)
    with pytest.raises(StaleError):  # the model moved on while the delta was prepared: nothing is folded
        admit(s, "a", 1.0, base=0, version=3)
    assert s.count == 0
    robust = make(tmp_path, "buffered", robust="median", max_staleness=2)
    with pytest.raises(StaleError):  # and a spooled one is removed
        admit(robust, "a", 1.0, base=0, version=3)
    assert robust.count == 0 and not list((tmp_path / "staging").iterdir())


def test_a_header_must_carry_what_its_weighting_needs(tmp_path: Path) -> None:
    with pytest.raises(ProtocolError, match="tokens must be >= 1"):
        make(tmp_path, "sync", weighting="tokens").check(header(0, tokens=0), 0)
    with pytest.raises(ProtocolError, match="local_steps must be >= 1"):
        make(tmp_path, "sync", outer_optimizer="fednova").check(header(0, steps=0), 0)
    assert make(tmp_path, "sync").check(header(0, steps=0, tokens=0), 0) == 0


def test_sync_and_buffered_discount_stale_deltas_and_weight_by_tokens(tmp_path: Path) -> None:
    s = make(tmp_path, "buffered", weighting="tokens", max_staleness=8)
    assert s.weight(30) == 30.0 and s.scale(3, 30) == pytest.approx(staleness_discount(3))
    admit(s, "a", 1.0, base=0, version=0, tokens=10)  # fresh: 10 * 1
    admit(s, "b", 1.0, base=0, version=3, tokens=30)  # 3 stale: 30 * 1/2
    delta, _ = s.close()
    np.testing.assert_allclose(delta["w"], (10 * 1.0 + 30 * 0.5) / 40, rtol=1e-6)
    uniform = make(tmp_path, "sync")
    assert uniform.weight(30) == 1.0


def test_async_token_weighting_is_relative_to_recent_deltas(tmp_path: Path) -> None:
    s = make(tmp_path, "async", weighting="tokens", max_staleness=8)
    assert s.scale(0, 100) == pytest.approx(1.0)  # alone in the window
    assert s.scale(0, 300) == pytest.approx(1.5)  # 300 / mean(100, 300)
    assert s.scale(3, 200) == pytest.approx(1.0 * staleness_discount(3))  # 200 / mean(100, 300, 200)
    plain = make(tmp_path, "async", max_staleness=8)
    assert plain.scale(3, 1000) == pytest.approx(staleness_discount(3))  # uniform: tokens do not count
    admit(s, "a", 2.0, tokens=400)  # 400 / mean(100, 300, 200, 400) = 1.6; a round of one: the weight cancels
    delta, count = s.close()
    assert count == 1
    np.testing.assert_allclose(delta["w"], 2.0 * 1.6, rtol=1e-6)


def test_the_round_totals_are_there_before_the_mean(tmp_path: Path) -> None:
    """What a peer group would all-reduce: the weighted sum, the summed weights and the count of a round."""
    s = make(tmp_path, "sync", weighting="tokens")
    admit(s, "a", 1.0, tokens=10)
    admit(s, "b", 3.0, tokens=30)
    totals = s.take()
    assert totals.count == 2 and s.count == 0 and totals.folded is not None and not totals.spooled
    assert totals.folded.weight == 40.0 and totals.folded.count == 2
    np.testing.assert_allclose(totals.folded.total["w"], 10 * 1.0 + 30 * 3.0)
    np.testing.assert_allclose(s.aggregate(totals)["w"], 100.0 / 40)


def test_a_robust_round_spools_to_staging_and_reset_drops_it(tmp_path: Path) -> None:
    s = make(tmp_path, "sync", robust="median")
    for i, value in enumerate((1.0, 5.0, 1000.0)):
        admit(s, f"s{i}", value)
    assert len(list((tmp_path / "staging").iterdir())) == 3
    totals = s.take()
    assert totals.folded is None and len(totals.spooled) == 3
    np.testing.assert_allclose(s.aggregate(totals)["w"], 5.0)
    assert len(list((tmp_path / "staging").iterdir())) == 3  # kept until the update is made (or refused)
    s.release(totals)
    assert not list((tmp_path / "staging").iterdir())
    admit(s, "a", 1.0)
    s.reset(SPEC)
    assert s.count == 0 and not s.sync_now("b") and not list((tmp_path / "staging").iterdir())
