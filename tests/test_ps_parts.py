"""The PS's parts on their own: the push ledger (exactly once) and the observer (counters, history, losses)."""

from __future__ import annotations

import math
import threading
from datetime import timedelta

import pytest

from geofed_hpc.errors import UnavailableError
from geofed_hpc.ps import ledger as ledger_module
from geofed_hpc.ps.ledger import PushLedger, resent
from geofed_hpc.ps.observe import APPLIED_KEPT, Contribution, Observer
from geofed_hpc.rpc import messages as m

SHORT = timedelta(seconds=0.2)


def test_a_claimed_push_is_in_flight_until_released_and_then_answered_once() -> None:
    ledger = PushLedger()
    assert ledger.claim("p", SHORT) is None and ledger.in_flight == 1
    assert ledger.state("p") == "receiving" and ledger.state("") == ""
    ledger.remember("p", m.PushReply(True, 3, "", 1))
    ledger.release("p")
    assert ledger.in_flight == 0 and ledger.state("p") == "applied" and ledger.knows("p")
    previous = ledger.claim("p", SHORT)
    assert previous is not None and ledger.in_flight == 0  # answered, not taken in flight again
    reply = resent("p", previous, 5)
    assert (reply.accepted, reply.version, reply.staleness, reply.duplicate) == (True, 5, 1, True)
    assert "applied once at version 3" in reply.reason


def test_a_refused_push_is_not_held_and_may_come_again() -> None:
    ledger = PushLedger()
    assert ledger.claim("p", SHORT) is None
    ledger.release("p")  # refused: nothing remembered
    assert ledger.state("p") == "" and not ledger.knows("p")
    assert ledger.claim("p", SHORT) is None
    ledger.remember("q", m.PushReply(False, 0, "already initialized"))
    assert ledger.state("q") == ""  # answered, but not applied
    previous = ledger.claim("q", SHORT)
    assert previous is not None and resent("q", previous, 0).reason == "already initialized"


def test_a_second_stream_of_a_push_in_flight_waits_for_the_first_then_is_a_duplicate() -> None:
    ledger = PushLedger()
    assert ledger.claim("p", SHORT) is None
    with pytest.raises(UnavailableError, match="still being received"):
        ledger.claim("p", SHORT)
    answers: list[m.PushReply | None] = []
    waiting = threading.Thread(target=lambda: answers.append(ledger.claim("p", timedelta(seconds=30))))
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive() and not answers  # it waits for the first stream
    ledger.remember("p", m.PushReply(True, 1))
    ledger.release("p")
    waiting.join(30)
    assert answers and answers[0] is not None and answers[0].version == 1


def test_wait_idle_returns_when_the_last_push_is_released() -> None:
    ledger = PushLedger()
    assert ledger.wait_idle(SHORT)
    ledger.claim("a", SHORT)
    assert not ledger.wait_idle(timedelta(seconds=0.05))
    threading.Timer(0.1, ledger.release, ["a"]).start()
    assert ledger.wait_idle(timedelta(seconds=30))


def test_the_ledger_forgets_only_what_a_resend_could_no_longer_use_and_persists_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ledger_module, "MAX_REMEMBERED_PUSHES", 5)
    ledger = PushLedger()
    for i in range(7):
        ledger.remember(f"p{i}", m.PushReply(True, i, "", 0))
    assert ledger.knows("p0")  # over the count, but a resend of it could still be applied: kept
    ledger.prune(3)  # the global version moved on: pushes applied before version 3 are refused as stale now
    assert not ledger.knows("p1") and ledger.knows("p2")  # the oldest go, down to the count
    ledger.prune(100)
    assert ledger.knows("p2")  # the newest MAX_REMEMBERED_PUSHES stay in any case
    rows = ledger.to_json()
    assert [r[0] for r in rows] == ["p2", "p3", "p4", "p5", "p6"] and rows[0] == ["p2", True, 2, "", 0]
    restored = PushLedger()
    restored.load_json(rows)  # a snapshot holds every one remembered
    assert restored.state("p6") == "applied" and restored.knows("p2") and not restored.knows("p1")


def test_the_observer_records_each_update_with_the_contributions_of_its_round() -> None:
    obs = Observer()
    obs.contributed(Contribution("a", 0, 10, 100))
    obs.contributed(Contribution("b", 2, 30, 300))
    obs.applied(1, 2, "ready")
    obs.contributed(Contribution("a", 0, 5, 50))
    obs.round_dropped()  # that round was discarded: its contribution is in no update
    obs.applied(2, 1, "ready")
    first, second = obs.applied_since(0)
    assert (first["version"], first["sites"], first["staleness"], first["tokens"], first["nbytes"]) == (
        1,
        ["a", "b"],
        2,
        40,
        400,
    )
    assert second["sites"] == [] and second["active"] == 1
    assert [a["version"] for a in obs.applied_since(1)] == [2]
    for v in range(3, APPLIED_KEPT + 10):
        obs.applied(v, 1, "ready")
    assert len(obs.applied_since(0)) == APPLIED_KEPT


def test_the_observer_reports_the_global_loss_only_for_the_version_now() -> None:
    obs = Observer()
    version, loss = obs.global_val_loss()
    assert version == -1 and math.isnan(loss)
    obs.received(100)
    obs.received(50)
    obs.val_loss("a", 3, 2.0)
    obs.val_loss("b", 3, 4.0)
    obs.val_loss("c", 2, 9.0)  # of an older version: not averaged in
    assert obs.global_val_loss() == (3, 3.0)
    values = obs.values(3, 2)
    assert values == {
        "ps/version": 3,
        "ps/active_sites": 2,
        "ps/pushes_total": 2,
        "ps/bytes_received_total": 150,
        "ps/global_val_loss": 3.0,
    }
    assert "ps/global_val_loss" not in obs.values(4, 2)


def test_a_failing_site_metrics_hook_never_fails_the_caller() -> None:
    obs = Observer()
    seen: list[tuple[str, dict[str, float]]] = []
    obs.site_metrics("a", {"x": 1.0})  # no hook: nothing happens
    obs.on_site_metrics = lambda site, values: seen.append((site, values))
    header = m.PushHeader("s", 4, 3, 30, "fp32", 0, b"", "p", train_loss=2.5)
    obs.pushed("a", header, 1, 1000, 90)
    assert seen == [
        (
            "a",
            {
                "sync/bytes_sent": 1000,
                "sync/staleness": 1,
                "sync/local_steps": 3,
                "train/loss": 2.5,
                "site/contribution_tokens": 30,
                "site/contribution_total": 90,
            },
        )
    ]

    def broken(site: str, values: dict[str, float]) -> None:
        raise RuntimeError("exporter down")

    obs.on_site_metrics = broken
    obs.pushed("a", header, 1, 1000, 90)
