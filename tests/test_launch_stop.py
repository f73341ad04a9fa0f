"""How a site job turns USR2/SIGTERM into a stop: at once, or at the trainer's next safe point; then requeue. And
how a local site job that fails reaches the launcher: with its cause, the other sites stopped."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
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


def refused_site(other_ready: Path) -> None:
    """What a local site job does when the PS refuses its token (run by submitit in its own process). It fails only
    once the other site is training (its handlers installed): a site stopped while still starting has nothing to save,
    and on a busy machine it could otherwise be stopped before it could say how."""
    import time

    from geofed_hpc.errors import AuthError

    deadline = time.monotonic() + 120
    while not other_ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)

    raise AuthError("Join refused by the parameter server: unknown enrollment token for site local-0")


def slow_site(record: Path) -> None:
    """A site still training: it notes the signal that stops it (a site checkpoints on SIGTERM), then leaves."""
    import time

    def stopped(signum: int, frame: object) -> None:
        record.write_text(signal.Signals(signum).name)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
    record.with_name("training").touch()
    time.sleep(600)


def test_a_failed_local_site_reaches_the_launcher_with_its_cause(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    import io
    import time

    import submitit

    from geofed_hpc.config import RunConfig
    from geofed_hpc.errors import LaunchError
    from geofed_hpc.launch.local import follow

    executor = submitit.LocalExecutor(folder=tmp_path / "submitit" / "%j")
    executor.update_parameters(timeout_min=15)
    jobs = [executor.submit(refused_site, tmp_path / "training"), executor.submit(slow_site, tmp_path / "stopped-by")]
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        follow(jobs, RunConfig(run_dir=str(tmp_path)), time.time(), io.StringIO())
    text = str(info.value)
    assert text.startswith(f"site job {jobs[0].job_id} failed: AuthError: Join refused by the parameter server: ")
    assert "unknown enrollment token for site local-0; full log: " in text and "\n" not in text
    assert time.monotonic() - started < 300  # the other site (10 min asleep) was not waited for: it is stopped
    deadline = time.monotonic() + 120
    while not jobs[1].done() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert jobs[1].done()
    assert (tmp_path / "stopped-by").read_text() == "SIGTERM"  # as scancel stops it: a checkpoint, then it ends
    err = capfd.readouterr().err  # what the job controllers print on the launcher's terminal: nothing
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
