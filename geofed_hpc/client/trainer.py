"""One site's loop: join, pull, train for a wall-clock interval, push the delta, pull (or all of a sync in the
background while training goes on: overlap.py), checkpoint in the background."""

from __future__ import annotations

import functools
import math
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from geofed_hpc.client.checkpoints import Restored, SiteCheckpoints, SiteParts
from geofed_hpc.client.evaluation import Evaluation
from geofed_hpc.client.events import EventLog
from geofed_hpc.client.link import PSLink
from geofed_hpc.client.overlap import POLL_S, Flight, Overlap
from geofed_hpc.client.phase import Lifecycle, Phase, StopAction
from geofed_hpc.client.progress import Interval, Progress
from geofed_hpc.client.replica import Replica
from geofed_hpc.client.runtime import build_runtime
from geofed_hpc.client.split import SplitLink
from geofed_hpc.client.sync import SiteSync, Synced
from geofed_hpc.client.telemetry import SyncTimer
from geofed_hpc.client.throttle import Throttle
from geofed_hpc.client.uplink import Uplink
from geofed_hpc.config import RunConfig
from geofed_hpc.config.run import shareable
from geofed_hpc.egress.paths import announce as announce_path
from geofed_hpc.egress.paths import choose as choose_path
from geofed_hpc.egress.paths import record as record_path
from geofed_hpc.errors import ConfigError, GeofedError
from geofed_hpc.faults import fault
from geofed_hpc.log import logger
from geofed_hpc.metrics import Recorder
from geofed_hpc.paradigms.site import SplitSite
from geofed_hpc.rpc import messages as m


