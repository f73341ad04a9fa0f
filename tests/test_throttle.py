"""train.slowdown: a throttled step loop runs `slowdown` times slower, measured on a fake clock, never on wall time."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from geofed_hpc.client.throttle import Throttle
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


def test_the_sleep_follows_each_step_measured_compute_time() -> None:
    t = FakeTime()
    throttle = Throttle(3.0, clock=t.clock, sleep=t.sleep)
    for compute in (0.1, 0.4, 0.2):  # a loaded machine: steps take longer, the sleep grows with them
        assert throttle(lambda c=compute: (t.work(c), c)[1]) == compute
    assert t.sleeps == pytest.approx([0.2, 0.8, 0.4])
    assert t.now == pytest.approx(3.0 * 0.7)


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
