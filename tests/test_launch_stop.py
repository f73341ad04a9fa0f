"""How a site job turns USR2/SIGTERM into a stop: at once, or at the trainer's next safe point; then requeue."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from geofed_hpc.client.job import StopHandler


class FakeTrainer:
    """Says whether it may stop now (as SiteTrainer.request_stop does) and remembers what it was asked."""

    def __init__(self, stop_now: bool) -> None:
        self.stop_now = stop_now
        self.stop_signal: int | None = None
        self.on_stop: Callable[[int], None] = lambda signum: None
        self.requests: list[int] = []

    def request_stop(self, signum: int) -> bool:
        self.requests.append(signum)
        self.stop_signal = signum
        return self.stop_now

    def checkpoint_after_error(self) -> None:
        pass


@pytest.fixture
def handlers() -> Iterator[dict[str, Any]]:
    """Stand-ins for submitit's handlers, restored afterwards; `calls` records what ran."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR2, signal.SIGTERM)}
    calls: dict[str, Any] = {"submitit": [], "exit": []}

    def submitit_usr2(signum: int, frame: object) -> None:  # checkpoint, `scontrol requeue`, sys.exit(-1)
        calls["submitit"].append(signum)
        raise SystemExit(-1)

    signal.signal(signal.SIGUSR2, submitit_usr2)
    signal.signal(signal.SIGTERM, lambda *_: calls["submitit"].append("bypassed TERM"))
    yield calls
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def stopper(calls: dict[str, Any], trainer: FakeTrainer | None, rank: int = 0) -> StopHandler:
    handler = StopHandler(rank, exit=calls["exit"].append).install()
    if trainer is not None:
        handler.attach(trainer)
    return handler


def test_usr2_where_the_state_is_on_disk_goes_through_submitits_requeue_and_exits(handlers: dict[str, Any]) -> None:
    trainer = FakeTrainer(stop_now=True)
    stopper(handlers, trainer)
    with pytest.raises(SystemExit):
        os.kill(os.getpid(), signal.SIGUSR2)
    assert trainer.requests == [signal.SIGUSR2]
    assert handlers["submitit"] == [signal.SIGUSR2] and handlers["exit"] == [255]  # submitit's -1, as a status


def test_sigterm_mid_step_waits_for_the_trainers_safe_point(handlers: dict[str, Any]) -> None:
    trainer = FakeTrainer(stop_now=False)
    stopper(handlers, trainer)
    os.kill(os.getpid(), signal.SIGTERM)  # deferred: nothing exits yet
    assert trainer.requests == [signal.SIGTERM] and handlers["exit"] == []
    with pytest.raises(SystemExit):
        trainer.on_stop(signal.SIGTERM)  # the trainer reached its safe point and saved
    assert handlers["exit"] == [128 + signal.SIGTERM] and handlers["submitit"] == []  # Slurm requeues or ends it


def test_a_signal_before_the_trainer_exists_stops_at_once(handlers: dict[str, Any]) -> None:
    stopper(handlers, None)
    with pytest.raises(SystemExit):
        os.kill(os.getpid(), signal.SIGTERM)
    assert handlers["exit"] == [128 + signal.SIGTERM]


def test_only_rank_0_checkpoints_and_requeues(handlers: dict[str, Any]) -> None:
    trainer = FakeTrainer(stop_now=True)
    stopper(handlers, trainer, rank=1)
    os.kill(os.getpid(), signal.SIGUSR2)  # told to the trainer (FSDP ranks stop together); rank 0 requeues
    assert trainer.requests == [signal.SIGUSR2] and handlers["submitit"] == [] and handlers["exit"] == []
    stopper(handlers, None, rank=1)
    os.kill(os.getpid(), signal.SIGUSR2)
    assert handlers["submitit"] == [] and handlers["exit"] == []
    with pytest.raises(SystemExit):
        os.kill(os.getpid(), signal.SIGTERM)
