"""One site's loop: join, pull, train for a wall-clock interval, push the delta, pull, checkpoint."""

from __future__ import annotations

import json
import math
import os
import signal
import time
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
from geofed_hpc.client.params import Arrays, delta
from geofed_hpc.client.runtime import build_runtime
from geofed_hpc.client.telemetry import RttMeter, SyncTimer, gpu_metrics, preemptions, rss_gb
from geofed_hpc.client.throttle import Throttle
from geofed_hpc.config import CodecConfig, RunConfig, to_dict
from geofed_hpc.errors import AuthError, CheckpointError, CodecError, GeofedError, ProtocolError, StaleError
from geofed_hpc.log import logger
from geofed_hpc.metrics import Recorder
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient

EXTRA_PULL_WAIT = timedelta(seconds=30)


def apply_updates(base: Arrays, header: m.ModelHeader, payload: bytes) -> Arrays:
    """Add the PS's encoded global updates (header.segments, in version order) to `base` in place, the same
    float32 adds the PS made, so `base` stays bit-identical to the global model."""
    if sum(header.segments) != len(payload):
        raise ProtocolError(f"update segments add up to {sum(header.segments)} bytes, the payload has {len(payload)}")
    expected = {k: (tuple(v.shape), "float32") for k, v in base.items()}
    view, pos = memoryview(payload), 0
    for size in header.segments:
        update = codec.decode(view[pos : pos + size], expected=expected)  # type: ignore[arg-type]
        for k, v in update.items():
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


