"""One site's loop: join, pull, train for a wall-clock interval, push the delta, pull, checkpoint."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from geofed_hpc import codec
from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.ckpt.best import BestCheckpoints
from geofed_hpc.ckpt.secret import read_secret, write_secret
from geofed_hpc.client.params import Arrays
from geofed_hpc.client.resilience import Deferred, HeartbeatClock, RidesOutages, push_budget
from geofed_hpc.client.runtime import build_runtime
from geofed_hpc.client.telemetry import RttMeter, SyncTimer, gpu_metrics, preemptions, rss_gb
from geofed_hpc.client.throttle import Throttle
from geofed_hpc.config import CodecConfig, RunConfig, to_dict
from geofed_hpc.errors import (
    AuthError,
    CheckpointError,
    CodecError,
    GeofedError,
    ProtocolError,
    StaleError,
    UnavailableError,
)
from geofed_hpc.log import logger
from geofed_hpc.metrics import Recorder
from geofed_hpc.paradigms import Exchange
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient

EXTRA_PULL_WAIT = timedelta(seconds=30)


def apply_updates(base: Arrays, header: m.ModelHeader, payload: bytes, exchange: Exchange | None = None) -> Arrays:
    """Add the PS's encoded global updates (header.segments, in version order) to `base` in place, the same
    float32 adds the PS made (each update expanded by the paradigm as the PS does), so `base` stays
    bit-identical to the global model."""
    if sum(header.segments) != len(payload):
        raise ProtocolError(f"update segments add up to {sum(header.segments)} bytes, the payload has {len(payload)}")
    exchange = exchange or Exchange()
    shapes = {k: tuple(v.shape) for k, v in base.items()}
    expected = {k: (s, "float32") for k, s in exchange.wire_spec(shapes).items()}
    view, pos = memoryview(payload), 0
    for i, size in enumerate(header.segments):
        update = codec.decode(view[pos : pos + size], expected=expected)  # type: ignore[arg-type]
        for k, v in exchange.expand(update, header.base_version + i, shapes).items():
            base[k] += v
        pos += size
    return base


@dataclass
class SyncResult:
    version: int
    local_steps: int
    train_loss: float
    val_loss: float
    bytes_sent: int
    raw_bytes: int


class SiteTrainer(RidesOutages):
    """Trains one site's model and keeps it in step with the parameter server."""

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
        self._disk_model: Arrays = {}
        self.store = CheckpointStore(self.dir / "ckpt", prefix="site", keep=2)
        self.base: Arrays = {}
        self.base_global = True  # base is the PS's model at `version`, bit for bit (False: our pushed model)
        self.version = 0
        self.deferred = Deferred()  # work not pushed yet because the PS was unreachable (resilience.py)
        self.heartbeats = HeartbeatClock(cfg.ps.heartbeat_interval)
        self.client: PSClient | None = None
        self.rec: Recorder | None = None
        self._push_id = ""
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

    # ---------------------------------------------------------------- checkpoints
    def _save(self, pending: dict[str, Any] | None = None, pushed: bool = False) -> Path:
        """Checkpoint; `pending`: unpushed work (kept with its base, and what of it is deferred), `pushed`: the
        delta is in. Returns the file written."""
        tensors: dict[str, np.ndarray] = {f"model/{k}": v for k, v in self.group.model_arrays().items()}
        tensors.update(self.group.optimizer_arrays())  # optim/<param>/<key>, gathered from every rank
        tensors.update(self.group.rng_state())
        if pending:  # the model is ahead of its base: resuming must be able to push local - base
            tensors.update({f"base/{k}": v for k, v in self.base.items()})
            # the id its push will carry: a job killed after that push went in, before the next checkpoint,
            # resends it from this checkpoint under the same id, and the PS does not apply it twice
            pending = {
                **pending,
                "deferred": self.deferred.to_meta(),
                "push_id": pending.get("push_id") or uuid.uuid4().hex,
            }
        tensors.update(self._codec_state()[0].state())  # residual/<param>: error feedback survives a requeue
        tensors.update(self.paradigm.state())  # the unpushed part of a round the paradigm keeps (zo's coefficients)
        syncs = self._syncs_after_push if pushed else self.syncs
        meta = {
            "version": self.version,
            "syncs": syncs,
            "tokens_seen": self.tokens_seen,
            "sampler": self.sampler.state_dict(),
            "session_id": self.session.session_id,
            "settings": dataclasses.asdict(self.session.settings),  # to train on if the PS is down at restart
            "pending": pending,
            "job_id": self.job_id,
            "global_model": not pending and not pushed and self.base_global,  # the PS's model at `version`
            "base_global": self.base_global,
            "val_loss": self.val_loss,
            "contribution_total": self.contribution_total,
            "scaler": self.group.stepper.scaler_state(),
            "model": _shape(self.cfg),
        }
        path = self.store.save(syncs, tensors, meta)
        if meta["global_model"]:
            self.best.offer(path, self.val_loss, syncs)
        return path

    def _load(self) -> dict[str, Any] | None:
        loaded = self.store.load_latest()
        if loaded is None:
            if not self.runtime.initialized:  # every checkpoint was unreadable: start from fresh weights
                self.group.load_model(self.runtime.initial_arrays())
            return None
        tensors, meta, path = loaded
        theirs = {"paradigm": "identity", **meta.get("model", _shape(self.cfg))}  # older checkpoints: pretraining
        if theirs != _shape(self.cfg):
            ours = _shape(self.cfg)
            diff = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
            key = diff[0] if diff[0] == "paradigm" else f"model.{diff[0]}"
            raise CheckpointError(
                f"checkpoint {path} is of another model ({key}={theirs.get(diff[0])!r}, this run has "
                f"{ours.get(diff[0])!r}): use its config, or move {self.store.directory} away to start afresh"
            )
        self._disk_model = {k[6:]: v for k, v in tensors.items() if k.startswith("model/")}
        self.group.load_model(self._disk_model)
        self.group.load_optimizer({k: v for k, v in tensors.items() if k.startswith("optim/")})
        self.group.set_rng_state(tensors)
        self.group.set_scaler_state(meta.get("scaler") or {})
        self.base = {k[5:]: v for k, v in tensors.items() if k.startswith("base/")}
        self.base_global = bool(meta.get("base_global", True))
        self._codec_state()[0].load(tensors)
        self.paradigm.load_state(tensors)
        self.sampler.load_state_dict(meta["sampler"])
        self.syncs, self.tokens_seen = int(meta["syncs"]), int(meta["tokens_seen"])
        self.contribution_total = int(meta.get("contribution_total", 0))
        pending = meta.get("pending")
        logger.info(
            "%s: loaded local checkpoint %s (version %d, %d syncs%s)",
            self.name,
            path,
            meta["version"],
            self.syncs,
            f", {pending['steps']:g} unpushed steps" if pending else "",
        )
        return meta

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

    def _resume(self, client: PSClient, meta: dict[str, Any] | None, settings: m.RunSettings, rec: Recorder) -> str:
        """Continue an interrupted interval, or push its work and take the live model when that is fresher."""
        pending = meta.get("pending") if meta else None
        self.deferred = Deferred.from_meta(pending.get("deferred") if pending else None)
        if meta and pending and int(meta["version"]) == self.session.version:
            self.version, held = int(meta["version"]), self.deferred
            steps, loss_sum = int(pending["steps"]) - held.steps, float(pending["loss_sum"]) - held.loss_sum
            self._carry = (steps, loss_sum, float(pending["elapsed_s"]))  # deferred work goes out with it
            return "local"
        if meta and pending:
            self.version, steps = int(meta["version"]), int(pending["steps"])
            self.phase = "busy"
            try:
                loss = float(pending["loss_sum"]) / steps
                sent, _ = self._push(client, settings, steps, loss, str(pending.get("push_id", "")))
                self._pushed()
                self.syncs += 1
                rec.log(
                    {
                        "sync/index": self.syncs,
                        "sync/version": self.version,
                        "sync/local_steps": steps,
                        "train/loss": float(pending["loss_sum"]) / steps,
                        "sync/bytes_sent": sent,
                    }
                )
            except StaleError as exc:
                logger.warning("%s: %s; the %d steps before the requeue are dropped", self.name, exc, steps)
                self.deferred.clear()
        if not self._disk_is_current(meta):
            self._pull(client, 0, timedelta(0))
        if pending:
            self._save()
        self._checkpointed()
        return "fresh" if not meta else "local" if int(meta["version"]) == self.version else "global"

    # ---------------------------------------------------------------- protocol steps
    def _join(self, client: PSClient, meta: dict[str, Any] | None) -> m.JoinReply:
        paradigm = self.cfg.paradigm.describe()  # the PS refuses a site whose paradigm differs from its own
        if meta and meta.get("session_id"):
            try:
                token = read_secret(self.dir / "rejoin.json").get("rejoin_token") or meta.get("rejoin_token", "")
                request = m.JoinRequest(self.name, token, resume_session=meta["session_id"], paradigm=paradigm)
                return client.join(request)
            except AuthError as exc:
                logger.info("%s: rejoin refused (%s); enrolling again", self.name, exc)
        return client.join(m.JoinRequest(self.name, self.cfg.site.token, paradigm=paradigm))

    def _pull(self, client: PSClient, min_version: int, wait: timedelta) -> None:
        """Take the global model: only the PS's encoded updates since our version when it still keeps them
        (self.base stays bit-identical to the PS), the full model otherwise."""
        have = self.version if self.base and self.base_global else None
        t0 = time.monotonic()
        header, payload = client.pull_model(self.session.session_id, min_version, wait, have_version=have)
        self.timer.pull_s += time.monotonic() - t0
        self.timer.wait_s += client.last_pull_wait_s
        self.timer.bytes_received += len(payload)
        if header.kind == "updates":
            try:
                if header.base_version != have:
                    raise ProtocolError(f"updates start at version {header.base_version}, we hold {have}")
                arrays = apply_updates(self.base, header, payload, self.exchange)
            except (CodecError, ProtocolError) as exc:
                logger.warning("%s: cannot apply the global updates (%s); pulling the full model", self.name, exc)
                self.base = {}
                self._pull(client, min_version, timedelta(0))
                return
        else:
            arrays = codec.decode(payload)
            if have is not None and header.version < have:
                logger.warning("%s: the PS is back at version %d (we held %d)", self.name, header.version, have)
        self.group.load_model(self._with_private(arrays))
        self.base, self.version, self.base_global = arrays, header.version, True

    def _with_private(self, arrays: Arrays) -> Arrays:
        """The global model plus this site's private tensors (hybrid_lora's adapters), which it never sends."""
        if not self.private:
            return arrays
        local = self.group.model_arrays()
        return {**{k: np.array(local[k], copy=True) for k in self.private}, **arrays}

    def _seed(self, client: PSClient, meta: dict[str, Any] | None) -> None:
        """The PS holds no model: upload ours (bootstrap), or re-seed it from this site's checkpoint."""
        version = int(meta["version"]) if meta else 0
        arrays = self.base if self.base else self.exchange.public(self.group.model_arrays())
        if version > 0:
            logger.warning("%s: the PS has no model; re-seeding it from our checkpoint (v%d)", self.name, version)
            self._event("reseed", version=version)
        init = codec.encode(arrays, CodecConfig(name="fp32"))
        header = m.PushHeader(self.session.session_id, version, 0, 0, "fp32", 0, b"", "", init=True)
        reply = client.push_delta(header, init)
        if reply.accepted:
            self.session.version = reply.version
        else:
            logger.info("%s: the global model was seeded by another site first (%s)", self.name, reply.reason)

    def evaluate(self) -> float:
        self.val_loss = self.group.evaluate()
        self.qa = self.group.qa_metrics()  # val/exact_match, val/f1 for a question-answering task
        return self.val_loss

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

    def _push(
        self, client: PSClient, settings: m.RunSettings, steps: int, loss: float, push_id: str = ""
    ) -> tuple[int, int]:
        """Push local - base plus the residual the codec lost last time (error feedback); codec=adaptive picks
        the codec from the measured push throughput. `push_id`: the id a checkpoint gave this work."""
        d = self.paradigm.wire_update(self.group.model_arrays(), self.base)  # only the exchanged tensors
        raw = sum(v.nbytes for v in d.values())
        feedback, link = self._codec_state()
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
        header = m.PushHeader(
            self.session.session_id,
            self.version,
            steps,
            steps * self.sampler_tokens(),
            name,
            0,
            b"",
            self.deferred.push_id or push_id or uuid.uuid4().hex,  # one id for every attempt of this work
            train_loss=loss,
        )
        self._push_id = header.push_id
        t0 = time.monotonic()
        reply = client.push_delta(header, payload, budget=push_budget(self.cfg.ps, self.deferred))
        link.observe(name, len(payload), raw // 4, time.monotonic() - t0)
        self.timer.push_s += time.monotonic() - t_enc
        self.timer.staleness = reply.staleness
        if reply.accepted:
            feedback.commit(residual)  # a refused push keeps the old residual; its delta is dropped
            self._push_version = reply.version
            if reply.duplicate and self.deferred.active:
                logger.warning(
                    "%s: an earlier attempt of this push reached the PS (its reply was lost): it is applied once; "
                    "the steps trained after that attempt are not in the global model",
                    self.name,
                )
            if not reply.duplicate:
                self.timer.contribution = header.tokens
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

    def _disk_is_current(self, meta: dict[str, Any] | None) -> bool:
        """A checkpoint holding the global model is our base at its version: skip the pull when the PS is still
        there, else pull only what is newer (the PS's updates since that version, when it keeps them)."""
        if not meta or meta.get("pending") or not meta.get("global_model") or not self._disk_model:
            return False
        self.base, self.version = self.exchange.public(self._disk_model), int(meta["version"])
        return self.version == self.session.version

    def _keep_token(self) -> None:
        """The one-time rejoin token lives in a 0600 file, rewritten as soon as a Join hands out a new one."""
        token = {"session_id": self.session.session_id, "rejoin_token": self.session.rejoin_token}
        write_secret(self.dir / "rejoin.json", token)

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
                self._seed(client, meta)
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
            results = []
            while not cfg.train.max_syncs or self.syncs < cfg.train.max_syncs:
                t0 = time.monotonic()
                self.timer = SyncTimer()
                steps, train_loss = self._train_interval(settings)
                train_s = time.monotonic() - t0
                t1 = time.monotonic()
                held, offline_s = self.deferred.intervals, self.deferred.offline_seconds()
                try:
                    sent, raw = self._push(client, settings, steps, train_loss)
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
                val_loss = self.evaluate()
                result = SyncResult(self.version, steps, train_loss, val_loss, sent, raw)
                results.append(result)
                rec.log(
                    {
                        **self._telemetry(client, val_loss, sent, sync_s),
                        "sync/index": self.syncs,
                        "sync/version": self.version,
                        "sync/local_steps": steps,
                        "train/loss": train_loss,
                        "val/loss": val_loss,
                        **self.qa,
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
        final = results[-1].val_loss if results else math.nan
        logger.info("%s: done after %d syncs at version %d, val loss %.4f", self.name, self.syncs, self.version, final)
        return {"site": self.name, "syncs": self.syncs, "version": self.version, "val_loss": final}


def _shape(cfg: RunConfig) -> dict[str, Any]:
    """The model config a checkpoint must match (its name and initial weights do not matter), and the paradigm
    (which adds its adapters to the model)."""
    shape = {k: v for k, v in to_dict(cfg.model).items() if k not in ("name", "init_from")}
    return {**shape, "paradigm": cfg.paradigm.describe()}


def _exit_for(signum: int) -> None:
    raise SystemExit(128 + signum)
