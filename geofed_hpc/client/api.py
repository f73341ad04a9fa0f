"""Site: federate your own training loop in three lines (join, sync on the PS's cadence, checkpoint, leave)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import threading
import time
import types
from collections.abc import Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, SupportsFloat, cast

import numpy as np
import torch
from torch import nn

from geofed_hpc.ckpt import CheckpointStore, atomic_write_bytes
from geofed_hpc.client.checkpoints import PUSH_RECORD, Restored
from geofed_hpc.client.deferred import Deferred
from geofed_hpc.client.events import EventLog
from geofed_hpc.client.fsdp import check_arrays
from geofed_hpc.client.group import SiteGroup
from geofed_hpc.client.link import PSLink
from geofed_hpc.client.progress import Interval, Progress
from geofed_hpc.client.replica import Replica
from geofed_hpc.client.script import CONFIG_ENV, PS_ADDRESS_ENV, SITE_INDEX_ENV
from geofed_hpc.client.sync import SiteSync
from geofed_hpc.client.telemetry import SyncTimer
from geofed_hpc.client.uplink import Uplink
from geofed_hpc.config import RunConfig, to_dict
from geofed_hpc.config.plain import plain_config
from geofed_hpc.config.train import KEEP_LATEST
from geofed_hpc.egress.paths import Route
from geofed_hpc.egress.paths import announce as announce_path
from geofed_hpc.egress.paths import choose as choose_path
from geofed_hpc.egress.paths import record as record_path
from geofed_hpc.errors import CheckpointError, ConfigError, GeofedError
from geofed_hpc.faults import fault
from geofed_hpc.log import logger, setup_logging
from geofed_hpc.metrics import Recorder
from geofed_hpc.paradigms.exchange import Params
from geofed_hpc.paradigms.site import site_paradigm
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient

# USR2: submitit's preemption/timeout signal; TERM: `scontrol requeue`, scancel (as client/job.py).
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
CKPT_PREFIX = "loop"


class _LoopModel:
    """The user's model as the sync parts see a site's ranks: full float32 arrays out, arrays loaded in place (the
    same Parameter objects, so the user's optimizer keeps training them)."""

    multi = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def model_arrays(self) -> Params:
        """Every parameter (tied ones once) as float32 CPU arrays; views of CPU float32 parameters (use at once)."""
        return {n: p.detach().to("cpu", torch.float32).numpy() for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def load_model(self, arrays: Mapping[str, np.ndarray]) -> None:
        check_arrays(self.model, arrays)
        for name, param in self.model.named_parameters():
            param.copy_(torch.from_numpy(np.ascontiguousarray(arrays[name])))


class _LoopSync(SiteSync):
    """SiteSync whose pushes count the tokens the loop reported (Site.step's `tokens`), not a configured batch."""

    per_step = 0

    def tokens_per_step(self) -> int:
        return self.per_step


class Site:
    """Federate a training loop you already have: the model it trains joins a geofed-hpc federation.

    ::

        import geofed_hpc

        with geofed_hpc.Site(model, optimizer, overrides=["ps.address=vm.example.org:50051"]) as site:
            for step in range(site.steps, total_steps):    # site.steps: where a requeued job goes on
                loss = model(batch(step)).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
                site.step(tokens=batch_tokens, loss=loss.item())

    On entering, the site joins the parameter server (the PS: `geofed-hpc ps up`), resumes from its last
    checkpoint if this job ran before, and loads the global model into `model` (a fresh federation is seeded with
    yours). After each optimizer step, `site.step(tokens=..., loss=...)` counts the step; when the PS's cadence
    says so (its train.sync_interval of wall-clock time, or train.max_local_steps steps, whichever comes first)
    it pushes the delta (your model minus the global model it started from, coded by the PS's codec), pulls the
    new global model and copies it into your model's parameters in place: the same Parameter objects, so your
    optimizer goes on training them (its state is kept, as DiLoCo's inner optimizer). Then it checkpoints.
    Leaving the block pushes the last steps, pulls, and leaves the federation: `model` holds the global model.

    Configuration, the same settings the command line uses (no Hydra needed):
      - `config`: a RunConfig, a plain mapping, or a file: YAML as `geofed-hpc launch site=osc ps=cloud --cfg`
        prints it, or the JSON `geofed-hpc launch script=...` hands each job (environment variable
        GEOFED_HPC_CONFIG, read when `config` is None). Without either: the defaults.
      - `overrides`: dotted `key=value` strings as on the command line (`ps.address=host:50051`,
        `site.name=osc`, `site.token=...`, `ps.insecure=false`, `ps.ca_file=ca.pem`, `run_dir=runs/mine`).
      - `site_index`: which of the site's jobs this is (its name is `<site.name>-<index>`); default
        GEOFED_HPC_SITE_INDEX, else 0. `ps_address`: default GEOFED_HPC_PS_ADDRESS, else ps.address.
      Only paradigm=identity: the whole model is exchanged.

    Requeue and exactly-once: the site's state lives in `<run_dir>/sites/<name>/` (checkpoints `ckpt/loop-*.gft`:
    model, optimizer state, RNG, step count, the global version, unpushed work; the one-time rejoin token). A job
    started again (Slurm's requeue, or by hand) resumes from there and `site.steps` says how many optimizer steps
    are done: skip as many batches. A push carries an id fixed before it goes out (recorded on disk): a job killed
    after the PS applied it resends it under the same id (the PS applies it once) or finds it applied and goes on
    after it; killed before, it trains those steps again. USR2 and TERM (Slurm's warning and requeue signals) are
    honoured at the next `site.step`: the unpushed steps are checkpointed with their base and the process exits
    128 + the signal (pass handle_signals=False to keep your own handlers).

    Build the model and the optimizer before entering, and change the model only in place: a parameter added,
    removed, reshaped or replaced by a new Parameter object between syncs is a ConfigError naming it. An error
    inside the block leaves the federation's session open and the last checkpoint as it is (a restart resumes).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        config: RunConfig | Mapping[str, Any] | str | Path | None = None,
        overrides: Iterable[str] = (),
        site_index: int | None = None,
        ps_address: str | None = None,
        handle_signals: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"Site: model must be a torch.nn.Module, got {type(model).__name__}")
        self.cfg: RunConfig = plain_config(config if config is not None else os.environ.get(CONFIG_ENV), overrides)
        if self.cfg.paradigm.name != "identity":
            raise ConfigError(
                f"paradigm.name: Site exchanges the whole model (identity); {self.cfg.paradigm.name!r} needs the "
                "project's own loop (geofed-hpc launch)"
            )
        self.model, self.optimizer = model, optimizer
        self.index = int(site_index if site_index is not None else os.environ.get(SITE_INDEX_ENV, "0") or 0)
        self.name = f"{self.cfg.site.name}-{self.index}"
        self.directory = Path(self.cfg.run_dir) / "sites" / self.name
        self.ps_address = ps_address or os.environ.get(PS_ADDRESS_ENV) or None
        self.handle_signals = handle_signals
        self.steps = 0  # optimizer steps this site made in all (restored on resume)
        self._params = self._param_list()
        self._check_optimizer()
        self._open = False
        self._signal: int | None = None
        self._previous: dict[int, Any] = {}
        self._client: PSClient | None = None
        self._route: Route | None = None
        self._rec: Recorder | None = None
        self._interval = Interval()
        self._since_base, self._loss_sum, self._tokens = 0, 0.0, 0
        self._carry_tokens = 0  # the tokens of unpushed steps a checkpoint held (a requeue carries them on)
        self._deadline = math.inf

    # ---------------------------------------------------------------- the three calls
    def __enter__(self) -> Site:
        cfg, loop = self.cfg, _LoopModel(self.model)
        if not logger.handlers:  # a user's script: the site's lines on stderr, as a job's (cfg.verbosity)
            setup_logging(cfg.verbosity)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(self.directory / "events.jsonl")
        started = time.time()
        self.progress = Progress()
        paradigm = site_paradigm(cfg.paradigm, cfg.train.max_local_steps)
        group = cast(SiteGroup, loop)  # the parts use only model_arrays/load_model of a one-process site
        link = PSLink(cfg, self.name, self.directory, self.events)
        uplink = Uplink(cfg, self.name, self.events, self.progress, on_push=self._record_push)
        replica = Replica(self.name, group, paradigm.exchange, [], self.events)
        self.sync = _LoopSync(cfg, link, replica, uplink, group, paradigm, safe=self)
        self.store = CheckpointStore(self.directory / "ckpt", prefix=CKPT_PREFIX, keep=KEEP_LATEST)
        restored = self._load()
        self.events("restored", checkpoint=restored is not None, seconds=round(time.time() - started, 3))
        try:
            self._rec = Recorder(
                Path(cfg.run_dir) / "metrics",
                self.name,
                job_type="site",
                group=cfg.federation,
                wandb_mode=cfg.wandb_mode,
                config=to_dict(cfg),
            )
            self._route = choose_path(cfg, self.ps_address)  # site.egress: direct, proxy, relay, tunnel or spool
            record_path(Path(cfg.run_dir), self.name, self._route)
            self._client = self._route.connect()
            announce_path(self._rec, self._route)
            link.client, self.sync.rec = self._client, self._rec
            self._client.keep_retrying = lambda: self._signal is None
            source = self._start(restored)
            if not self._interval.carry[0]:
                self._carry_tokens = 0  # the checkpoint's unpushed steps went out as they were
        except BaseException:
            self._close()
            raise
        self.events("ready", source=source, version=self.version, steps=self.steps)
        logger.info("%s: joined at version %d (%s), %d steps done", self.name, self.version, source, self.steps)
        self._begin_interval()
        self._install_signals()
        self._open = True
        return self

    def step(self, tokens: int = 0, loss: SupportsFloat | None = None) -> bool:
        """Count one optimizer step (call it after `optimizer.step()`): `tokens` it trained on (the PS may weight
        deltas by them), its `loss` (a float or a 0-d tensor; logged and sent with the push). When the PS's
        cadence is due, push the delta, pull and rebase the model in place, checkpoint. True when it synced."""
        if not self._open:
            raise ConfigError("Site.step: call it inside `with Site(model, optimizer) as site:`")
        self.steps += 1
        self._since_base += 1
        value = float(loss) if loss is not None else math.nan
        self._loss_sum += value if math.isfinite(value) else 0.0  # a skipped step (NaN/Inf) trained nothing
        self._tokens += int(tokens)
        self.progress.tokens_seen += int(tokens)
        fault("site.step", str(self.steps))
        if self._signal is not None:
            self._stop()
        settings, link, held = self.sync.link.settings, self.sync.link, self.sync.uplink.deferred
        due = (
            (settings.max_local_steps > 0 and self._since_base - held.steps >= settings.max_local_steps)
            or time.monotonic() >= self._deadline
            or link.interval_ends(self._since_base, self.version, held)
        )
        if not due:
            return False
        self._sync()
        if self._signal is not None:  # arrived during the sync: its checkpoint is on disk
            self._stop()
        return True

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: types.TracebackType | None
    ) -> None:
        try:
            if kind is None and self._open:
                if self._since_base > self.sync.uplink.deferred.steps or self.sync.uplink.deferred.active:
                    self._sync()  # the steps since the last sync go out too
                self.sync.link.leave(self.version)
                logger.info("%s: left at version %d after %d steps", self.name, self.version, self.steps)
                self.events("left", version=self.version, steps=self.steps)
        finally:
            self._open = False
            self._restore_signals()
            self._close()

    # ---------------------------------------------------------------- what a loop may read
    @property
    def version(self) -> int:
        """The global version the model was last rebased on."""
        return self.sync.version

    @property
    def syncs(self) -> int:
        """Syncs (pushes) this site made in all."""
        return self.progress.syncs

    # ---------------------------------------------------------------- start and resume
    def _start(self, restored: Restored | None) -> str:
        """Join (or train on from the checkpoint while the PS is unreachable), seed an empty PS, resume; returns
        where the model came from (fresh, local, global)."""
        sync, link = self.sync, self.sync.link
        session = link.start(restored.meta if restored else None)
        if not session.initialized:
            link.seed(sync.replica.seed_arrays(), restored.version if restored else 0)
        elif restored is not None and session.version < restored.version and sync.replica.base:
            sync.replica.version = restored.version  # the PS is behind our checkpoint's base: the freshest wins
            sync.reseed_if_behind(session.version)
        if self._pushed_after(restored):
            return "global"
        source = sync.resume(restored, self._interval, self.progress)
        if restored is None:
            self._save()  # a push of the first interval finds this checkpoint's version as its base
        return source

    def _pushed_after(self, restored: Restored | None) -> bool:
        """The job was stopped after a push went out and before the checkpoint after it: when the PS applied that
        push, its steps are in the global model (site.steps moves past them: the loop skips their batches)."""
        try:
            record = json.loads((self.store.directory / PUSH_RECORD).read_text())
        except (OSError, ValueError):
            return False
        if restored is None or not isinstance(record, dict) or not self.sync.link.session.initialized:
            return False
        if record.get("base_version") != restored.version or int(record.get("steps", 0)) <= self.steps:
            return False
        link, uplink = self.sync.link, self.sync.uplink
        try:
            reply = uplink.ask(link.connected(), link.session_id, restored.version, str(record["push_id"]))
        except GeofedError as exc:  # the PS does not answer: the checkpoint's own work goes out as usual
            logger.warning("%s: cannot ask the PS about our last push (%s)", self.name, exc)
            return False
        self.events("push_after_checkpoint", push_id=record["push_id"], state=reply.push or "not held")
        if reply.push != "applied":
            return False
        logger.info(
            "%s: our push %s went in before the stop: its %d steps are not trained again",
            self.name,
            str(record["push_id"])[:8],
            int(record["steps"]) - self.steps,
        )
        self.steps = int(record["steps"])
        self.progress.tokens_seen = max(self.progress.tokens_seen, int(record["tokens_seen"]))
        self.progress.syncs = max(self.progress.syncs, int(record["syncs"]))
        self.progress.contribution_total += int(record["tokens"])
        uplink.deferred.clear()
        uplink.new_base()
        self.sync.replica.base = {}  # the checkpoint's base is behind: take the global model whole
        self.sync.pull(0, timedelta(0))
        self._save()
        return True

    # ---------------------------------------------------------------- one sync
    def _begin_interval(self) -> None:
        done, loss_sum = self._interval.begin()  # a requeued job finishes the interval it was in
        held = self.sync.uplink.deferred  # intervals whose push failed go out with this one
        self._since_base, self._loss_sum = done + held.steps, loss_sum + held.loss_sum
        self._tokens, self._carry_tokens = self._carry_tokens, 0
        interval = self.sync.link.settings.sync_interval_s
        self._deadline = self._interval.start + interval if interval > 0 else math.inf
        self.sync.link.heartbeats.start()

    def _sync(self) -> None:
        self._check_params()
        t0 = time.monotonic()
        steps = self._since_base
        loss = self._loss_sum / max(steps, 1)
        new_steps = max(steps - self.sync.uplink.deferred.steps, 1)
        self.sync.per_step = round(self._tokens / new_steps)
        self.sync.timer = SyncTimer()
        synced = self.sync.exchange(steps, loss)
        if synced is None:  # the PS stayed unreachable: checkpointed with its base, the next interval retries
            self._carry_tokens = self._tokens
            self._begin_interval()
            return
        self.progress.syncs += 1
        sync_s = time.monotonic() - t0
        assert self._rec is not None
        self._rec.log(
            {
                **self.sync.telemetry(math.nan, synced.sent, sync_s, self.progress),
                "sync/index": self.progress.syncs,
                "sync/version": self.version,
                "sync/local_steps": steps,
                "train/loss": loss,
                "train/step": self.steps,
                "train/tokens": self.progress.tokens_seen,
                "sync/bytes_sent": synced.sent,
                "sync/push_seconds": synced.push_s,
                "sync/deferred_intervals": synced.held,
            }
        )
        logger.info(
            "%s: sync %d: version %d, %d steps, train loss %.4f, sent %.2f MiB, %.1fs",
            self.name,
            self.progress.syncs,
            self.version,
            steps,
            loss,
            synced.sent / 2**20,
            sync_s,
        )
        self._save()
        self._begin_interval()

    # ---------------------------------------------------------------- safe points (sync.SafePoints)
    def busy(self) -> None:
        """Nothing to do: a stop waits for the next Site.step."""

    def pushed(self) -> None:
        self.sync.uplink.deferred.clear()
        self.progress.syncs_after_push = self.progress.syncs + 1

    def checkpointed(self) -> None:
        """Nothing to do: a stop waits for the next Site.step."""

    def save(self, pending: dict[str, Any] | None = None) -> Path:
        return self._save(pending)

    # ---------------------------------------------------------------- checkpoints
    def _record_push(self, header: m.PushHeader) -> None:
        """Before a push goes out: what it carries and how far the loop got, on disk (push.json)."""
        record = {
            "push_id": header.push_id,
            "base_version": header.base_version,
            "tokens": header.tokens,
            "steps": self.steps,
            "tokens_seen": self.progress.tokens_seen,
            "syncs": self.progress.syncs + 1,
        }
        atomic_write_bytes(self.store.directory / PUSH_RECORD, json.dumps(record).encode())

    def _save(self, pending: dict[str, Any] | None = None) -> Path:
        """Checkpoint the model, the optimizer, RNG, residual and progress; `pending`: unpushed work, kept with
        its base and the id its push will carry."""
        sync = self.sync
        tensors: dict[str, np.ndarray] = {f"model/{k}": v for k, v in _LoopModel(self.model).model_arrays().items()}
        tensors.update(self._optimizer_arrays())
        tensors["rng/cpu"] = torch.get_rng_state().numpy().copy()
        if pending:
            tensors.update({f"base/{k}": v for k, v in sync.replica.base.items()})
            pending = {
                **pending,
                "tokens": self._tokens,
                "deferred": sync.uplink.deferred.to_meta(),
                "push_id": sync.uplink.pending_id(),
            }
            tensors.update(sync.uplink.deferred.tensors())
        tensors.update(sync.uplink.feedback.state())
        meta = {
            "version": sync.version,
            "steps": self.steps,
            "syncs": self.progress.syncs,
            "tokens_seen": self.progress.tokens_seen,
            "contribution_total": self.progress.contribution_total,
            "session_id": sync.link.session_id,
            "settings": dataclasses.asdict(sync.link.settings),  # to train on if the PS is down at restart
            "pending": pending,
            "global_model": not pending and sync.replica.exact,
            "base_global": sync.replica.exact,
            "params": {n: list(s) for n, _, s in self._params},
            "job_id": self.events.job_id,
        }
        path = self.store.save(self.steps, tensors, meta)
        what = f", {pending['steps']} unpushed steps" if pending else ""
        logger.info("%s: checkpoint %s (version %d, step %d%s)", self.name, path, sync.version, self.steps, what)
        return path

    def _load(self) -> Restored | None:
        loaded = self.store.load_latest()
        if loaded is None:
            return None
        tensors, meta, path = loaded
        ours = {n: list(s) for n, _, s in self._params}
        if meta.get("params") != ours:
            theirs = meta.get("params") or {}
            diff = sorted(set(theirs) ^ set(ours)) or sorted(k for k in ours if theirs[k] != ours[k])
            raise CheckpointError(
                f"checkpoint {path} is of another model (parameter {diff[0]!r} differs): use the model it was "
                f"trained with, or move {self.store.directory} away to start afresh"
            )
        model = {k[6:]: v for k, v in tensors.items() if k.startswith("model/")}
        _LoopModel(self.model).load_model(model)
        self._load_optimizer(tensors)
        if "rng/cpu" in tensors:
            torch.set_rng_state(torch.from_numpy(np.array(tensors["rng/cpu"], dtype=np.uint8)))
        sync = self.sync
        sync.replica.base = {k[5:]: v for k, v in tensors.items() if k.startswith("base/")}
        sync.replica.exact = bool(meta.get("base_global", True))
        sync.uplink.feedback.load(tensors)
        pending = meta.get("pending") or {}
        held = pending.get("deferred")
        sync.uplink.deferred = Deferred.from_checkpoint(held, tensors)
        sync.uplink.work_id = str((held or {}).get("push_id") or pending.get("push_id") or "")
        if pending:  # its push (now, or carried on) counts the tokens the loop reported for those steps
            self._carry_tokens = int(pending.get("tokens", 0))
            sync.per_step = round(self._carry_tokens / max(int(pending["steps"]) - sync.uplink.deferred.steps, 1))
        self.steps = int(meta["steps"])
        self.progress.syncs, self.progress.tokens_seen = int(meta["syncs"]), int(meta["tokens_seen"])
        self.progress.contribution_total = int(meta.get("contribution_total", 0))
        logger.info(
            "%s: loaded checkpoint %s (version %d, step %d%s)",
            self.name,
            path,
            meta["version"],
            self.steps,
            f", {pending['steps']} unpushed steps" if pending else "",
        )
        return Restored(meta, model, path)

    def _optimizer_arrays(self) -> Params:
        """The optimizer's tensor state as `optim/<param>/<key>` float32 arrays (what a one-process site keeps)."""
        if self.optimizer is None:
            return {}
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {
            f"optim/{names[id(p)]}/{key}": value.detach().to("cpu", torch.float32).numpy().copy()
            for p, entries in self.optimizer.state.items()
            for key, value in entries.items()
            if isinstance(value, torch.Tensor) and id(p) in names
        }

    def _load_optimizer(self, tensors: Mapping[str, np.ndarray]) -> None:
        if self.optimizer is None:
            return
        params = dict(self.model.named_parameters())
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith("optim/"):
                name, field = key[len("optim/") :].rsplit("/", 1)
                state.setdefault(name, {})[field] = torch.from_numpy(np.array(value, dtype=np.float32))
        self.optimizer.state.clear()
        for name, entries in state.items():
            device = params[name].device
            # AdamW keeps `step` on the CPU unless capturable; the moments live with their parameter
            self.optimizer.state[params[name]] = {k: v if k == "step" else v.to(device) for k, v in entries.items()}

    # ---------------------------------------------------------------- the model's parameter set
    def _param_list(self) -> list[tuple[str, int, tuple[int, ...]]]:
        return [(n, id(p), tuple(p.shape)) for n, p in self.model.named_parameters()]

    def _check_optimizer(self) -> None:
        if self.optimizer is None:
            return
        ours = {i for _, i, _ in self._params}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in ours:
                    raise ConfigError(
                        f"Site: the optimizer trains a tensor of shape {tuple(p.shape)} that is not a parameter of "
                        "the model: build the optimizer from model.parameters()"
                    )

    def _check_params(self) -> None:
        """ConfigError naming the first parameter added, removed, reshaped or replaced since the site joined."""
        now = self._param_list()
        if now == self._params:
            return
        before = {n: (i, s) for n, i, s in self._params}
        after = {n: (i, s) for n, i, s in now}
        for name in [*after, *(n for n in before if n not in after)]:
            if name not in after:
                what = f"parameter {name!r} was removed"
            elif name not in before:
                what = f"parameter {name!r} was added"
            elif before[name][1] != after[name][1]:
                what = f"parameter {name!r} changed shape from {before[name][1]} to {after[name][1]}"
            elif before[name][0] != after[name][0]:
                what = f"parameter {name!r} is a new Parameter object (the optimizer trains the old one)"
            else:
                continue
            raise ConfigError(
                f"Site: the model's parameters changed since the site joined: {what}; build the model and its "
                "optimizer before `with Site(...)` and change parameters only in place"
            )
        raise ConfigError("Site: the model's parameters changed order since the site joined")

    # ---------------------------------------------------------------- stop signals
    def _install_signals(self) -> None:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: types.FrameType | None) -> None:
        logger.warning("%s: caught %s; stopping at the next step", self.name, signal.Signals(signum).name)
        self.events("signal", signal=signal.Signals(signum).name)
        self._signal = signum

    def _stop(self) -> None:
        """Checkpoint the unpushed steps with their base, then exit 128 + the signal (a requeue resumes)."""
        assert self._signal is not None
        pending = self._interval.pending(self._since_base, self._loss_sum) if self._since_base else None
        self._save(pending)
        name = signal.Signals(self._signal).name
        self.events("stop", signal=name, syncs=self.progress.syncs, version=self.version, steps=self.steps)
        self._open = False
        raise SystemExit(128 + self._signal)

    def _close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._route is not None:
            self._route.close()
            self._route = None
        if self._rec is not None:
            self._rec.close()
            self._rec = None
