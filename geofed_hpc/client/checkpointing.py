"""A site's checkpoints: what one holds (model, optimizer, RNG, sampler, residual, unpushed work and its base),
loading one back, and the one-time rejoin token beside them."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from geofed_hpc.ckpt.secret import write_secret
from geofed_hpc.client.deferred import Deferred
from geofed_hpc.client.trainer_api import Site
from geofed_hpc.config import RunConfig, to_dict
from geofed_hpc.errors import CheckpointError
from geofed_hpc.log import logger


def model_shape(cfg: RunConfig) -> dict[str, Any]:
    """The model config a checkpoint must match (its name and initial weights do not matter), and the paradigm
    (which adds its adapters to the model)."""
    shape = {k: v for k, v in to_dict(cfg.model).items() if k not in ("name", "init_from")}
    return {**shape, "paradigm": cfg.paradigm.describe()}


class Checkpointing:
    """SiteTrainer's checkpoint steps (the state they read and set is the trainer's)."""

    def _save(self: Site, pending: dict[str, Any] | None = None, pushed: bool = False) -> Path:
        """Checkpoint; `pending`: unpushed work (kept with its base, and what of it is deferred), `pushed`: the
        delta is in. Returns the file written."""
        tensors: dict[str, np.ndarray] = {f"model/{k}": v for k, v in self.group.model_arrays().items()}
        tensors.update(self.group.optimizer_arrays())  # optim/<param>/<key>, gathered from every rank
        tensors.update(self.group.rng_state())
        if pending:  # the model is ahead of its base: resuming must be able to push local - base
            tensors.update({f"base/{k}": v for k, v in self.base.items()})
            # the id its push will carry: a job killed after that push went in, before the next checkpoint,
            # resends it from this checkpoint under the same id, and the PS does not apply it twice
            self._work_id = self._work_id or uuid.uuid4().hex
            pending = {**pending, "deferred": self.deferred.to_meta(), "push_id": self._work_id}
            tensors.update(self.deferred.tensors())  # the bytes of the attempt the PS may hold, and confirmed ones
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
            "model": model_shape(self.cfg),
        }
        path = self.store.save(syncs, tensors, meta)
        if meta["global_model"] and self.val_version == self.version:  # val_loss is this model's
            self.best.offer(path, self.val_loss, syncs)
        return path

    def _load(self: Site) -> dict[str, Any] | None:
        loaded = self.store.load_latest()
        if loaded is None:
            if not self.runtime.initialized:  # every checkpoint was unreadable: start from fresh weights
                self.group.load_model(self.runtime.initial_arrays())
            return None
        tensors, meta, path = loaded
        theirs = {"paradigm": "identity", **meta.get("model", model_shape(self.cfg))}  # older checkpoints: pretraining
        if theirs != model_shape(self.cfg):
            ours = model_shape(self.cfg)
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
        pending = meta.get("pending") or {}
        held = pending.get("deferred")
        self.deferred = Deferred.from_checkpoint(held, tensors)
        # the id its push carries (an older checkpoint's deferred work kept the id of its first attempt)
        self._work_id = str((held or {}).get("push_id") or pending.get("push_id") or "")
        self.sampler.load_state_dict(meta["sampler"])
        self.syncs, self.tokens_seen = int(meta["syncs"]), int(meta["tokens_seen"])
        self.contribution_total = int(meta.get("contribution_total", 0))
        logger.info(
            "%s: loaded local checkpoint %s (version %d, %d syncs%s)",
            self.name,
            path,
            meta["version"],
            self.syncs,
            f", {pending['steps']:g} unpushed steps" if pending else "",
        )
        return meta

    def _disk_is_current(self: Site, meta: dict[str, Any] | None) -> bool:
        """A checkpoint holding the global model is our base at its version: skip the pull when the PS is still
        there, else pull only what is newer (the PS's updates since that version, when it keeps them)."""
        if not meta or meta.get("pending") or not meta.get("global_model") or not self._disk_model:
            return False
        self.base, self.version = self.exchange.public(self._disk_model), int(meta["version"])
        return self.version == self.session.version

    def _keep_token(self: Site) -> None:
        """The one-time rejoin token lives in a 0600 file, rewritten as soon as a Join hands out a new one."""
        token = {"session_id": self.session.session_id, "rejoin_token": self.session.rejoin_token}
        write_secret(self.dir / "rejoin.json", token)
