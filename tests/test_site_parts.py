"""The site trainer's parts on their own: phases and stop requests, the interval carry, events, and the uplink,
link and replica against a real parameter server (a lost reply settled, a push that never arrived resent)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.client.events import EventLog
from geofed_hpc.client.phase import ALLOWED, IllegalPhase, Lifecycle, Phase, StopAction
from geofed_hpc.client.progress import Interval
from geofed_hpc.config import RunConfig, from_dict
from geofed_hpc.errors import UnavailableError
from geofed_hpc.paradigms.exchange import Params
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from tests.test_site_client import make_ps, shards, site_cfg

__all__ = ["shards"]  # the module-scoped token shards fixture, shared with test_site_client


def test_phase_moves_follow_the_one_table() -> None:
    for start, targets in ALLOWED.items():
        for target in Phase:
            life = Lifecycle()
            life.phase = start
            if target in targets:
                assert life.enter(target) is False and life.phase is target  # no stop pending
            else:
                with pytest.raises(IllegalPhase, match=f"{start.value} -> {target.value}"):
                    life.enter(target)
                assert life.phase is start
    # the cycle of one sync, and the moves a push that fails or is stale makes
    assert ALLOWED[Phase.TRAIN] == {Phase.BUSY} and ALLOWED[Phase.WAIT] == {Phase.IDLE}
    assert Phase.IDLE in ALLOWED[Phase.BUSY] and Phase.TRAIN not in ALLOWED[Phase.WAIT]


@pytest.mark.parametrize(
    ("phase", "action"),
    [
        (Phase.IDLE, StopAction.NOW),
        (Phase.WAIT, StopAction.SAVE_PUSHED),
        (Phase.TRAIN, StopAction.LATER),
        (Phase.BUSY, StopAction.LATER),
    ],
)
def test_a_stop_request_is_honoured_by_phase_and_the_first_signal_wins(phase: Phase, action: StopAction) -> None:
    life = Lifecycle()
    life.phase = phase
    assert life.request(15) is action and life.stop_signal == 15
    assert life.request(12) is StopAction.ALREADY and life.stop_signal == 15
    # the loop's next move is a safe point: it learns that a stop is pending
    assert life.enter(next(iter(ALLOWED[phase]))) is True


def test_an_interrupted_interval_is_carried_with_its_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    from geofed_hpc.client import progress

    clock = SimpleNamespace(monotonic=lambda: now)
    now = 1000.0
    monkeypatch.setattr(progress, "time", clock)
    interval = Interval(carry=(5, 10.0, 30.0))
    assert interval.begin() == (5, 10.0)
    assert interval.carry == (0, 0.0, 0.0)  # carried once
    now += 2.5
    pending = interval.pending(7, 14.0)
    assert pending["steps"] == 7 and pending["loss_sum"] == 14.0
    assert pending["elapsed_s"] == 32.5  # the carried seconds count toward the interval's time


def test_events_carry_the_job_and_count_earlier_segments(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    first = EventLog(path, {"SLURM_JOB_ID": "42"})
    first("restored", checkpoint=False)
    first.once("first_step", resume_seconds=1.0)
    first.once("first_step", resume_seconds=2.0)  # once per process
    first("stop", signal="SIGUSR2")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["event"] for e in lines] == ["restored", "first_step", "stop"]
    assert all(e["job_id"] == "42" and e["restarts"] == 0 for e in lines)
    assert first.preemptions == 0
    second = EventLog(path, {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"})
    assert second.preemptions == 1 and second.restarts == 1


# ---------------------------------------------------------------- against a real parameter server


def model_digest(params: Params) -> str:
    h = hashlib.sha256()
    for k in sorted(params):
        h.update(k.encode())
        h.update(np.ascontiguousarray(params[k]).tobytes())
    return h.hexdigest()


@pytest.fixture
def site(tmp_path: Path, shards: Path) -> Iterator[Any]:
    """A one-process site trainer (its real parts) joined to a real PS over gRPC, holding the global model."""
    from geofed_hpc.client.trainer import SiteTrainer

    ps = make_ps(tmp_path, interval="60s", steps=2)
    cfg: RunConfig = from_dict(RunConfig, site_cfg(tmp_path, shards, max_syncs=0, sites=1))
    trainer = SiteTrainer(cfg, 0, ps.address)
    client = PSClient(cfg.ps, ps.address)
    trainer.sync.link.client = client
    session = trainer.sync.link.start(None)
    assert trainer.sync.link.seed(trainer.sync.replica.seed_arrays(), 0) and not session.initialized
    trainer.sync.resume(None, trainer.interval, trainer.progress)
    try:
        yield trainer, ps, client
    finally:
        client.close()
        ps.stop()


def lose(client: PSClient, reaches_ps: bool) -> list[str]:
    """Make the next push's reply go missing: after the PS applied it (`reaches_ps`), or before it arrived."""
    real, seen = client.push_delta, []

    def push_delta(header: m.PushHeader, payload: bytes, **kwargs: Any) -> m.PushReply:
        client.push_delta = real  # type: ignore[method-assign]
        seen.append(header.push_id)
        if reaches_ps:
            real(header, payload, **kwargs)
        raise UnavailableError("the link dropped before the reply came")

    client.push_delta = push_delta  # type: ignore[method-assign]
    return seen


def site_status(client: PSClient) -> m.SiteStatus:
    (status,) = client.status().sites
    return status


@pytest.mark.slow
@pytest.mark.parametrize("reaches_ps", [True, False], ids=["reply-lost", "push-lost"])
def test_unanswered_work_is_settled_with_the_ps_and_applied_once(site: Any, reaches_ps: bool) -> None:
    trainer, ps, client = site
    sync, per_step = trainer.sync, trainer.sync.tokens_per_step()
    sent = lose(client, reaches_ps)
    steps, loss = trainer._train_interval(sync.link.settings)
    assert sync.exchange(steps, loss) is None  # deferred: the site trains on
    held = sync.uplink.deferred
    assert held.attempt is not None and held.attempt["push_id"] == sent[0] and held.steps == steps == 2
    assert site_status(client).pushes == int(reaches_ps)

    steps, loss = trainer._train_interval(sync.link.settings)  # two more steps against the same base
    assert steps == 4
    synced = sync.exchange(steps, loss)
    assert synced is not None and synced.held == 1
    status = site_status(client)
    settled = [json.loads(line) for line in trainer.events.path.read_text().splitlines()]
    states = [e["state"] for e in settled if e["event"] == "unanswered_push"]
    if reaches_ps:  # the PS holds the first attempt: only the two steps since go out, as a new push
        assert states == ["applied"] and status.pushes == 2 and status.tokens == 4 * per_step
    else:  # it never arrived: all four steps go out under the first attempt's push id
        assert states == ["not held"] and status.pushes == 1 and status.tokens == 4 * per_step
    assert trainer.progress.contribution_total == 4 * per_step and not held.active
    # the replica is the PS's model bit for bit after the pull
    assert sync.replica.exact and sync.replica.version == client.status().version
    _, payload = client.pull_model(sync.link.session_id, 0, timedelta(0))
    assert model_digest(codec.decode(payload)) == model_digest(sync.replica.base)
