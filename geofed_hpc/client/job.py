"""ClientJob: the callable submitit runs for a site, locally or under Slurm, and requeues on preemption."""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import signal
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import submitit

from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.client.ranks import site_ranks
from geofed_hpc.config import RunConfig, from_dict
from geofed_hpc.log import logger, setup_logging

# USR2: submitit's preemption/timeout signal (NCCL takes USR1). TERM: `scontrol requeue`, scancel, end of grace.
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class Stoppable(Protocol):
    """What the stop handler needs from a trainer (see SiteTrainer.request_stop)."""

    on_stop: Callable[[int], None]

    @property
    def stop_signal(self) -> int | None: ...

    def request_stop(self, signum: int) -> bool: ...

    def checkpoint_after_error(self) -> None: ...


def global_rank() -> int:
    """This task's rank in its site job: submitit's, else torchrun's, else 0 (see client/ranks.py; no torch)."""
    return site_ranks().rank


class StopHandler:
    """Turns USR2/SIGTERM into a checkpoint at the trainer's next safe point, then submitit's requeue or exit.

    submitit's own USR2 handler checkpoints and requeues at once, wherever the main thread happens to be
    (mid optimizer step, mid push). This one asks the trainer first: it stops at once where the state on
    disk is complete, else at the end of the current step or push. USR2 then goes on to submitit's handler
    (ClientJob.checkpoint, pickle, `scontrol requeue`, exit); SIGTERM (`scontrol requeue`, scancel) exits,
    and Slurm requeues or ends the job. Only global rank 0 checkpoints; other ranks just leave.

    With the checkpoint on disk the process leaves at once (`exit`, os._exit by default): a graceful
    interpreter shutdown (W&B teardown, process groups) takes seconds and can hang past Slurm's kill.
    """

    def __init__(self, rank: int = 0, exit: Callable[[int], Any] = os._exit) -> None:
        self.rank = rank
        self.trainer: Stoppable | None = None
        self.previous: dict[int, Any] = {}
        self.exit = exit

    def install(self) -> StopHandler:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach only the main thread; nothing to catch here
        for sig in STOP_SIGNALS:
            self.previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        return self

    def attach(self, trainer: Stoppable) -> None:
        trainer.on_stop = self.finish
        self.trainer = trainer

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        logger.warning("caught %s (rank %d)", signal.Signals(signum).name, self.rank)
        if self.rank != 0:
            if self.trainer is not None:  # FSDP: rank 0's checkpoint gathers from every rank; stop with it
                self.trainer.request_stop(signum)
                return
            if signum == signal.SIGTERM:
                raise SystemExit(128 + signum)
            return  # rank 0 checkpoints and requeues the whole job
        if self.trainer is None or self.trainer.request_stop(signum):
            self.finish(signum)

    def finish(self, signum: int) -> None:
        """Leave: USR2 through submitit's handler (checkpoint + requeue), anything else by exiting."""
        code: Any = 128 + signum
        previous = self.previous.get(signum)
        if signum == signal.SIGUSR2 and callable(previous):
            try:
                previous(signum, None)  # submitit: ClientJob.checkpoint(), dump, `scontrol requeue`, sys.exit
            except SystemExit as done:  # its exit code matters to submitit's local executor (requeue)
                code = done.code
        code = code if isinstance(code, int) else 1
        logger.info("stopping for %s with exit code %d; the checkpoint is on disk", signal.Signals(signum).name, code)
        for stream in (sys.stdout, sys.stderr, *(getattr(h, "stream", None) for h in logger.handlers)):
            if stream is not None:
                with contextlib.suppress(OSError, ValueError):  # a stream someone closed: the exit matters more
                    stream.flush()
        self.exit(code & 0xFF)
        raise SystemExit(code)


class ClientJob(submitit.helpers.Checkpointable):
    """Picklable and torch-free until called, so the launcher can submit it without importing torch.

    Its state lives in the site's fixed checkpoint directory, not on the object: a requeued job is the
    same object called again, and it resumes from that directory and the live global model.
    """

    def __init__(self, cfg: dict[str, Any], site_index: int, ps_address: str) -> None:
        self.cfg = cfg
        self.site_index = site_index
        self.ps_address = ps_address

    def __call__(self) -> dict[str, Any]:
        cfg: RunConfig = from_dict(RunConfig, self.cfg)
        setup_logging(cfg.verbosity)
        # a crash in native code (a segfault, an abort in a C++ destructor at exit) leaves every thread's Python
        # stack in the job's log
        if not faulthandler.is_enabled():
            with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):  # stderr without a file
                faulthandler.enable(all_threads=True)
        stopper = StopHandler(global_rank()).install()  # before the slow start: a signal then just exits
        if cfg.script:  # launch script=: the user's own loop (geofed_hpc.Site) runs as this job's child
            from geofed_hpc.client.script import ScriptRunner

            runner = ScriptRunner(cfg, self.site_index, self.ps_address)
            stopper.attach(runner)
            return runner.run()
        if stopper.rank == 0:  # a restart's checkpoint comes off the disk while torch is imported (trainer's folder)
            folder = Path(cfg.run_dir) / "sites" / f"{cfg.site.name}-{self.site_index}" / "ckpt"
            CheckpointStore(folder, prefix="site").prefetch()
        from geofed_hpc.client.distributed import close_distributed  # torch is imported here, inside the job
        from geofed_hpc.client.trainer import SiteTrainer

        trainer = SiteTrainer(cfg, self.site_index, self.ps_address)
        stopper.attach(trainer)
        try:
            result = trainer.run()
        except SystemExit:  # a stop every rank of the site took together
            close_distributed()
            raise
        except Exception as exc:
            if trainer.stop_signal is None:
                raise
            # Slurm signals every process of the step (W&B's service too): an error that comes before the
            # requested stop must not turn a job that is to be requeued into a failed one. Stop as asked.
            logger.warning("site %d: %s after a stop request; stopping now", self.site_index, exc)
            trainer.checkpoint_after_error()
            stopper.finish(trainer.stop_signal)
            raise SystemExit(128 + trainer.stop_signal) from None
        # Leave the process group as torch asks (NCCL warns at exit otherwise). The abort a finished gloo rank
        # could hit at exit is not solved here (FSDP2 still holds the group): see SiteGroup's STOP broadcast.
        close_distributed()
        return result

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        logger.info(
            "site %d: preempted or timed out; requeueing (state is in its checkpoint directory)", self.site_index
        )
        return super().checkpoint(*args, **kwargs)
