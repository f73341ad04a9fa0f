"""train.warmup_steps: a linear lr warmup over a site's lifetime steps, which a requeued site continues."""

from __future__ import annotations

from pathlib import Path

import pytest

from geofed_hpc.client.steps import warmup_factor
from geofed_hpc.config import ParadigmConfig, RunConfig, TrainConfig
from geofed_hpc.errors import ConfigError
from tests.site_procs import Site, events
from tests.test_site_client import make_ps, metrics, shards, site_cfg

__all__ = ["shards"]  # the module-scoped token shards fixture, shared with test_site_client


def test_warmup_factor_rises_linearly_to_one_and_stays() -> None:
    assert [warmup_factor(n, 4) for n in (1, 2, 3, 4, 5, 100)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(1, 0) == 1.0  # no warmup: the full lr from the first step
    with pytest.raises(ValueError, match="steps count from 1"):
        warmup_factor(0, 4)
    with pytest.raises(ValueError, match="warmup_steps must be 0 or positive"):
        warmup_factor(1, -1)


def test_bad_warmup_settings_name_the_field() -> None:
    with pytest.raises(ConfigError, match="train.warmup_steps: must be 0 or more, got -5"):
        TrainConfig(warmup_steps=-5)
    zo = ParadigmConfig(name="zo")
    with pytest.raises(ConfigError, match="train.warmup_steps: paradigm=zo takes its own steps"):
        RunConfig(paradigm=zo, train=TrainConfig(max_local_steps=8, warmup_steps=10))


@pytest.mark.slow
def test_a_site_warms_its_lr_up_over_its_steps_and_a_restarted_site_continues_the_ramp(
    tmp_path: Path, shards: Path
) -> None:
    lr, warmup = 3e-3, 8  # 3 local steps per sync: steps 3, 6 | 9 end the syncs
    ps = make_ps(tmp_path, aggregation="async")
    try:
        for syncs in (2, 3):  # the second launch resumes from the site's checkpoint and trains one more sync
            site = Site(site_cfg(tmp_path, shards, max_syncs=syncs, lr=lr, warmup_steps=warmup), tmp_path, ps.address)
            try:
                assert site.wait(timeout=600) == [0], site.output()
            finally:
                site.close()
    finally:
        ps.stop()
    records = [r for r in metrics(tmp_path) if "train/loss" in r]
    assert [r["sync/index"] for r in records] == [1, 2, 3]
    assert [r["train/lr"] for r in records] == pytest.approx([lr * 3 / 8, lr * 6 / 8, lr])
    ready = [e["source"] for e in events(tmp_path / "run" / "sites" / "local-0") if e["event"] == "ready"]
    assert ready == ["fresh", "local"]  # the third sync's lr came from the restored step count, not a new ramp
