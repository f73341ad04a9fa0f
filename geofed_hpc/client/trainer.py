"""One site's loop: join, pull, train for a wall-clock interval, push the delta, pull, checkpoint."""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from geofed_hpc import codec
from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.ckpt.best import BestCheckpoints
from geofed_hpc.client.checkpointing import Checkpointing
from geofed_hpc.client.deferred import Deferred
from geofed_hpc.client.joining import Joining
from geofed_hpc.client.resilience import HeartbeatClock, RidesOutages, push_budget
from geofed_hpc.client.runtime import build_runtime
from geofed_hpc.client.telemetry import RttMeter, SyncTimer, gpu_metrics, preemptions, rss_gb
from geofed_hpc.client.throttle import Throttle
from geofed_hpc.config import CodecConfig, RunConfig, to_dict
from geofed_hpc.errors import GeofedError, StaleError, UnavailableError
from geofed_hpc.log import logger
from geofed_hpc.metrics import Recorder
from geofed_hpc.paradigms.exchange import Params
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient

EXTRA_PULL_WAIT = timedelta(seconds=30)


class SiteTrainer(Checkpointing, Joining, RidesOutages):
    """Trains one site's model and keeps it in step with the parameter server. Its parts: checkpoints
    (checkpointing.py), join, seed, resume and pull (joining.py), riding out an unreachable PS (resilience.py)."""

    def __init__(self, cfg: RunConfig, site_index: int, ps_address: str) -> None:
        self.cfg = cfg
        self.index = site_index
        self.name = f"{cfg.site.name}-{site_index}"
        self.ps_address = ps_address
        self.dir = Path(cfg.run_dir) / "sites" / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        torch.set_num_threads(cfg.train.threads)
        torch.manual_seed(cfg.train.seed * 1000 + site_index)

        # rank, device, precision, the (FSDP2) model, this site's data, micro-batch; rank 0 leads the others
        resuming = CheckpointStore(self.dir / "ckpt", prefix="site").latest_step() is not None
        self.runtime = build_runtime(cfg, site_index, init=not resuming)  # resuming: weights come from disk
        self.group, self.rank = self.runtime.group, self.runtime.ranks.rank
        self.model, self.optimizer, self.sampler = self.runtime.model, self.runtime.optimizer, self.runtime.sampler
        self.paradigm = self.runtime.paradigm
        self.exchange = self.paradigm.exchange
        self.private = [n for n, _ in self.model.named_parameters() if self.exchange.is_private(n)]
        self.best = BestCheckpoints(self.dir / "ckpt" / "best", keep=cfg.train.keep_best)
        self.val_loss = math.nan
        self.qa: dict[str, float] = {}
        self._evaluated_at = -math.inf  # time.monotonic() of the last evaluation of the global model
        self.val_version = -1  # the version val_loss was measured at
        self._disk_model: Params = {}
        self.store = CheckpointStore(self.dir / "ckpt", prefix="site", keep=2)
        self.base: Params = {}
        self.base_global = True  # base is the PS's model at `version`, bit for bit (False: our pushed model)
        self.version = 0
        self.deferred = Deferred()  # work not pushed yet because the PS was unreachable (resilience.py)
        self.heartbeats = HeartbeatClock(cfg.ps.heartbeat_interval)
        self.client: PSClient | None = None
        self.rec: Recorder | None = None
        self._work_id = ""  # the push id of the work since the base: checkpoints holding that work record it
        self._attempt: tuple[m.PushHeader, bytes] | None = None  # the push in flight (its bytes, if unanswered)
        self._push_version = 0
        self.syncs = 0
        self.tokens_seen = 0
        self.session = m.JoinReply("", "", 0, False)
        # preemption: a stop request waits for a safe point of `phase` (see request_stop)
        self.phase = "idle"
        self.stop_signal: int | None = None
        self.on_stop: Callable[[int], None] = _exit_for
        self._carry: tuple[int, float, float] = (0, 0.0, 0.0)
        self._interval_start = 0.0
        self._syncs_after_push = 0
        self._first_step_done = False
        self.started = time.time()
        self.job_id = os.environ.get("SLURM_JOB_ID", "")
        self.restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        self.timer = SyncTimer()  # where the current sync's time went (telemetry.py)
        self.rtt = RttMeter()
        self.contribution_total = 0
        self.preemptions = 0
        self.throttle = Throttle(cfg.train.slowdown)  # train.slowdown: an emulated slower site

    # ---------------------------------------------------------------- preemption and requeue
    def request_stop(self, signum: int) -> bool:
        """Called from the signal handler; True when the caller may stop now.

        By `phase`: idle (the checkpoint on disk is current) stops now; wait (the delta is pushed) records
        that and stops now; train and busy (mid-step, mid-push) stop at the end of the step or the push.
        """
        self._event("signal", signal=signal.Signals(signum).name, phase=self.phase)
        if self.stop_signal is not None:
            return False  # already stopping at the next safe point
        self.stop_signal = self.group.signal = signum
        if self.rank != 0 or self.group.in_collective:
            return False  # several ranks: the site stops together at rank 0's next safe point (SiteGroup)
        if self.phase == "wait":  # the delta is pushed: record that, or a resume would push it again
            self._save(pushed=True)
        if self.phase not in ("idle", "wait"):
            return False
        self._event("stop", signal=signal.Signals(signum).name, syncs=self.syncs, version=self.version)
        return True

    def checkpoint_after_error(self) -> None:
        """An error came before the requested stop (Slurm stopped the W&B service already, say): after a push,
        record that it was pushed; mid-step or mid-push the last checkpoint stands (nothing applied twice)."""
        assert self.stop_signal is not None
        if self.rank == 0 and self.phase == "wait":
            self._save(pushed=True)
        self._event("stop", signal=signal.Signals(self.stop_signal).name, syncs=self.syncs, version=self.version)

    def _stop(self) -> None:
        assert self.stop_signal is not None
        self._event("stop", signal=signal.Signals(self.stop_signal).name, syncs=self.syncs, version=self.version)
        self.group.stop(self.stop_signal)
        self.on_stop(self.stop_signal)
        raise SystemExit(128 + self.stop_signal)

    def _after_step(self, steps: int, loss_sum: float) -> None:
        if not self._first_step_done:
            self._first_step_done = True
            self._event("first_step", resume_seconds=round(time.time() - self.started, 3))
        if self.stop_signal is not None:
            self._save(pending=self._pending(steps, loss_sum))
            self._stop()

    def _pushed(self) -> None:
        """The delta is in: until the next checkpoint (`_checkpointed`) a stop records `pushed`, leaves at once."""
        self.deferred.clear()
        self._syncs_after_push = self.syncs + 1
        self.phase = "wait"
        if self.stop_signal is not None:
            self._save(pushed=True)
            self._stop()

    def _checkpointed(self) -> None:
        self.phase = "idle"
        if self.stop_signal is not None:
            self._stop()

    def _event(self, event: str, **fields: Any) -> None:
        """One line in sites/<name>/events.jsonl: the job's life (first steps, signals, stops) for operators."""
        record = {"time": time.time(), "event": event, "job_id": self.job_id, "restarts": self.restarts, **fields}
        with open(self.dir / "events.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def evaluate(self) -> float:
        self._evaluated_at, self.val_version = time.monotonic(), self.version
        self.val_loss = self.group.evaluate()
        self.qa = self.group.qa_metrics()  # val/exact_match, val/f1 for a question-answering task
        return self.val_loss

    def _eval_due(self) -> bool:
        """train.eval_interval: evaluate the global model after this sync (always, when it is 0s)."""
        return time.monotonic() - self._evaluated_at >= self.cfg.train.eval_interval.total_seconds()

    def _train_interval(self, settings: m.RunSettings) -> tuple[int, float]:
        """Train until the interval ends (its time, its steps, a heartbeat saying push now); return the steps
        and mean loss since the base, deferred work included."""
        done, loss_sum, elapsed = self._carry  # a requeued job finishes the interval it was in
        self._carry = (0, 0.0, 0.0)
        held = self.deferred.steps  # intervals whose push failed go out with this one
        steps, loss_sum = done + held, loss_sum + self.deferred.loss_sum
        self._interval_start = time.monotonic() - elapsed
        deadline = self._interval_start + settings.sync_interval_s
        self.heartbeats.start()
        eval_every = self.cfg.train.eval_every
        self.phase = "train"
        self.paradigm.begin_round(self.version, settings.paradigm_seed, steps)
        while True:
            # every rank: its slice, micro-batches, one optimizer step on the paradigm's parameters of this step
            # (then train.slowdown's sleep, if any)
            step = functools.partial(self.group.step, self.paradigm.phase(steps))
            loss, tokens, signalled = self.throttle(step)
            if signalled and self.stop_signal is None:
                self.stop_signal = signalled  # another rank of this site was signalled: stop together
            steps += 1
            loss_sum += loss
            self.tokens_seen += tokens
            self._after_step(steps, loss_sum)
            if eval_every and self.sampler.draws % eval_every == 0:
                self._evaluate_local(steps, loss_sum)
            if settings.max_local_steps and steps - held >= settings.max_local_steps:
                break
            if settings.sync_interval_s > 0 and time.monotonic() >= deadline:
                break
            if self.heartbeats.due() and self._heartbeat_ends_interval(steps):
                break
        self.phase = "busy"
        return steps, loss_sum / steps

    def _pending(self, steps: int, loss_sum: float) -> dict[str, Any]:
        return {"steps": steps, "loss_sum": loss_sum, "elapsed_s": time.monotonic() - self._interval_start}

    def _evaluate_local(self, steps: int, loss_sum: float) -> None:
        """train.eval_every: the local model's validation loss. When it is among the train.keep_best lowest, a
        checkpoint (resumable: the part-interval is kept with its base) joins the best ones."""
        loss = self.group.evaluate()
        draws = self.sampler.draws
        if self.rec is not None:
            self.rec.log({"val/local_loss": loss, "train/step": draws, "sync/version": self.version})
        if self.best.would_keep(loss):
            path = self._save(pending=self._pending(steps, loss_sum))
            self.best.offer(path, loss, draws, name=f"{path.stem}-step{draws:09d}{path.suffix}")

    def _codec_state(self) -> tuple[codec.ErrorFeedback, codec.LinkAdaptive]:
        """This site's error-feedback residual and link-adaptive codec choice (made on first use)."""
        if not hasattr(self, "_feedback"):
            self._feedback = codec.ErrorFeedback()
            self._link = codec.LinkAdaptive(self.cfg.codec, self.name)
        return self._feedback, self._link

    def _push(self, client: PSClient, settings: m.RunSettings, steps: int, loss: float) -> tuple[int, int]:
        """Push local - base plus the residual the codec lost last time (error feedback); codec=adaptive picks
        the codec from the measured push throughput. After an outage the PS is first asked about the attempt whose
        reply never came (resilience.py): only work it does not hold goes out. Returns (bytes sent, raw bytes)."""
        self._attempt = None
        confirmed = self.deferred.attempt is not None and self._settle_unanswered(client)
        feedback, link = self._codec_state()
        d = self._remaining(self.paradigm.wire_update(self.group.model_arrays(), self.base))
        raw = sum(v.nbytes for v in d.values())
        steps -= self.deferred.applied_steps
        if confirmed and (steps == 0 or not self.paradigm.additive):
            if steps:
                logger.warning("%s: %s cannot push later steps apart: %d dropped", self.name, settings.paradigm, steps)
            elif self.paradigm.error_feedback:
                feedback.keep(d)  # nothing new: what the codec lost rides on the next delta
            return 0, raw
        name = settings.codec
        if name == "adaptive":
            name = link.choose(raw // 4, settings.sync_interval_s)
        c = self.cfg.codec
        cfg = CodecConfig(name, settings.block_size, c.zstd_level, stochastic_rounding=c.stochastic_rounding)
        t_enc = time.monotonic()
        if self.paradigm.error_feedback:
            payload, residual = feedback.encode(d, cfg)
        else:
            payload, residual = codec.encode(d, cfg), feedback.residual
        self.timer.encode_s += time.monotonic() - t_enc
        if not self._work_id:
            self._work_id = uuid.uuid4().hex
        header = m.PushHeader(
            self.session.session_id,
            self.version,
            steps,
            steps * self.sampler_tokens(),
            name,
            0,
            b"",
            self._work_id,  # every attempt of this work, and a resume from a checkpoint holding it, reuse it
            train_loss=loss,
        )
        self._attempt = (header, payload)  # unanswered (UnavailableError): _defer keeps it, to ask the PS about
        t0 = time.monotonic()
        reply = client.push_delta(header, payload, budget=push_budget(self.cfg.ps, self.deferred))
        self._attempt, self._work_id = None, ""
        link.observe(name, len(payload), raw // 4, time.monotonic() - t0)
        self.timer.push_s += time.monotonic() - t_enc
        self.timer.staleness = reply.staleness
        if reply.accepted:
            feedback.commit(residual)  # a refused push keeps the old residual; its delta is dropped
            self._push_version = reply.version
            if reply.duplicate:  # an earlier attempt of this work went in (before a restart, say): applied once
                logger.info("%s: the PS already holds push %s; not applied twice", self.name, header.push_id[:8])
            else:
                self.timer.contribution += header.tokens
                self.contribution_total += header.tokens
        else:
            logger.warning("%s: push not applied: %s", self.name, reply.reason)
        return len(payload), raw

    def _telemetry(self, client: PSClient, val_loss: float, sent: int, sync_s: float) -> dict[str, float | int]:
        """This sync's transfer, link, memory and contribution metrics; one Heartbeat measures the RTT and tells
        the PS the validation loss of the global model we just evaluated (its ps/global_val_loss)."""
        t0 = time.monotonic()
        reported = val_loss if val_loss > 0 and self.base_global else 0.0  # only the global model's loss
        try:
            client.heartbeat(m.HeartbeatRequest(self.session.session_id, self.version, val_loss=reported))
            rtt = self.rtt.add(time.monotonic() - t0)
        except GeofedError as exc:
            logger.warning("%s: heartbeat after the sync failed: %s", self.name, exc)
            rtt = {}
        return {
            **self.timer.metrics(sent, sync_s),
            **rtt,
            "site/contribution_total": self.contribution_total,
            "sys/rss_gb": rss_gb(),
            **gpu_metrics(),
            "job/preemptions": self.preemptions,
        }

    def sampler_tokens(self) -> int:
        return self.cfg.train.batch_size * self.cfg.model.context

    # ---------------------------------------------------------------- main loop
    def run(self) -> dict[str, Any]:
        """Rank 0 leads (talks to the PS, checkpoints); the other ranks follow its collectives."""
        if self.rank != 0:
            signum = self.group.follow()
            if signum < 0:
                raise GeofedError(f"{self.name}: rank 0 failed (see its log); rank {self.rank} leaves too")
            if signum:
                raise SystemExit(128 + signum)
            return {"site": self.name, "rank": self.rank}
        try:
            result = self._lead()
        except BaseException:
            self.group.stop(-1)  # the followers leave with an error (nothing is sent once stopped or broken)
            raise
        self.group.stop(0)
        return result

    def _lead(self) -> dict[str, Any]:
        cfg = self.cfg
        meta = self._load()
        self.preemptions = preemptions(self.dir / "events.jsonl", self.restarts)  # before this segment's events
        self._event("restored", checkpoint=meta is not None, seconds=round(time.time() - self.started, 3))
        with (
            PSClient(cfg.ps, self.ps_address) as client,
            Recorder(
                Path(cfg.run_dir) / "metrics",
                self.name,
                job_type="site",
                group=cfg.federation,
                wandb_mode=cfg.wandb_mode,
                config=to_dict(cfg),
            ) as rec,
        ):
            self.client, self.rec = client, rec
            client.keep_retrying = lambda: self.stop_signal is None  # a stop saves the unpushed work instead
            try:
                client.connect()
                self.session = self._join(client, meta)
                self._keep_token()
            except UnavailableError as exc:
                self.session = self._offline_session(meta, exc)  # train from the checkpoint, or raise exc
            settings = self.session.settings
            if not self.session.initialized:
                self._seed(client, int(meta["version"]) if meta else 0)
            resume = self._resume(client, meta, settings, rec)
            rec.log(
                {
                    "resume/source": resume,
                    "sync/version": self.version,
                    "resume/seconds": time.time() - self.started,
                    "job/preemptions": self.preemptions,
                }
            )
            self._event("ready", source=resume, version=self.version, seconds=round(time.time() - self.started, 3))
            if self.syncs == 0:
                rec.log({"val/loss": self.evaluate(), **self.qa, "sync/version": self.version, "sync/index": 0})
                if self.val_loss > 0:  # the PS's ps/global_val_loss starts at version 0 too
                    sid = self.session.session_id
                    try:
                        client.heartbeat(m.HeartbeatRequest(sid, self.version, val_loss=self.val_loss))
                    except GeofedError as exc:
                        logger.warning("%s: could not report the first evaluation: %s", self.name, exc)
            while not cfg.train.max_syncs or self.syncs < cfg.train.max_syncs:
                t0 = time.monotonic()
                self.timer = SyncTimer()
                steps, train_loss = self._train_interval(self.session.settings)  # a rejoin may change them
                train_s = time.monotonic() - t0
                t1 = time.monotonic()
                held, offline_s = self.deferred.intervals, self.deferred.offline_seconds()
                try:
                    sent, raw = self._push_or_rejoin(client, steps, train_loss)
                    self._pushed()
                    push_s = time.monotonic() - t1
                    self._pull_after_push(client, cfg.ps.round_timeout + EXTRA_PULL_WAIT)
                except StaleError as exc:
                    logger.warning("%s: %s; dropping this delta and pulling the latest model", self.name, exc)
                    self.deferred.clear()
                    sent, raw, push_s = 0, 0, time.monotonic() - t1
                    self._pull(client, 0, timedelta(0))
                except UnavailableError as exc:  # the push's retry budget is spent: train on, push later
                    self._defer(steps, train_loss, exc)
                    continue
                if held:
                    logger.info("%s: pushed %d steps trained while the PS was unreachable", self.name, steps)
                    self._event("deferred_pushed", steps=steps, intervals=held, offline_s=round(offline_s, 1))
                self.syncs += 1
                sync_s = time.monotonic() - t0
                evaluated = self._eval_due()
                val_loss = self.evaluate() if evaluated else math.nan  # NaN: not evaluated at this sync
                rec.log(
                    {
                        **self._telemetry(client, val_loss, sent, sync_s),
                        "sync/index": self.syncs,
                        "sync/version": self.version,
                        "sync/local_steps": steps,
                        "train/loss": train_loss,
                        **({"train/lr": self.group.lr} if self.group.lr is not None else {}),
                        **({"val/loss": val_loss, **self.qa} if evaluated else {}),
                        "train/tokens": self.tokens_seen,
                        "train/tokens_per_s": steps * self.sampler_tokens() / max(train_s, 1e-9),
                        "sync/bytes_sent": sent,
                        "sync/compression_ratio": raw / sent if sent else math.nan,
                        "sync/push_seconds": push_s,
                        "sync/deferred_intervals": held,
                        "sync/offline_seconds": offline_s,
                    }
                )
                self._save()
                self._checkpointed()
            try:
                client.heartbeat(m.HeartbeatRequest(self.session.session_id, self.version, leaving=True))
            except GeofedError as exc:
                logger.warning("%s: could not tell the PS we leave: %s", self.name, exc)
        final = self.val_loss  # the last evaluation's
        logger.info("%s: done after %d syncs at version %d, val loss %.4f", self.name, self.syncs, self.version, final)
        return {"site": self.name, "syncs": self.syncs, "version": self.version, "val_loss": final}


def _exit_for(signum: int) -> None:
    raise SystemExit(128 + signum)
