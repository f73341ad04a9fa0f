"""Every acknowledged delta applied exactly once, every replica bit-identical: a full disk while a round closes or a
push is journaled, an overflowing update, a journal the config no longer fits, thousands of push ids across a
restart, a push still arriving when a site asks about it, and a replica whose version names another model."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geofed_hpc import codec, faults
from geofed_hpc.errors import UnavailableError
from geofed_hpc.ps.ledger import MAX_REMEMBERED_PUSHES
from geofed_hpc.rpc import messages as m
from tests.site_procs import wait_for
from tests.test_ps_logic import Clock, expect, full, init, joined, make, push
from tests.test_site_parts import model_digest, shards, site

__all__ = ["shards", "site"]  # fixtures shared with test_site_parts


@pytest.fixture
def no_faults() -> Any:
    yield
    faults.install("")


def test_a_round_whose_update_cannot_be_written_stays_whole_and_closes_once_later(
    tmp_path: Path, no_faults: Any
) -> None:
    clock = Clock()
    logic = make("buffered", clock, buffer_size=2, outer_optimizer="nesterov", momentum=0.9, state_dir=str(tmp_path))
    a, b = joined(logic, 2)
    params = init(logic, a)
    assert push(logic, a, 0, full(params, 1.0), push_id="A").accepted
    faults.install("atomic.write[update-]@1=enospc")  # the disk fills as B's push closes the round
    reply = push(logic, b, 0, full(params, 3.0), push_id="B")
    assert reply.accepted and reply.version == 0  # B is journaled and waits in the round, which stays whole
    assert logic.version == 0 and logic.rounds.count == 2
    faults.install("")
    logic.tick()
    assert logic.version == 0  # not before the retry delay
    clock.now += 10
    logic.tick()  # space again: the round closes, both deltas once, the momentum stepped once
    assert logic.version == 1 and logic.rounds.count == 0
    expect(logic, a, {k: v + 1.9 * 2.0 for k, v in params.items()}, 1)  # lr (D + 0.9 m), m = D = mean 2
    assert push(logic, b, 0, full(params, 3.0), push_id="B").duplicate  # B's resend: applied once


def test_an_update_that_would_overflow_is_refused_and_the_model_stays_finite() -> None:
    logic = make("async", outer_optimizer="nesterov", momentum=0.9)
    (a,) = joined(logic, 1)
    params = init(logic, a)
    before = logic.model_hash()
    reply = push(logic, a, 0, full(params, 3e38), push_id="huge")  # finite, but 1.9 x 3e38 is not
    assert not reply.accepted and "Inf" in reply.reason and logic.version == 0
    assert logic.model_hash() == before
    assert push(logic, a, 0, full(params, 3e38), push_id="huge").duplicate  # refused once, not retried
    assert push(logic, a, 0, full(params, 1.0), push_id="fine").accepted and logic.version == 1
    expect(logic, a, {k: v + 1.9 for k, v in params.items()}, 1)  # lr (D + 0.9 m), m = D: no momentum left over


def test_a_push_that_cannot_be_journaled_is_refused_and_applied_once_when_resent(
    tmp_path: Path, no_faults: Any
) -> None:
    logic = make("sync", state_dir=str(tmp_path))
    a, b = joined(logic, 2)
    params = init(logic, a)
    faults.install("atomic.write[.json]@1=enospc")  # the journal entry of A's push cannot be written
    with pytest.raises(UnavailableError, match="could not make the push durable"):
        push(logic, a, 0, full(params, 1.0), push_id="A")
    faults.install("")
    assert logic.rounds.count == 0 and logic.core.ledger.state("A") == ""  # nothing folded, nothing promised
    assert push(logic, a, 0, full(params, 1.0), push_id="A").accepted  # the site's retry
    assert push(logic, b, 0, full(params, 3.0), push_id="B").version == 1
    expect(logic, a, {k: v + 2.0 for k, v in params.items()}, 1)


def test_an_async_push_is_durable_though_its_snapshot_fails(tmp_path: Path, no_faults: Any) -> None:
    logic = make("async", state_dir=str(tmp_path))
    (a,) = joined(logic, 1)
    params = init(logic, a)
    faults.install("atomic.write[global]@1=enospc")  # the snapshot of version 1
    assert push(logic, a, 0, full(params, 1.0), push_id="A").version == 1
    faults.install("")
    restarted = make("async", state_dir=str(tmp_path))  # a crash: the journal holds what the snapshot could not
    assert restarted.version == 1 and restarted.model_hash() == logic.model_hash()
    assert push(restarted, a, 0, full(params, 1.0), push_id="A").duplicate


def test_a_journal_the_new_config_cannot_replay_is_set_aside_and_the_ps_starts(
    tmp_path: Path, warnings_log: pytest.LogCaptureFixture
) -> None:
    logic = make("sync", state_dir=str(tmp_path))
    a, _b = joined(logic, 2)
    params = init(logic, a)
    assert push(logic, a, 0, full(params, 1.0), steps=0, push_id="zero-steps").accepted  # journaled, round open
    restarted = make("sync", state_dir=str(tmp_path), outer_optimizer="fednova")  # fednova divides by the steps
    assert restarted.version == 0 and restarted.rounds.count == 0
    aside = list((tmp_path / "round" / "set-aside").glob("*.json"))
    assert len(aside) == 1 and "cannot be replayed" in warnings_log.text and "set aside" in warnings_log.text


def test_every_remembered_push_id_survives_a_restart(tmp_path: Path) -> None:
    logic = make("async", state_dir=str(tmp_path), max_staleness=1)
    (a,) = joined(logic, 1)
    init(logic, a)
    ids = [f"old-{i}" for i in range(MAX_REMEMBERED_PUSHES)]
    for push_id in ids:  # answers the ledger gave (the PS made them one by one; here at once, then snapshotted)
        logic.core.ledger.remember(push_id, m.PushReply(True, 0, "", 0))
    logic.finish()
    restarted = make("async", state_dir=str(tmp_path), max_staleness=1)
    assert all(restarted.core.ledger.state(i) == "applied" for i in ids)


@pytest.mark.slow
def test_a_push_still_arriving_is_waited_for_not_taken_as_lost(site: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, ps, client = site
    uplink, sync = trainer.sync.uplink, trainer.sync
    header = m.PushHeader(sync.link.session_id, sync.version, 3, 3, "fp32", 0, b"", "slow-push")
    uplink.deferred.record(3, 3.0, (header, b"bytes of an attempt"))
    ledger = ps.logic.core.ledger
    assert ledger.claim("slow-push", timedelta(seconds=1)) is None  # a stream of it is still arriving

    answers: list[str] = []  # what the PS said of the push each time the site asked
    heartbeat = client.heartbeat

    def asking(request: m.HeartbeatRequest, *args: Any, **kwargs: Any) -> m.HeartbeatReply:
        reply = heartbeat(request, *args, **kwargs)
        answers.append(reply.push)
        return reply

    monkeypatch.setattr(client, "heartbeat", asking)

    def lands() -> None:  # once the site heard "receiving" twice, however long that took
        wait_for(lambda: answers.count("receiving") >= 2, 60, "the site to ask twice")
        ledger.remember("slow-push", m.PushReply(True, 1, "", 0))
        ledger.release("slow-push")

    threading.Thread(target=lands, daemon=True).start()
    work = trainer.sync.uplink  # settle asks, hears "receiving", waits, then learns the push was applied
    from geofed_hpc.client.uplink import Work

    assert work.settle(client, Work(sync.link.session_id, sync.version, 3, 1, 1.0), sync.timer)
    assert answers.count("receiving") >= 2 and answers[-1] == "applied"  # it waited, then learned
    assert uplink.deferred.applied_steps == 3 and uplink.work_id == ""  # confirmed: not resent as not held


@pytest.mark.slow
def test_a_replica_whose_version_names_another_model_pulls_it_whole(site: Any) -> None:
    trainer, ps, client = site
    sync = trainer.sync
    version = sync.version
    name = next(iter(sync.replica.base))
    sync.replica.base[name] = sync.replica.base[name] + np.float32(0.01)  # same version, another model (a re-seed)
    steps, loss = trainer._train_interval(sync.link.settings)
    assert sync.exchange(steps, loss) is not None and sync.version == version + 1
    _, payload = client.pull_model(sync.link.session_id, 0, timedelta(0))
    assert model_digest(codec.decode(payload)) == model_digest(sync.replica.base)  # bit for bit again
