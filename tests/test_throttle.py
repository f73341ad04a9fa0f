"""train.slowdown: a throttled step loop runs `slowdown` times slower, measured on a fake clock, never on wall time."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from geofed_hpc.client.throttle import MEASURED, Throttle
from geofed_hpc.config import DataConfig, ModelConfig, RunConfig, SiteConfig, TrainConfig
from geofed_hpc.data.prepare import prepare_shards
from geofed_hpc.errors import ConfigError
from geofed_hpc.rpc import messages as m


class FakeTime:
    """A clock that moves only when a step computes (`work`) or the throttle sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def work(self, seconds: float) -> None:
        self.now += seconds


def steps_within(factor: float, budget: float, step_s: float) -> int:
    """How many steps of `step_s` compute a loop throttled by `factor` finishes before `budget` (fake seconds)."""
    t = FakeTime()
    throttle = Throttle(factor, clock=t.clock, sleep=t.sleep)
    steps = 0
    while t.now < budget:
        throttle(lambda: t.work(step_s))
        steps += 1
    return steps


def test_a_throttled_loop_takes_factor_times_fewer_steps_in_the_same_time() -> None:
    assert steps_within(1.0, 100.0, 0.25) == 400
    assert steps_within(2.0, 100.0, 0.25) == 200
    assert steps_within(4.0, 100.0, 0.25) == 100
    assert steps_within(2.5, 100.0, 0.5) == 80


def test_until_it_settles_the_sleep_follows_each_step_measured_compute_time() -> None:
    t = FakeTime()
    throttle = Throttle(3.0, clock=t.clock, sleep=t.sleep)
    for compute in (0.1, 0.4, 0.2):  # the first interval: each step's own compute, times factor - 1
        assert throttle(lambda c=compute: (t.work(c), c)[1]) == compute
    assert t.sleeps == pytest.approx([0.2, 0.8, 0.4])
    assert t.now == pytest.approx(3.0 * 0.7)


def test_after_the_first_interval_the_emulated_time_per_step_is_fixed_and_contention_is_not_multiplied() -> None:
    """The emulated time is (factor - 1) x the median compute of the first steps, measured once. A later step that
    runs slower beside other work (a sync sender on the same cores) takes its real, longer compute plus that same
    fixed time: slower by what contention cost, not factor times it."""
    t = FakeTime()
    throttle = Throttle(5.0, clock=t.clock, sleep=t.sleep)
    for compute in (0.3, 0.1, 0.2, 0.9):  # the first interval; median 0.25
        throttle(lambda c=compute: t.work(c))
    throttle.settle()
    assert throttle.extra == pytest.approx(4 * 0.25)
    del t.sleeps[:]
    start = t.now
    for compute in (0.2, 0.6, 0.2):  # the middle step shares the cores with the sender: three times its compute
        throttle(lambda c=compute: t.work(c))
    assert t.sleeps == pytest.approx([1.0, 1.0, 1.0])
    assert t.now - start == pytest.approx(1.0 + 3 * 1.0)  # real compute 1.0 s, plus 1 s emulated per step
    throttle.settle()  # measured once: a second settle changes nothing
    assert throttle.extra == pytest.approx(1.0)


def test_a_long_first_interval_fixes_the_emulated_time_after_the_measured_steps() -> None:
    t = FakeTime()
    throttle = Throttle(2.0, clock=t.clock, sleep=t.sleep)
    for i in range(MEASURED + 3):
        throttle(lambda i=i: t.work(0.1 if i < MEASURED else 1.0))  # slower steps after the first MEASURED
    assert throttle.extra == pytest.approx(0.1)
    assert t.sleeps[-3:] == pytest.approx([0.1] * 3)


def test_settle_before_any_step_measures_nothing() -> None:
    throttle = Throttle(2.0)
    throttle.settle()
    assert throttle.extra is None and throttle.measured == []


def test_full_speed_never_sleeps() -> None:
    t = FakeTime()
    throttle = Throttle(1.0, clock=t.clock, sleep=t.sleep)
    for _ in range(5):
        throttle(lambda: t.work(1.0))
    assert t.sleeps == [] and t.now == 5.0


@pytest.mark.parametrize("bad", [0.5, 0.0, -2.0, math.nan, 1001.0])
def test_slowdown_is_validated_and_the_error_names_the_field(bad: float) -> None:
    with pytest.raises(ConfigError, match="train.slowdown"):
        TrainConfig(slowdown=bad)
    if not bad >= 1.0:
        with pytest.raises(ValueError, match="at least 1"):
            Throttle(bad)


def test_the_site_step_loop_sleeps_after_every_real_step(tmp_path: Path) -> None:
    """A real SiteTrainer built with train.slowdown=4 runs H real optimizer steps and sleeps 3x each one's
    compute time after it (its clock and sleep swapped for the fake ones; no PS needed to train locally)."""
    from geofed_hpc.client.trainer import SiteTrainer

    shards = tmp_path / "shards"
    prepare_shards(
        DataConfig(tokenizer="gpt2", source="bible", max_tokens=8000, cache_dir=str(tmp_path / "cache")), shards, 1
    )
    cfg = RunConfig(
        run_dir=str(tmp_path / "run"),
        wandb_mode="disabled",
        site=SiteConfig(num_sites=1),
        model=ModelConfig(name="t", context=16, d_model=16, n_layers=1, n_heads=2, d_ff=32),
        data=DataConfig(source=str(shards), val_batches=1),
        train=TrainConfig(batch_size=2, max_local_steps=5, slowdown=4.0),
    )
    trainer = SiteTrainer(cfg, 0, "127.0.0.1:1")
    assert trainer.throttle.factor == 4.0
    t = FakeTime()
    trainer.throttle.clock, trainer.throttle.sleep = lambda: t.work(0.5) or t.now, t.sleep
    settings = m.RunSettings(codec="int8", sync_interval_s=0.0, max_local_steps=5)
    steps, loss = trainer._train_interval(settings)
    assert steps == 5 and loss > 0
    assert trainer.runtime.sampler.draws == 5
    assert t.sleeps == pytest.approx([3 * 0.5] * 5)  # each step "took" 0.5 s on the fake clock
    assert trainer.throttle.extra == pytest.approx(3 * 0.5)  # fixed at the end of the first interval


def test_a_fixed_step_time_is_added_to_every_step_whatever_its_compute() -> None:
    """train.step_time: the same emulated accelerator seconds after every step, from the first, at full speed or on
    top of a slow-down's; a step slowed by contention is slower by exactly its longer compute."""
    t = FakeTime()
    throttle = Throttle(1.0, clock=t.clock, sleep=t.sleep, fixed=2.0)
    for compute in (0.1, 0.5, 0.1):
        throttle(lambda c=compute: t.work(c))
    assert t.sleeps == pytest.approx([2.0] * 3) and t.now == pytest.approx(0.7 + 6.0)
    t = FakeTime()
    both = Throttle(3.0, clock=t.clock, sleep=t.sleep, fixed=1.0)
    both(lambda: t.work(0.5))
    both.settle()
    both(lambda: t.work(2.0))
    assert t.sleeps == pytest.approx([1.0 + 1.0, 1.0 + 1.0])
    with pytest.raises(ValueError, match="at least 0 seconds"):
        Throttle(1.0, fixed=-1.0)
    assert TrainConfig(step_time="2s").step_time.total_seconds() == 2.0  # type: ignore[arg-type]