class SiteTrainer:
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
        self.best = BestCheckpoints(self.dir / "ckpt" / "best", keep=int(getattr(cfg.train, "keep_best", 10)))
        self.val_loss = math.nan
        self._disk_model: Arrays = {}
        self.store = CheckpointStore(self.dir / "ckpt", prefix="site", keep=2)
        self.base: Arrays = {}
        self.version = 0
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
    def _save(self, pending: dict[str, float] | None = None, pushed: bool = False) -> None:
        """Checkpoint; `pending`: an unpushed part-interval (kept with its base), `pushed`: the delta is in."""
        tensors: dict[str, np.ndarray] = {f"model/{k}": v for k, v in self.group.model_arrays().items()}
        tensors.update(self.group.optimizer_arrays())  # optim/<param>/<key>, gathered from every rank
        tensors.update(self.group.rng_state())
        if pending:  # the model is ahead of its base: resuming must be able to push local - base
            tensors.update({f"base/{k}": v for k, v in self.base.items()})
        tensors.update(self._codec_state()[0].state())  # residual/<param>: error feedback survives a requeue
        syncs = self._syncs_after_push if pushed else self.syncs
        meta = {
            "version": self.version,
            "syncs": syncs,
            "tokens_seen": self.tokens_seen,
            "sampler": self.sampler.state_dict(),
            "session_id": self.session.session_id,
            "pending": pending,
            "job_id": self.job_id,
            "global_model": not pending and not pushed,  # the model is the PS's at `version`, bit for bit
            "val_loss": self.val_loss,
            "contribution_total": self.contribution_total,
            "scaler": self.group.stepper.scaler_state(),
            "model": _shape(self.cfg),
        }
        path = self.store.save(syncs, tensors, meta)
        if meta["global_model"]:
            self.best.offer(path, self.val_loss, syncs)

    def _load(self) -> dict[str, Any] | None:
        loaded = self.store.load_latest()
        if loaded is None:
            if not self.runtime.initialized:  # every checkpoint was unreadable: start from fresh weights
                self.group.load_model(self.runtime.initial_arrays())
            return None
        tensors, meta, path = loaded
        if meta.get("model", _shape(self.cfg)) != _shape(self.cfg):
            ours, theirs = _shape(self.cfg), meta["model"]
            diff = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
            raise CheckpointError(
                f"checkpoint {path} is of another model (model.{diff[0]}={theirs.get(diff[0])!r}, this run has "
                f"{ours.get(diff[0])!r}): use its model config, or move {self.store.directory} away to start afresh"
            )
        self._disk_model = {k[6:]: v for k, v in tensors.items() if k.startswith("model/")}
        self.group.load_model(self._disk_model)
        self.group.load_optimizer({k: v for k, v in tensors.items() if k.startswith("optim/")})
        self.group.set_rng_state(tensors)
        self.group.set_scaler_state(meta.get("scaler") or {})
        self.base = {k[5:]: v for k, v in tensors.items() if k.startswith("base/")}
        self._codec_state()[0].load(tensors)
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
            elapsed = time.monotonic() - self._interval_start
            self._save(pending={"steps": steps, "loss_sum": loss_sum, "elapsed_s": elapsed})
            self._stop()

    def _pushed(self) -> None:
        """The delta is in: until the next checkpoint (`_checkpointed`) a stop records `pushed`, leaves at once."""
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
        if meta and pending and int(meta["version"]) == self.session.version:
            self.version = int(meta["version"])
            self._carry = (int(pending["steps"]), float(pending["loss_sum"]), float(pending["elapsed_s"]))
            return "local"
        if meta and pending:
            self.version, steps = int(meta["version"]), int(pending["steps"])
            self.phase = "busy"
            try:
                sent, _ = self._push(client, settings, steps, float(pending["loss_sum"]) / steps)
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
        if not self._disk_is_current(meta):
            self._pull(client, 0, timedelta(0))
        if pending:
            self._save()
        self._checkpointed()
        return "fresh" if not meta else "local" if int(meta["version"]) == self.version else "global"

    # ---------------------------------------------------------------- protocol steps
    def _join(self, client: PSClient, meta: dict[str, Any] | None) -> m.JoinReply:
        if meta and meta.get("session_id"):
            try:
                token = read_secret(self.dir / "rejoin.json").get("rejoin_token") or meta.get("rejoin_token", "")
                return client.join(m.JoinRequest(self.name, token, resume_session=meta["session_id"]))
            except AuthError as exc:
                logger.info("%s: rejoin refused (%s); enrolling again", self.name, exc)
        return client.join(m.JoinRequest(self.name, self.cfg.site.token))

    def _pull(self, client: PSClient, min_version: int, wait: timedelta) -> None:
        """Take the global model: only the PS's encoded updates since our version when it still keeps them
        (self.base stays bit-identical to the PS), the full model otherwise."""
        have = self.version if self.base else None
        t0 = time.monotonic()
        header, payload = client.pull_model(self.session.session_id, min_version, wait, have_version=have)
        self.timer.pull_s += time.monotonic() - t0
        self.timer.wait_s += client.last_pull_wait_s
        self.timer.bytes_received += len(payload)
        if header.kind == "updates":
            try:
                if header.base_version != have:
                    raise ProtocolError(f"updates start at version {header.base_version}, we hold {have}")
                arrays = apply_updates(self.base, header, payload)
            except (CodecError, ProtocolError) as exc:
                logger.warning("%s: cannot apply the global updates (%s); pulling the full model", self.name, exc)
                self.base = {}
                self._pull(client, min_version, timedelta(0))
                return
        else:
            arrays = codec.decode(payload)
            if have is not None and header.version < have:
                logger.warning("%s: the PS is back at version %d (we held %d)", self.name, header.version, have)
        self.group.load_model(arrays)
        self.base, self.version = arrays, header.version

    def _seed(self, client: PSClient, meta: dict[str, Any] | None) -> None:
        """The PS holds no model: upload ours (bootstrap), or re-seed it from this site's checkpoint."""
        version = int(meta["version"]) if meta else 0
        arrays = self.base if self.base else self.group.model_arrays()
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
        return self.val_loss

    def _train_interval(self, settings: m.RunSettings) -> tuple[int, float]:
        steps, loss_sum, elapsed = self._carry  # a requeued job finishes the interval it was in
        self._carry = (0, 0.0, 0.0)
        self._interval_start = time.monotonic() - elapsed
        deadline = self._interval_start + settings.sync_interval_s
        self.phase = "train"
        while True:
            # every rank: its slice, micro-batches, one optimizer step (then train.slowdown's sleep, if any)
            loss, tokens, signalled = self.throttle(self.group.step)
            if signalled and self.stop_signal is None:
                self.stop_signal = signalled  # another rank of this site was signalled: stop together
            steps += 1
            loss_sum += loss
            self.tokens_seen += tokens
            self._after_step(steps, loss_sum)
            if settings.max_local_steps and steps >= settings.max_local_steps:
                break
            if settings.sync_interval_s > 0 and time.monotonic() >= deadline:
                break
        self.phase = "busy"
        return steps, loss_sum / steps

    def _codec_state(self) -> tuple[codec.ErrorFeedback, codec.LinkAdaptive]:
        """This site's error-feedback residual and link-adaptive codec choice (made on first use)."""
        if not hasattr(self, "_feedback"):
            self._feedback = codec.ErrorFeedback()
            self._link = codec.LinkAdaptive(self.cfg.codec, self.name)
        return self._feedback, self._link

    def _push(self, client: PSClient, settings: m.RunSettings, steps: int, loss: float) -> tuple[int, int]:
        """Push local - base plus the residual the codec lost last time (error feedback); codec=adaptive picks
        the codec from the measured push throughput."""
        d = delta(self.group.model_arrays(), self.base)
        raw = sum(v.nbytes for v in d.values())
        feedback, link = self._codec_state()
        name = settings.codec
        if name == "adaptive":
            name = link.choose(raw // 4, settings.sync_interval_s)
        c = self.cfg.codec
        cfg = CodecConfig(name, settings.block_size, c.zstd_level, stochastic_rounding=c.stochastic_rounding)
        t_enc = time.monotonic()
        payload, residual = feedback.encode(d, cfg)
        self.timer.encode_s += time.monotonic() - t_enc
        header = m.PushHeader(
            self.session.session_id,
            self.version,
            steps,
            steps * self.sampler_tokens(),
            name,
            0,
            b"",
            "",
            train_loss=loss,
        )
        t0 = time.monotonic()
        reply = client.push_delta(header, payload)
        link.observe(name, len(payload), raw // 4, time.monotonic() - t0)
        self.timer.push_s += time.monotonic() - t_enc
        self.timer.staleness = reply.staleness
        if reply.accepted:
            feedback.commit(residual)  # a refused push keeps the old residual; its delta is dropped
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
        client.heartbeat(
            m.HeartbeatRequest(self.session.session_id, self.version, val_loss=val_loss if val_loss > 0 else 0.0)
        )
        rtt = self.rtt.add(time.monotonic() - t0)
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
        self.base, self.version = self._disk_model, int(meta["version"])
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
            client.connect()
            self.session = self._join(client, meta)
            self._keep_token()
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
                rec.log({"val/loss": self.evaluate(), "sync/version": self.version, "sync/index": 0})
                if self.val_loss > 0:  # the PS's ps/global_val_loss starts at version 0 too
                    sid = self.session.session_id
                    client.heartbeat(m.HeartbeatRequest(sid, self.version, val_loss=self.val_loss))
            results = []
            while not cfg.train.max_syncs or self.syncs < cfg.train.max_syncs:
                t0 = time.monotonic()
                self.timer = SyncTimer()
                steps, train_loss = self._train_interval(settings)
                train_s = time.monotonic() - t0
                t1 = time.monotonic()
                try:
                    sent, raw = self._push(client, settings, steps, train_loss)
                    self._pushed()
                    push_s = time.monotonic() - t1
                    wait = cfg.ps.round_timeout + EXTRA_PULL_WAIT
                    self._pull(client, self.version + 1, wait)
                except StaleError as exc:
                    logger.warning("%s: %s; dropping this delta and pulling the latest model", self.name, exc)
                    sent, raw, push_s = 0, 0, time.monotonic() - t1
                    self._pull(client, 0, timedelta(0))
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
                        "train/tokens": self.tokens_seen,
                        "train/tokens_per_s": steps * self.sampler_tokens() / max(train_s, 1e-9),
                        "sync/bytes_sent": sent,
                        "sync/compression_ratio": raw / sent if sent else math.nan,
                        "sync/push_seconds": push_s,
                    }
                )
                self._save()
                self._checkpointed()
            client.heartbeat(m.HeartbeatRequest(self.session.session_id, self.version, leaving=True))
        final = results[-1].val_loss if results else math.nan
        logger.info("%s: done after %d syncs at version %d, val loss %.4f", self.name, self.syncs, self.version, final)
        return {"site": self.name, "syncs": self.syncs, "version": self.version, "val_loss": final}


def _shape(cfg: RunConfig) -> dict[str, Any]:
    """The model config a checkpoint must match (its name and initial weights do not matter)."""
    return {k: v for k, v in to_dict(cfg.model).items() if k not in ("name", "init_from")}


def _exit_for(signum: int) -> None:
    raise SystemExit(128 + signum)