class SiteTrainer:
    """Trains one site's model and keeps it in step with the parameter server. It owns its parts: the runtime
    (ranks, model, data: runtime.py), the session with the PS (link.py), the base model (replica.py), pushes and
    work held through outages (uplink.py), one sync's protocol (sync.py; on a sender thread beside training with
    train.overlap: overlap.py), checkpoints (checkpoints.py),
    evaluation (evaluation.py), and the phase that decides when a stop signal may be honoured (phase.py)."""

    def __init__(self, cfg: RunConfig, site_index: int, ps_address: str) -> None:
        self.cfg = cfg
        self.name = f"{cfg.site.name}-{site_index}"
        directory = Path(cfg.run_dir) / "sites" / self.name
        directory.mkdir(parents=True, exist_ok=True)
        torch.set_num_threads(cfg.train.threads)
        torch.manual_seed(cfg.train.seed * 1000 + site_index)
        self.events = EventLog(directory / "events.jsonl")
        self.started = time.time()
        # rank, device, precision, the (FSDP2) model, this site's data, micro-batch; rank 0 leads the others
        resuming = SiteCheckpoints.exists(directory / "ckpt")
        self.runtime = build_runtime(cfg, site_index, init=not resuming)  # resuming: weights come from disk
        group, paradigm = self.runtime.group, self.runtime.paradigm
        private = [n for n, _ in self.runtime.model.named_parameters() if paradigm.exchange.is_private(n)]
        self.lifecycle = Lifecycle()
        self.on_stop: Callable[[int], None] = _exit_for
        self.progress, self.interval = Progress(), Interval()
        self.goodput = Goodput()
        self.evaluation = Evaluation(group, cfg.train.eval_interval, cfg.train.eval_budget)
        link = PSLink(cfg, self.name, directory, self.events)
        uplink = Uplink(
            cfg, self.name, self.events, self.progress, paradigm.additive, paradigm.error_feedback, self._record_push
        )
        replica = Replica(self.name, group, paradigm.exchange, private, self.events)
        split = None  # fsl_sage / split: the client part reaches the server part beside the PS through it
        if isinstance(paradigm, SplitSite):
            split = SplitLink(cfg, link, paradigm, self.events, lambda: replica.version)
            paradigm.attach(self.runtime.model, split)
        self.sync = SiteSync(cfg, link, replica, uplink, group, paradigm, safe=self, split=split)
        self.overlap = Overlap(self.sync) if cfg.train.overlap else None  # train.overlap: syncs beside training
        if self.overlap is not None and (paradigm.custom_step or not paradigm.additive or split is not None):
            raise ConfigError(f"train.overlap: paradigm={cfg.paradigm.name} cannot overlap its syncs (config/run.py)")
        parts = SiteParts(group, self.runtime.sampler, paradigm, replica, uplink, link, self.progress, self.evaluation)
        self.ckpt = SiteCheckpoints(cfg, directory / "ckpt", parts, self.events.job_id)
        # train.slowdown, train.step_time: an emulated slower site
        self.throttle = Throttle(cfg.train.slowdown, fixed=cfg.train.step_time.total_seconds())
        self.ps_address = ps_address

    @property
    def stop_signal(self) -> int | None:
        return self.lifecycle.stop_signal

    # ---------------------------------------------------------------- preemption and requeue
    def request_stop(self, signum: int) -> bool:
        """Called from the signal handler; True when the caller may stop now (phase.py says when)."""
        group = self.runtime.group
        self.events("signal", signal=signal.Signals(signum).name, phase=self.lifecycle.phase.value)
        action = self.lifecycle.request(signum)
        if action is StopAction.ALREADY:
            return False  # already stopping at the next safe point
        group.signal = signum
        if self.runtime.ranks.rank != 0 or group.in_collective:
            return False  # several ranks: the site stops together at rank 0's next safe point (SiteGroup)
        if action is StopAction.SAVE_PUSHED:  # the delta is in: record that, or a resume would push it again
            self.ckpt.settle()
            self.ckpt.save(pushed=True)
        if action is StopAction.LATER:
            return False
        self._stop_event()
        return True

    def checkpoint_after_error(self) -> None:
        """An error came before the requested stop (Slurm stopped the W&B service already, say): after a push,
        record that it was pushed; mid-step or mid-push the last checkpoint stands (nothing applied twice)."""
        assert self.stop_signal is not None
        self.ckpt.settle()  # a background write finishes first (only rank 0 writes one)
        if self.runtime.ranks.rank == 0 and self.lifecycle.phase is Phase.WAIT:
            self.ckpt.save(pushed=True)
        self._stop_event()

    def _stop_event(self) -> None:
        """The job leaves: the checkpoint being written in the background is on disk first (or, when its write
        failed, the previous one and the push record are what a resume reads)."""
        assert self.stop_signal is not None
        self.ckpt.settle()
        self.ckpt.leave()  # train.checkpoint_mirror: the last checkpoint reaches the mirror (bounded wait)
        name = signal.Signals(self.stop_signal).name
        self.events("stop", signal=name, syncs=self.progress.syncs, version=self.sync.version)

    def _stop(self) -> None:
        assert self.stop_signal is not None
        self._stop_event()
        self.runtime.group.stop(self.stop_signal)
        self.on_stop(self.stop_signal)
        raise SystemExit(128 + self.stop_signal)

    # ---------------------------------------------------------------- safe points (sync.SafePoints)
    def save(self, pending: dict[str, Any] | None = None) -> Path:
        return self.ckpt.save(pending)

    def busy(self) -> None:
        self.lifecycle.enter(Phase.BUSY)

    def pushed(self) -> None:
        """The delta is in: until the next checkpoint (`checkpointed`) a stop records `pushed`, leaves at once."""
        self.sync.uplink.deferred.clear()
        self.progress.syncs_after_push = self.progress.syncs + 1
        if self.lifecycle.enter(Phase.WAIT):
            self.ckpt.settle()
            self.ckpt.save(pushed=True)
            self._stop()

    def checkpointed(self) -> None:
        if self.lifecycle.enter(Phase.IDLE):
            self._stop()

    def _record_push(self, header: m.PushHeader) -> None:
        flight = self._flight
        if flight is not None:  # on the sender thread: what the site held at the push, not what it trained since
            draws, tokens, syncs = flight.at_push
        else:
            draws, tokens, syncs = self.runtime.sampler.draws, self.progress.tokens_seen, self.progress.syncs + 1
        self.ckpt.record_push(header, draws, tokens, syncs)

    def _after_step(self, steps: int, loss_sum: float) -> None:
        self.events.once("first_step", resume_seconds=round(time.time() - self.started, 3))
        fault("site.step", str(self.runtime.sampler.draws))
        if self.stop_signal is not None:
            self._stop_at(steps, loss_sum)

    def _stop_at(self, steps: int, loss_sum: float) -> None:
        """Stop at a step boundary: checkpoint the `steps` since the base (loss sum `loss_sum`) as unpushed work, and
        leave. With a push in flight (train.overlap), its outcome is settled first."""
        if self._flight is not None:
            steps, loss_sum = self._settle_flight(steps, loss_sum)
        self.ckpt.settle()
        self.ckpt.save(pending=self.interval.pending(steps, loss_sum) if steps else None)
        self._stop()

    # ---------------------------------------------------------------- training
    def _train_interval(self, settings: m.RunSettings) -> tuple[int, float]:
        """Train until the interval ends (its time, its steps, a heartbeat saying push now); return the steps
        and mean loss since the base, deferred work included."""
        group, deferred, link = self.runtime.group, self.sync.uplink.deferred, self.sync.link
        done, loss_sum = self.interval.begin()  # a requeued job finishes the interval it was in
        out = self._flight is not None  # a push in flight carries the work held before it
        held = 0 if out else deferred.steps  # intervals whose push failed go out with this one
        steps, loss_sum = done + held, loss_sum + (0.0 if out else deferred.loss_sum)
        deadline = self.interval.start + settings.sync_interval_s
        link.heartbeats.start()
        eval_every = self.cfg.train.eval_every
        self.lifecycle.enter(Phase.TRAIN)
        self.runtime.paradigm.begin_round(self.sync.version, settings.paradigm_seed, steps)
        while True:
            # every rank: its slice, micro-batches, one optimizer step on the paradigm's parameters of this step
            # (then train.slowdown's sleep, if any)
            step = functools.partial(group.step, self.runtime.paradigm.phase(steps))
            started = time.monotonic()
            loss, tokens, signalled = self.throttle(step)
            self.goodput.add(started, time.monotonic())
            if signalled:
                self.lifecycle.request(signalled)  # another rank of this site was signalled: stop together
            steps += 1
            loss_sum += loss if math.isfinite(loss) else 0.0  # a skipped step (NaN/Inf) trained nothing
            self.progress.tokens_seen += tokens
            self._after_step(steps, loss_sum)
            flight = self._flight
            if flight is not None and flight.done:  # the version our push made is here: move onto it
                given, given_loss = self._land(steps, loss_sum)
                steps, held, loss_sum = steps + given, held + given, loss_sum + given_loss
            out = self._flight is not None
            if eval_every and self.runtime.sampler.draws % eval_every == 0:
                self._evaluate_local()
            if settings.max_local_steps and steps - held >= settings.max_local_steps:
                break
            if settings.sync_interval_s > 0 and time.monotonic() >= deadline:
                break
            if not out and link.interval_ends(steps, self.sync.version, deferred):
                break
        self.throttle.settle()  # train.slowdown: the emulated time per step is fixed from the first interval on
        steps, loss_sum = self._wait_flight(steps, loss_sum)  # at most one push in flight: wait for the one out
        self.lifecycle.enter(Phase.BUSY)
        return steps, loss_sum / steps

    def _evaluate_local(self) -> None:
        """train.eval_every: the local model's validation loss. When it is among the train.keep_best lowest, the
        local model's weights join the best ones (the latest checkpoints stay the ones a resume reads)."""
        loss = self.runtime.group.evaluate()
        draws = self.runtime.sampler.draws
        if self.sync.rec is not None:
            self.sync.rec.log({"val/local_loss": loss, "train/step": draws, "sync/version": self.sync.version})
        latest = self.ckpt.store.path_for(self.progress.syncs)
        self.ckpt.keep_best(loss, draws, f"{latest.stem}-step{draws:09d}{latest.suffix}", global_model=False)

    # ---------------------------------------------------------------- main loop
    def run(self) -> dict[str, Any]:
        """Rank 0 leads (talks to the PS, checkpoints); the other ranks follow its collectives."""
        group, rank = self.runtime.group, self.runtime.ranks.rank
        if rank != 0:
            signum = group.follow()
            if signum < 0:
                raise GeofedError(f"{self.name}: rank 0 failed (see its log); rank {rank} leaves too")
            if signum:
                raise SystemExit(128 + signum)
            return {"site": self.name, "rank": rank}
        try:
            result = self._lead()
        except BaseException:
            group.stop(-1)  # the followers leave with an error (nothing is sent once stopped or broken)
            raise
        group.stop(0)
        return result

    def _lead(self) -> dict[str, Any]:
        cfg = self.cfg
        restored = self.ckpt.load(fresh=None if self.runtime.initialized else self.runtime.initial_arrays)
        self.events("restored", checkpoint=restored is not None, seconds=round(time.time() - self.started, 3))
        recorder = Recorder(
            Path(cfg.run_dir) / "metrics",
            self.name,
            job_type="site",
            group=cfg.federation,
            wandb_mode=cfg.wandb_mode,
            config=shareable(cfg),
        )
        route = choose_path(cfg, self.ps_address)  # site.egress: direct, proxy, relay, tunnel or spool
        record_path(Path(cfg.run_dir), self.name, route)
        with route, route.connect() as client, recorder as rec:
            announce_path(rec, route)
            self.sync.link.client, self.sync.rec = client, rec
            client.keep_retrying = lambda: self.stop_signal is None  # a stop saves the unpushed work instead
            self._start(restored, rec)
            restored = None  # its arrays map the checkpoint file (ckpt/tensorfile.py): the base keeps what it needs
            while not cfg.train.max_syncs or self.progress.syncs < cfg.train.max_syncs:
                self._sync_once(rec)
            self.ckpt.flush()  # the last checkpoint is on disk before the PS hears we leave
            self.sync.settle_report()  # ... and the last sync's report (train.overlap sends it beside training)
            self.sync.link.leave(self.sync.version)
        self.events("goodput", **self.goodput.summary(), tokens=self.progress.tokens_seen)
        final = self.evaluation.val_loss  # the last evaluation's
        syncs, version = self.progress.syncs, self.sync.version
        logger.info("%s: done after %d syncs at version %d, val loss %.4f", self.name, syncs, version, final)
        return {"site": self.name, "syncs": syncs, "version": version, "val_loss": final}

    def _start(self, restored: Restored | None, rec: Recorder) -> None:
        """Join (or train on from the checkpoint while the PS is unreachable), seed an empty PS, resume."""
        link, meta = self.sync.link, restored.meta if restored else None
        session = link.start(meta)
        if not session.initialized:
            link.seed(self.sync.replica.seed_arrays(), restored.version if restored else 0)
        elif restored is not None and session.version < restored.version and self.sync.replica.base:
            self.sync.replica.version = restored.version  # the PS is behind our checkpoint's base: the freshest wins
            self.sync.reseed_if_behind(session.version)
        if self._pushed_after(restored):
            resume = "global"
        else:
            resume = self.sync.resume(restored, self.interval, self.progress)
        seconds = time.time() - self.started
        rec.log(
            {
                **self.runtime.describe(),
                "resume/source": resume,
                "sync/version": self.sync.version,
                "resume/seconds": seconds,
                "job/preemptions": self.events.preemptions,
            }
        )
        self.events("ready", source=resume, version=self.sync.version, seconds=round(seconds, 3))
        if self.progress.syncs == 0:
            val_loss = self.evaluation.run(self.sync.version)
            rec.log({"val/loss": val_loss, **self.evaluation.qa, "sync/version": self.sync.version, "sync/index": 0})
            self.sync.report_first(val_loss)

    def _pushed_after(self, restored: Restored | None) -> bool:
        """The job was stopped after a push went out and before the checkpoint after it (push.json is newer than
        the checkpoint), or it was restored from a mirror whose newest checkpoint lags several pushes behind (the
        mirror's push log). The newest of those pushes the PS applied holds all the work before it in the global
        model: its batches and those before are skipped, not trained and pushed again, and the site goes on from
        the global model. False: nothing of the kind."""
        records = self.ckpt.push_records(restored)
        if not records or self.sync.link.client is None or not self.sync.link.session.initialized:
            return False
        for record in records:  # newest first
            try:
                link, push_id = self.sync.link, str(record["push_id"])
                reply = self.sync.uplink.ask(link.connected(), link.session_id, int(record["base_version"]), push_id)
            except GeofedError as exc:  # the PS does not answer: the checkpoint's own work goes out as usual
                logger.warning("%s: cannot ask the PS about our last push (%s)", self.name, exc)
                return False
            self.events("push_after_checkpoint", push_id=record["push_id"], state=reply.push or "not held")
            if reply.push == "applied":
                break
        else:
            return False
        sampler, progress = self.runtime.sampler, self.progress
        logger.info(
            "%s: our push %s went in before the stop: its %d batches (and those before) are skipped, not trained again",
            self.name,
            str(record["push_id"])[:8],
            int(record["draws"]) - sampler.draws,
        )
        sampler.draws = int(record["draws"])
        progress.tokens_seen = max(progress.tokens_seen, int(record["tokens_seen"]))
        progress.syncs = max(progress.syncs, int(record["syncs"]))
        progress.contribution_total += int(record["tokens"])
        self.sync.uplink.deferred.clear()
        self.sync.replica.base = {}  # the checkpoint's base is behind: take the global model whole
        self.sync.pull(0, timedelta(0))
        self.ckpt.save()
        self.checkpointed()
        return True

    # ---------------------------------------------------------------- overlapped syncs (train.overlap)
    @property
    def _flight(self) -> Flight | None:
        """The overlapped sync whose push or pull is still out, if any."""
        return self.overlap.flight if self.overlap is not None else None

    def _sync_overlapped(self) -> None:
        """Train one interval (moving onto the version the previous push made when it arrives, waiting for it at the
        interval's end at the latest), then hand this interval's work to the sender and train on. The run's last
        push is waited for: nothing is trained after it."""
        assert self.overlap is not None
        t0 = time.monotonic()
        steps, train_loss = self._train_interval(self.sync.link.settings)  # a rejoin may change them
        train_s = time.monotonic() - t0
        self.ckpt.flush()  # the push record follows the newest complete checkpoint; no write runs beside the sender
        at_push = (self.runtime.sampler.draws, self.progress.tokens_seen, self.progress.syncs + 1)
        self.overlap.start(steps, train_loss, train_s, at_push)
        if self.lifecycle.enter(Phase.IDLE):  # a stop came while the work was handed over
            self._stop_at(0, 0.0)
        if self.cfg.train.max_syncs and self.progress.syncs + 1 >= self.cfg.train.max_syncs:
            self._wait_flight(0, 0.0)

    def _wait_flight(self, steps: int, loss_sum: float) -> tuple[int, float]:
        """Wait for the flight still out, if any, and land it (a stop meanwhile is honoured); the interval's steps and
        loss sum since the base after it (a deferred push gives its work back)."""
        while (flight := self._flight) is not None:
            if flight.finished.wait(POLL_S):
                given, given_loss = self._land(steps, loss_sum)
                steps, loss_sum = steps + given, loss_sum + given_loss
            elif self.stop_signal is not None:
                self._stop_at(steps, loss_sum)
        return steps, loss_sum

    def _settle_flight(self, steps: int, loss_sum: float) -> tuple[int, float]:
        """A stop with a push in flight: wait for the push's outcome (a stopping client retries no more). Back whole:
        land it. Confirmed with its pull still out: the anchor is the base at the version the push made and the
        `steps` since the push are the work since it (what a lost pull leaves today). The steps and loss sum since
        the base, which the stop checkpoints as unpushed work."""
        assert self.overlap is not None
        if self.overlap.push_known():
            given, given_loss = self._land(steps, loss_sum, stopping=True)
            return steps + given, loss_sum + given_loss
        self.overlap.adopt_anchor()
        self.sync.uplink.deferred.clear()
        self.progress.syncs += 1
        self.events("overlap_stop", version=self.sync.version, steps_since_push=steps)
        return steps, loss_sum

    def _land(self, steps: int, loss_sum: float, stopping: bool = False) -> tuple[int, float]:
        """The flight is back at a step boundary, `steps` trained since its push (loss sum `loss_sum`). Pushed: move
        onto the version it made keeping those steps, count the sync, evaluate the global model when due, log and
        checkpoint (the steps since the push as unpushed work against the new base). Deferred: its work stays against
        the base; it is returned (steps, loss sum) to go out with this interval's. Else (0, 0.0)."""
        assert self.overlap is not None and self.overlap.flight is not None
        flight = self.overlap.flight
        evaluate = not stopping and self.evaluation.due(last=self.progress.syncs + 1 == self.cfg.train.max_syncs)
        val_loss, evaluated = math.nan, False  # NaN: not evaluated

        def on_global(version: int) -> None:
            nonlocal val_loss, evaluated
            val_loss, evaluated = self.evaluation.run(version), True

        self.overlap.land(steps, on_global if evaluate else None)
        deferred = self.sync.uplink.deferred
        if flight.synced is None:
            if self.sync.rec is not None:
                self.sync.rec.log({"sync/deferred_intervals": deferred.intervals, "sync/version": self.sync.version})
            if not stopping:
                pending = self.interval.pending(steps + deferred.steps, loss_sum + deferred.loss_sum)
                self.ckpt.save({**pending, "overlap": "deferred"})
            return deferred.steps, deferred.loss_sum
        deferred.clear()
        self.progress.syncs += 1
        self.events("landed", version=self.sync.version, steps_since_push=steps, exact=self.sync.replica.exact)
        sync_s = flight.train_s + time.monotonic() - flight.started
        self._record_sync(flight.steps, flight.loss, flight.synced, flight.train_s, sync_s, val_loss, evaluated)
        if stopping:
            return 0, 0.0
        if steps:  # mid-interval: the work since the push is unpushed work against the new base
            pending = {**self.interval.pending(steps, loss_sum), "overlap": "landed"}
            self.ckpt.save(pending, background=self.cfg.train.background_checkpoint)  # off the training path
        else:
            self.ckpt.save(background=self.cfg.train.background_checkpoint)
        return 0, 0.0

    # ---------------------------------------------------------------- blocking syncs
    def _sync_once(self, rec: Recorder) -> None:
        """Train one interval, push its work and pull (or defer it), evaluate when due, log, checkpoint."""
        if self.overlap is not None:
            self._sync_overlapped()
            return
        t0 = time.monotonic()
        self.sync.timer = SyncTimer()
        steps, train_loss = self._train_interval(self.sync.link.settings)  # a rejoin may change them
        train_s = time.monotonic() - t0
        synced = self.sync.exchange(steps, train_loss)
        if synced is None:  # deferred: checkpointed, the next interval retries
            return
        self.progress.syncs += 1
        sync_s = time.monotonic() - t0
        evaluated = self.evaluation.due(last=self.progress.syncs == self.cfg.train.max_syncs)
        val_loss = self.evaluation.run(self.sync.version) if evaluated else math.nan  # NaN: not evaluated
        self._record_sync(steps, train_loss, synced, train_s, sync_s, val_loss, evaluated)
        self.ckpt.save(background=self.cfg.train.background_checkpoint)  # written while the next interval trains
        self.checkpointed()

    def _record_sync(
        self,
        steps: int,
        train_loss: float,
        synced: Synced,
        train_s: float,
        sync_s: float,
        val_loss: float,
        evaluated: bool,
    ) -> None:
        """One sync's metrics record and log line (`evaluated`: the global model's `val_loss` was measured)."""
        rec = self.sync.rec
        assert rec is not None
        lr = self.runtime.group.lr
        stepper = self.runtime.group.stepper
        goodput = self.goodput.value()
        rec.log(
            {
                # an overlapped landing's heartbeat goes out beside training, not on its path
                **self.sync.telemetry(val_loss, synced.sent, sync_s, self.progress, goodput, self.overlap is not None),
                "job/preemptions": self.events.preemptions,
                "sync/index": self.progress.syncs,
                "sync/version": self.sync.version,
                "sync/local_steps": steps,
                "train/loss": train_loss,
                **({"train/lr": lr, "train/grad_norm": stepper.grad_norm} if lr is not None else {}),
                "train/skipped_steps": stepper.skipped,
                **({"val/loss": val_loss, **self.evaluation.qa} if evaluated else {}),
                "train/tokens": self.progress.tokens_seen,
                "train/tokens_per_s": steps * self.sync.tokens_per_step() / max(train_s, 1e-9),
                "sync/bytes_sent": synced.sent,
                "sync/compression_ratio": synced.raw / synced.sent if synced.sent else math.nan,
                "sync/push_seconds": synced.push_s,
                "sync/deferred_intervals": synced.held,
                "sync/offline_seconds": synced.offline_s,
                "site/goodput": goodput,
            }
        )
        self._log_sync(steps, train_loss, val_loss, synced.sent, train_s, sync_s, goodput)

    def _log_sync(
        self, steps: int, loss: float, val_loss: float, sent: int, train_s: float, sync_s: float, goodput: float
    ) -> None:
        """One line of the job's log per sync: version, losses, tokens, bytes sent, seconds and goodput."""
        tokens = steps * self.sync.tokens_per_step()
        val = f", val loss {val_loss:.4f}" if math.isfinite(val_loss) else ""
        logger.info(
            "%s: sync %d: version %d, %d steps, train loss %.4f%s, %d tokens (%.0f tokens/s, %d in all), "
            "sent %.2f MiB, %.1fs (%.1fs training), goodput %.2f",
            self.name,
            self.progress.syncs,
            self.sync.version,
            steps,
            loss,
            val,
            tokens,
            tokens / max(train_s, 1e-9),
            self.progress.tokens_seen,
            sent / 2**20,
            sync_s,
            train_s,
            goodput,
        )


class Goodput:
    """site/goodput: seconds inside training steps over wall seconds since this job's first step began (syncs,
    evaluations, checkpoint writes and waits for the PS are what keeps it under 1)."""

    def __init__(self) -> None:
        self.first: float | None = None  # time.monotonic() when the first step began
        self.last = 0.0  # ... and when the latest one ended
        self.step_s = 0.0

    def add(self, started: float, ended: float) -> None:
        """One training step (its slow-down included) ran from `started` to `ended`."""
        if self.first is None:
            self.first = started
        self.step_s += ended - started
        self.last = ended

    def summary(self) -> dict[str, float]:
        """For the job's events (benchmarks read it): step seconds, and wall seconds from the first step's start to
        the last step's end."""
        wall = self.last - self.first if self.first is not None else 0.0
        return {"step_seconds": round(self.step_s, 4), "wall_seconds": round(wall, 4)}

    def value(self, now: float | None = None) -> float:
        """The share so far (NaN before the first step)."""
        if self.first is None:
            return math.nan
        wall = (time.monotonic() if now is None else now) - self.first
        return min(1.0, self.step_s / wall) if wall > 0 else 1.0


def _exit_for(signum: int) -> None:
    raise SystemExit(128 + signum)
