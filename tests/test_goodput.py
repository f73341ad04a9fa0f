"""Goodput per site (seconds inside training steps / wall seconds) on the PS's Prometheus endpoint, and evaluations of
the global model kept within train.eval_budget of the wall-clock (the last sync of a run always evaluates)."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from geofed_hpc.client.trainer import Goodput
from geofed_hpc.config import RunConfig
from geofed_hpc.ps.app import ParameterServer
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from tests.conftest import ps_config
from tests.test_observability_e2e import free_port, scrape
from tests.test_site_parts import shards, site

__all__ = ["shards", "site"]  # fixtures shared with test_site_parts


def test_goodput_is_the_share_of_wall_clock_inside_steps_since_the_first_step() -> None:
    goodput = Goodput()
    assert math.isnan(goodput.value(now=5.0))  # no step yet
    goodput.add(10.0, 11.0)  # a step of 1 s
    goodput.add(12.0, 13.5)  # then a sync of 1 s, and a step of 1.5 s
    assert goodput.value(now=13.5) == pytest.approx(2.5 / 3.5)
    assert goodput.value(now=15.0) == pytest.approx(2.5 / 5.0)  # a sync in progress lowers it


def test_the_ps_serves_each_sites_goodput_on_prometheus(tmp_path: Path) -> None:
    ps = ps_config(aggregation="async", state_dir=str(tmp_path / "ps"), metrics_port=free_port(), enroll_token="t")
    server = ParameterServer(replace(RunConfig(), ps=ps, wandb_mode="disabled"))
    try:
        with PSClient(ps_config(), server.address) as client:
            client.connect(timedelta(seconds=5))
            osc = client.join(m.JoinRequest("osc", "t")).session_id
            tacc = client.join(m.JoinRequest("tacc", "t")).session_id
            client.heartbeat(m.HeartbeatRequest(osc, 0, goodput=0.75))
            client.heartbeat(m.HeartbeatRequest(tacc, 0, goodput=0.5))
            client.heartbeat(m.HeartbeatRequest(tacc, 0))  # a heartbeat without a goodput keeps the last one
            for wild in (7.0, float("inf"), float("nan"), -1.0):  # not a share of wall time: dropped, never served
                client.heartbeat(m.HeartbeatRequest(osc, 0, goodput=wild))
        deadline = time.monotonic() + 60
        while 'geofed_site_goodput{site="tacc"}' not in (text := scrape(server.metrics_port)):
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
        assert 'geofed_site_goodput{site="osc"} 0.75' in text.splitlines()
        assert 'geofed_site_goodput{site="tacc"} 0.5' in text.splitlines()
    finally:
        server.stop()


@pytest.mark.slow
def test_evaluations_of_the_global_model_keep_within_their_budget_and_the_last_sync_evaluates(site: Any) -> None:
    trainer, _ps, _client = site
    evaluation = trainer.evaluation
    assert evaluation.budget == 1.0 and evaluation.due()  # the default: every sync evaluates
    evaluation.budget = 1e-6  # at most a millionth of the wall-clock: not again so soon after this one
    loss = evaluation.run(trainer.sync.version)
    assert math.isfinite(loss) and evaluation.seconds > 0
    assert not evaluation.due()
    assert evaluation.due(last=True)  # the run's last sync evaluates, so its final model has a loss
    evaluation.interval = timedelta(hours=1)
    assert not evaluation.due(last=True)  # train.eval_interval still holds
