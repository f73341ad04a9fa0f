"""bench/chaos.py's own logic, without its 3-minute run: the check that the PS's versions are continuous (a round
closed again after a full disk makes one version from several deltas), the record of which version each delta
made, and the fault plan (every kind in every run, reproducible by seed)."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from geofed_hpc import faults
from tests.test_ps_logic import Clock, full, init, joined, make, push

ROOT = Path(__file__).resolve().parent.parent


def load_bench() -> Any:
    if "chaos_bench" in sys.modules:
        return sys.modules["chaos_bench"]
    spec = importlib.util.spec_from_file_location("chaos_bench", ROOT / "bench" / "chaos.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["chaos_bench"] = bench  # dataclasses look their module up while the file runs
    spec.loader.exec_module(bench)
    return bench


@pytest.fixture
def no_faults() -> Any:
    yield
    faults.install("")


# ---------------------------------------------------------------- continuity


def test_a_retried_round_of_two_deltas_making_one_version_is_continuous() -> None:
    rows = [("local-0", "a1", 1), ("local-1", "b1", 2), ("local-2", "c1", 2), ("local-0", "a2", 3)]
    check = load_bench().continuity(rows, 3)
    assert check.continuous and check.doubled == 0 and check.unmade == [] and check.strays == []
    assert check.shared == 1  # version 2, of two deltas


def test_a_gap_in_the_versions_is_not_continuous() -> None:
    rows = [("local-0", "a1", 1), ("local-1", "b1", 2), ("local-2", "c1", 4)]
    check = load_bench().continuity(rows, 4)
    assert not check.continuous and check.unmade == [3] and check.doubled == 0


def test_a_version_made_by_no_delta_is_not_continuous() -> None:
    rows = [("local-0", "a1", 1), ("local-1", "b1", 2), ("local-2", "c1", 2)]
    check = load_bench().continuity(rows, 3)  # the PS is at 3: no applied delta made it
    assert not check.continuous and check.unmade == [3]
    check = load_bench().continuity([("local-0", "a1", 0), ("local-0", "a2", 1)], 1)  # 0 is the seed, not a round
    assert not check.continuous and check.strays == [0]


def test_a_push_id_applied_twice_is_counted_as_doubled() -> None:
    rows = [("local-0", "a1", 1), ("local-1", "b1", 2), ("local-1", "b1", 3), ("local-1", "b1", 4)]
    check = load_bench().continuity(rows, 4)
    assert not check.continuous and check.doubled == 2 and check.unmade == []


def test_no_delta_at_version_zero_is_continuous() -> None:
    assert load_bench().continuity([], 0).continuous


# ---------------------------------------------------------------- the record of applied deltas


def test_deltas_of_a_round_closed_again_after_a_full_disk_are_recorded_with_the_version_it_made(
    tmp_path: Path, no_faults: Any
) -> None:
    bench, clock = load_bench(), Clock()
    logic = make("async", clock, state_dir=str(tmp_path))
    applied = bench.AppliedLog(SimpleNamespace(logic=logic))
    a, b = joined(logic, 2)
    params = init(logic, a)
    assert push(logic, a, 0, full(params, 1.0), push_id="A").version == 1
    faults.install("atomic.write[update-]@1=enospc")  # B's round cannot be written: it stays open
    assert push(logic, b, 1, full(params, 2.0), push_id="B").version == 1
    faults.install("")
    assert push(logic, a, 1, full(params, 3.0), push_id="C").version == 1  # joins B's round before its retry
    clock.now += 10
    logic.tick()
    assert logic.version == 2
    assert applied.rows == [("site0", "A", 1), ("site1", "B", 2), ("site0", "C", 2)]
    check = bench.continuity(applied.rows, logic.version)
    assert check.continuous and check.shared == 1


def test_a_round_open_at_a_crash_is_recorded_once_with_the_version_the_restarted_ps_made_of_it(
    tmp_path: Path, no_faults: Any
) -> None:
    bench, clock = load_bench(), Clock()
    logic = make("async", clock, state_dir=str(tmp_path))
    applied = bench.AppliedLog(SimpleNamespace(logic=logic))
    a, b = joined(logic, 2)
    params = init(logic, a)
    assert push(logic, a, 0, full(params, 1.0), push_id="A").version == 1
    faults.install("atomic.write[update-]@1=enospc")
    assert push(logic, b, 1, full(params, 2.0), push_id="B").version == 1  # journaled, its round open
    faults.install("")
    restarted = make("async", Clock(), state_dir=str(tmp_path))  # replays A's round and B's, closed as it starts
    assert restarted.version == 2 and restarted.rounds.count == 0
    applied.watch(SimpleNamespace(logic=restarted))
    assert push(restarted, a, 2, full(params, 1.0), push_id="C").version == 3
    assert applied.rows == [("site0", "A", 1), ("site1", "B", 2), ("site0", "C", 3)]
    assert bench.continuity(applied.rows, restarted.version).continuous


# ---------------------------------------------------------------- the fault plan

WEIGHTS = {"kill": 3.0, "ps-crash": 1.0, "disk-full": 1.0}


@pytest.mark.parametrize("seed", range(20))
def test_three_minutes_at_the_default_interval_plan_every_kind_and_at_least_three_kills(seed: int) -> None:
    plan = load_bench().plan_faults(3.0, 20.0, WEIGHTS, seed, 3)
    kinds = Counter(f.kind for f in plan)
    assert kinds == {"kill": 5, "ps-crash": 2, "disk-full": 2}  # weights 3:1:1 over 9 faults
    assert [f.at for f in plan] == sorted(f.at for f in plan) and 0 < plan[0].at and plan[-1].at < 180
    assert all(b.at - a.at >= 20 * 0.3 - 0.2 for a, b in zip(plan, plan[1:], strict=False))  # one per slot
    kills = [f.victim for f in plan if f.kind == "kill"]
    assert sorted(kills[:3]) == [0, 1, 2]  # every site once before any twice
    assert all(f.victim == -1 for f in plan if f.kind != "kill")


@pytest.mark.parametrize("minutes", [0.5, 1.0, 2.0, 10.0])
def test_every_run_plans_each_kind(minutes: float) -> None:
    plan = load_bench().plan_faults(minutes, 20.0, WEIGHTS, 0, 3)
    assert set(Counter(f.kind for f in plan)) == {"kill", "ps-crash", "disk-full"}
    assert len(plan) == max(3, int(minutes * 3)) and all(0 < f.at < minutes * 60 for f in plan)


def test_a_kind_weighted_zero_is_not_planned_and_a_light_one_still_is() -> None:
    bench = load_bench()
    plan = bench.plan_faults(3.0, 20.0, {"kill": 1.0, "ps-crash": 0.0, "disk-full": 1.0}, 0, 3)
    assert set(f.kind for f in plan) == {"kill", "disk-full"} and len(plan) == 9
    plan = bench.plan_faults(3.0, 20.0, {"kill": 100.0, "ps-crash": 0.01, "disk-full": 0.01}, 0, 3)
    assert Counter(f.kind for f in plan) == {"kill": 7, "ps-crash": 1, "disk-full": 1}


def test_the_same_seed_plans_the_same_run_and_another_seed_another() -> None:
    bench = load_bench()
    assert bench.plan_faults(3.0, 20.0, WEIGHTS, 7, 3) == bench.plan_faults(3.0, 20.0, WEIGHTS, 7, 3)
    assert bench.plan_faults(3.0, 20.0, WEIGHTS, 7, 3) != bench.plan_faults(3.0, 20.0, WEIGHTS, 8, 3)
