"""A site's checkpoints: what one holds (model, optimizer, RNG, sampler, residual, unpushed work), loading it back."""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from geofed_hpc.ckpt import CheckpointStore, atomic_write_bytes
from geofed_hpc.ckpt.atomic import PRIVATE_FILE, private_dirs
from geofed_hpc.ckpt.best import BestCheckpoints
from geofed_hpc.ckpt.mirror import CheckpointMirror, restore
from geofed_hpc.ckpt.tensorfile import load_tensors, save_tensors
from geofed_hpc.client.deferred import Deferred
from geofed_hpc.client.evaluation import Evaluation
from geofed_hpc.client.group import SiteGroup
from geofed_hpc.client.link import PSLink
from geofed_hpc.client.progress import Progress
from geofed_hpc.client.replica import Replica
from geofed_hpc.client.sharded import ShardIndex, new_stamp, shard_meta, stamp_of
from geofed_hpc.client.uplink import Uplink
from geofed_hpc.config import RunConfig
from geofed_hpc.config.run import model_shape, shape_difference
from geofed_hpc.config.train import KEEP_LATEST
from geofed_hpc.data import BatchSampler
from geofed_hpc.data.squad import QASampler
from geofed_hpc.errors import CheckpointError
from geofed_hpc.faults import fault
from geofed_hpc.log import logger
from geofed_hpc.paradigms.exchange import Params
from geofed_hpc.paradigms.site import SiteParadigm
from geofed_hpc.rpc import messages as m

PUSH_RECORD = "push.json"  # the last push that went out, beside the checkpoints
PUSH_LOG = "pushes.json"  # a site restored from its mirror: the newest pushes the mirror recorded, oldest first
# How long a stopping job waits for the mirror's upload of its last checkpoint: well inside the lead time of the
# signal before a time limit (submitit's USR2 comes 90 s before), so that the requeue after it still happens.
MIRROR_WAIT = timedelta(seconds=30)


@dataclass
class Restored:
    """A checkpoint loaded back: its meta and its model tensors (the global model at meta["version"] when
    meta["global_model"])."""

    meta: dict[str, Any]
    model: Params
    path: Path

    @property
    def pending(self) -> dict[str, Any] | None:
        return self.meta.get("pending") or None

    @property
    def version(self) -> int:
        return int(self.meta["version"])


@dataclass
class SiteParts:
    """The parts of a site whose state a checkpoint holds."""

    group: SiteGroup
    sampler: BatchSampler | QASampler
    paradigm: SiteParadigm
    replica: Replica
    uplink: Uplink
    link: PSLink
    progress: Progress
    evaluation: Evaluation


class BackgroundWriter:
    """Writes one staged checkpoint at a time on a thread of its own while training goes on.

    At most one write is in flight: a new one first waits for the previous to finish (it never supersedes it, so
    the files land in the order they were taken and push.json never runs ahead of the newest durable checkpoint).
    A write that failed raises its error in the training thread at the next `wait()` (the next checkpoint, push
    record or stop), as a synchronous write would have; the previous complete checkpoint stays the latest. The
    thread logs nothing (a signal handler may wait for it while it holds the log's lock): `wait()` logs for it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done: tuple[Path, float] | None = None
        self.written = 0  # background writes finished since the job started

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def submit(self, write: Callable[[], Path]) -> None:
        """Run `write()` (it writes a staged checkpoint and returns its path) on the writer thread."""
        self.wait()

        def run() -> None:
            t0 = time.monotonic()
            try:
                self._done = (write(), time.monotonic() - t0)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread by wait()
                self._error = exc

        # not a daemon: a job that ends normally finishes the write before the interpreter exits
        self._thread = threading.Thread(target=run, name=f"{self.name}-checkpoint-writer")
        self._thread.start()

    def wait(self) -> Path | None:
        """Wait for the write in flight, if any; its path (None: none was in flight). Its error is raised here."""
        thread, self._thread = self._thread, None
        if thread is None:
            return None
        thread.join()
        error, done, self._error, self._done = self._error, self._done, None, None
        if error is not None:
            raise error
        assert done is not None
        self.written += 1
        path, seconds = done
        logger.debug("%s: checkpoint %s written in the background in %.2fs", self.name, path.name, seconds)
        return path


def _staged(arrays: Mapping[str, np.ndarray], copy_all: bool) -> dict[str, np.ndarray]:
    """A host-memory copy of checkpoint tensors that training can no longer change (`copy_all` False: arrays
    that are fresh host copies already, a GPU model's, are taken as they are)."""
    return {k: np.array(v, copy=True) if copy_all else v for k, v in arrays.items()}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _is_record(record: Any) -> bool:
    """A push record as record_push writes it (one from the mirror may be anything)."""
    numbers = ("base_version", "tokens", "draws", "tokens_seen", "syncs")
    return (
        isinstance(record, dict)
        and isinstance(record.get("push_id"), str)
        and all(isinstance(record.get(k), int) and not isinstance(record.get(k), bool) for k in numbers)
    )


class SiteCheckpoints:
    """Writes and reads the site's checkpoints in `directory` (site-<syncs>.gft, the two latest kept, each with all
    a resume needs; the train.keep_best lowest validation losses in best/, the model's weights only). Every part's
    state goes in through its public fields.

    The checkpoint after each sync may be written in the background (train.background_checkpoint): its state is
    staged in host memory at once (a copy of the model, optimizer state and the rest: about 16 bytes a parameter)
    and written by `writer` while the next interval trains (so is an overlapped sync's, train.overlap, with the work
    since its push as unpushed steps). Every other write (a stop's, a deferral's, a resume's) waits for it first and
    is synchronous, and so is the push record before a push goes out: a job killed while a
    background write is in flight finds the previous complete checkpoint and the record of the push after it,
    which is exactly the state a kill between a push and its checkpoint always left (see `push_record`).

    With train.checkpoint_mirror, each checkpoint, once complete on disk, and each push record go to a mirror in
    object storage, uploaded on a thread of its own (ckpt/mirror.py); a site whose folder holds no checkpoint (its
    scratch purged) first takes the mirror's newest complete one and its push record, then resumes as always."""

    def __init__(self, cfg: RunConfig, directory: Path, parts: SiteParts, job_id: str) -> None:
        self.cfg, self.parts, self.job_id = cfg, parts, job_id
        self.store = CheckpointStore(directory, prefix="site", keep=KEEP_LATEST)
        self.best = BestCheckpoints(directory / "best", keep=cfg.train.keep_best)
        self.index = ShardIndex(directory)  # multi-rank sites: the DCP shard folders each file refers to
        parts.group.shard_root = directory
        self.stamp = 0
        self.writer = BackgroundWriter(parts.replica.name)
        self.mirror: CheckpointMirror | None = None  # train.checkpoint_mirror: each checkpoint copied there
        if cfg.train.checkpoint_mirror:
            self.mirror = CheckpointMirror(cfg.train.checkpoint_mirror, parts.replica.name, directory)
            if parts.group.rank == 0:  # it restores into the folder every rank reads; the others wait for it
                if self.store.latest_step() is None:  # scratch purged (or a first start): the mirror's newest
                    restored = restore(self.mirror, directory, PUSH_RECORD, PUSH_LOG)
                    if restored and restored[1]:  # its shards, kept by the next settle
                        self.index.add(restored[0].name, restored[1])
                else:
                    self.mirror.check()
            parts.group.barrier()

    def _mirrored(self, path: Path, shards: dict[str, Any] | None) -> Path:
        """Hand a checkpoint now complete on disk to the mirror (rank 0's; it uploads in the background)."""
        if self.mirror is not None and self.parts.group.rank == 0:
            self.mirror.submit(path, str(shards["dir"]) if shards else "")
        return path

    def flush(self) -> Path | None:
        """Wait until the checkpoint being written in the background, if any, is on disk (its error raised)."""
        if self.mirror is not None:
            self.mirror.notes()  # what the mirror's thread had to say (it logs nothing itself)
        return self.writer.wait()

    def leave(self, wait: timedelta = MIRROR_WAIT) -> None:
        """The job stops, its checkpoint on disk: the mirror's upload of it finishes first, within `wait` (a stop
        signal's requeue comes after this; past `wait` the upload goes on until the process exits)."""
        if self.mirror is not None and self.parts.group.rank == 0:
            self.mirror.settle(wait)

    def settle(self) -> None:
        """Before the job leaves: the background write finished; one that failed is logged (the previous complete
        checkpoint and the push record stand, and a resume reads them)."""
        try:
            self.writer.wait()
        except (OSError, CheckpointError) as exc:
            logger.error("%s: the checkpoint written in the background failed: %s", self.parts.replica.name, exc)
        # the mirror's upload is not waited for here (a save may follow: the grace goes to the local checkpoint
        # first); `leave` waits for it

    def record_push(self, header: m.PushHeader, draws: int, tokens_seen: int, syncs_after: int) -> None:
        """Before a push goes out: what it carries, on disk (push.json). A job killed after the PS applied it and
        before the checkpoint after it finds it there and skips its batches instead of training them again. The
        checkpoint before the push is durable first: the record always follows the newest complete checkpoint."""
        self.flush()
        record = {
            "push_id": header.push_id,
            "base_version": header.base_version,
            "tokens": header.tokens,
            "draws": draws,
            "tokens_seen": tokens_seen,
            "syncs": syncs_after,
        }
        atomic_write_bytes(self.store.directory / PUSH_RECORD, json.dumps(record).encode())
        if self.mirror is not None and self.parts.group.rank == 0:
            self.mirror.push(record)  # rides in the manifest of the newest checkpoint, uploaded in the background
            self.mirror.log_push(record)  # and in its push log now, before the push goes out

    def push_records(self, restored: Restored | None) -> list[dict[str, Any]]:
        """Records of pushes that went out after `restored` was written, newest first: push.json's (made against
        its base), then, for a site restored from its mirror, those the mirror logged past its draws."""
        if restored is None:
            return []
        record = _read_json(self.store.directory / PUSH_RECORD)
        records = [record] if _is_record(record) and record["base_version"] == restored.version else []
        logged = _read_json(self.store.directory / PUSH_LOG)
        records += [r for r in (logged if isinstance(logged, list) else []) if _is_record(r)]
        newest: dict[str, dict[str, Any]] = {}
        for r in sorted(records, key=lambda r: int(r["draws"]), reverse=True):
            newest.setdefault(str(r["push_id"]), r)
        return [r for r in newest.values() if int(r["draws"]) > self.parts.sampler.draws]

    @staticmethod
    def exists(directory: Path) -> bool:
        """Whether `directory` holds a site checkpoint (the job is a resume: weights come from disk)."""
        return CheckpointStore(directory, prefix="site").latest_step() is not None

    def save(self, pending: dict[str, Any] | None = None, pushed: bool = False, background: bool = False) -> Path:
        """Checkpoint; `pending`: unpushed work (kept with its base, and what of it is deferred), `pushed`: the
        delta is in. Returns the file written (`background`: the file being written: its state is staged now and
        written by `writer` while training goes on; a multi-rank site's ranks stage and write their shards with DCP's
        async_save). Unpushed work may be written in the background too (an overlapped sync's landing): the record
        of the next push waits for the write (`record_push`), so a kill mid-write finds the previous checkpoint and
        the push after it, as always."""
        self.flush()
        p = self.parts
        background = background and not pushed
        if background and p.group.multi and p.replica.exact and p.evaluation.version == p.replica.version:
            # a best checkpoint's shards are written at once, before the background save begins (a save of shards
            # waits for the one before it)
            self.keep_best(p.evaluation.val_loss, p.progress.syncs, self.store.path_for(p.progress.syncs).name, True)
        tensors: dict[str, np.ndarray] = {}
        shards: dict[str, Any] | None = None
        if p.group.multi:  # each rank writes its shard of the model and optimizer (DCP); the file refers to them
            self.stamp = new_stamp(self.stamp)
            shards = shard_meta(p.group.save_shards(self.stamp, background=background), p.group.world_size)
        else:
            tensors.update({f"model/{k}": v for k, v in p.group.model_arrays().items()})
            tensors.update(p.group.optimizer_arrays())  # optim/<param>/<key>
        tensors.update(p.group.rng_state())
        if pending:  # the model is ahead of its base: resuming must be able to push local - base
            tensors.update({f"base/{k}": v for k, v in p.replica.base.items()})
            # the id its push will carry: a job killed after that push went in, before the next checkpoint,
            # resends it from this checkpoint under the same id, and the PS does not apply it twice
            pending = {**pending, "deferred": p.uplink.deferred.to_meta(), "push_id": p.uplink.pending_id()}
            tensors.update(p.uplink.deferred.tensors())  # the bytes of the attempt the PS may hold, confirmed ones
        tensors.update(p.uplink.feedback.state())  # residual/<param>: error feedback survives a requeue
        tensors.update(p.paradigm.state())  # the unpushed part of a round the paradigm keeps (zo's coefficients)
        syncs = p.progress.syncs_after_push if pushed else p.progress.syncs
        meta = {
            "version": p.replica.version,
            "syncs": syncs,
            "tokens_seen": p.progress.tokens_seen,
            "sampler": p.sampler.state_dict(),
            "session_id": p.link.session_id,
            "settings": dataclasses.asdict(p.link.settings),  # to train on if the PS is down at restart
            "pending": pending,
            "job_id": self.job_id,
            "global_model": not pending and not pushed and p.replica.exact,  # the PS's model at `version`
            "base_global": p.replica.exact,
            "val_loss": p.evaluation.val_loss,
            "contribution_total": p.progress.contribution_total,
            "scaler": p.group.stepper.scaler_state(),
            "model": model_shape(self.cfg),
            **({"shards": shards} if shards else {}),
        }
        best = bool(meta["global_model"]) and p.evaluation.version == p.replica.version  # val_loss: this model's
        what = f", {pending['steps']:g} unpushed steps" if pending else ", after a push" if pushed else ""
        if background:
            return self._save_in_background(syncs, tensors, meta, best and not shards, what)
        if shards:
            self.index.add(self.store.path_for(syncs).name, shards["dir"])
        path = self._mirrored(self.store.save(syncs, tensors, meta), shards)
        if shards:
            self.index.settle(path.name, shards["dir"])
        if best:
            self.keep_best(p.evaluation.val_loss, syncs, path.name, global_model=True)
        logger.info("%s: checkpoint %s (version %d, %d syncs%s)", p.replica.name, path, p.replica.version, syncs, what)
        return path

    def _save_in_background(
        self, syncs: int, tensors: dict[str, np.ndarray], meta: dict[str, Any], best: bool, what: str
    ) -> Path:
        """Stage the checkpoint in host memory and hand it to the writer; the path it is being written to."""
        p = self.parts
        on_cpu = p.group.stepper.device.type == "cpu"  # the model and optimizer arrays are views of live tensors
        staged = {
            **_staged({k: v for k, v in tensors.items() if k.startswith(("model/", "optim/"))}, on_cpu),
            **_staged({k: v for k, v in tensors.items() if not k.startswith(("model/", "optim/"))}, True),
        }
        del tensors
        meta = copy.deepcopy(meta)
        path = self.store.path_for(syncs)
        loss = p.evaluation.val_loss
        best_meta = self._best_meta(loss, global_model=True) if best and self.best.would_keep(loss) else None
        shards = meta.get("shards")

        def write() -> Path:
            fault("site.ckpt_write", path.name)
            if shards:  # every rank's shards are written, their folder in place, listed before the file names it
                p.group.finish_shards()
                self.index.add(path.name, shards["dir"])
            written = self._mirrored(self.store.save(syncs, staged, meta), shards)
            if shards:
                self.index.settle(written.name, shards["dir"])
            if best_meta is not None:
                weights = {k: v for k, v in staged.items() if k.startswith("model/")}
                private_dirs(self.best.directory)
                self.best.admit(
                    written.name,
                    loss,
                    syncs,
                    lambda target: save_tensors(target, weights, best_meta, mode=PRIVATE_FILE),
                )
            return written

        self.writer.submit(write)
        logger.info(
            "%s: checkpoint %s (version %d, %d syncs%s) staged, writing in the background",
            p.replica.name,
            path,
            meta["version"],
            syncs,
            what,
        )
        return path

    def keep_best(self, loss: float, step: int, name: str, global_model: bool) -> bool:
        """Keep the model as it is now among the best (train.keep_best) as `name` when `loss` is among the lowest:
        its weights only (the optimizer state, sampler and unpushed work are the latest checkpoints'), model/<param>
        tensors in the file, or a shard folder of the weights that the file names in a multi-rank site."""
        self.flush()  # one writer of best/ at a time
        if not self.best.would_keep(loss):
            return False
        p = self.parts
        meta = self._best_meta(loss, global_model)
        private_dirs(self.best.directory)
        if not p.group.multi:
            weights = {f"model/{k}": v for k, v in p.group.model_arrays().items()}
            return self.best.admit(
                name, loss, step, lambda target: save_tensors(target, weights, meta, mode=PRIVATE_FILE)
            )
        self.stamp = new_stamp(self.stamp)
        shards = shard_meta(p.group.save_shards(self.stamp, weights_only=True), p.group.world_size)
        self.index.add(f"best/{name}", shards["dir"])
        kept = self.best.admit(
            name, loss, step, lambda target: save_tensors(target, {}, {**meta, "shards": shards}, mode=PRIVATE_FILE)
        )
        self.index.settle(f"best/{name}", shards["dir"])
        return kept

    def _best_meta(self, loss: float, global_model: bool) -> dict[str, Any]:
        p = self.parts
        return {
            "version": p.replica.version,
            "syncs": p.progress.syncs,
            "tokens_seen": p.progress.tokens_seen,
            "val_loss": loss,
            "job_id": self.job_id,
            "global_model": global_model,  # the PS's model at `version` (else the site's own, mid-interval)
            "weights_only": True,
            "model": model_shape(self.cfg),
        }

    def load(self, fresh: Callable[[], Params] | None = None) -> Restored | None:
        """Load the newest readable checkpoint into the parts. None: there is none (then `fresh()`, if given, is
        loaded: the model was built uninitialised for a checkpoint that turned out unreadable)."""
        loaded = self._latest()
        if loaded is None:
            if fresh is not None:
                self.parts.group.load_model(fresh())
            return None
        tensors, meta, path = loaded
        self._check_model(meta, path)
        p = self.parts
        shards = meta.get("shards")
        if shards:
            self._load_shards(shards, path)
            # the global model this checkpoint holds is the base of a resume that does not pull
            model = dict(p.group.model_arrays()) if meta.get("global_model") else {}
        else:
            model = {k[6:]: v for k, v in tensors.items() if k.startswith("model/")}
            p.group.load_model(model)
            p.group.load_optimizer({k: v for k, v in tensors.items() if k.startswith("optim/")})
        p.group.set_rng_state(tensors)
        p.group.set_scaler_state(meta.get("scaler") or {})
        p.replica.base = {k[5:]: v for k, v in tensors.items() if k.startswith("base/")}
        p.replica.exact = bool(meta.get("base_global", True))
        p.uplink.feedback.load(tensors)
        p.paradigm.load_state(tensors)
        pending = meta.get("pending") or {}
        held = pending.get("deferred")
        p.uplink.deferred = Deferred.from_checkpoint(held, tensors)
        # the id its push carries (an older checkpoint's deferred work kept the id of its first attempt)
        p.uplink.work_id = str((held or {}).get("push_id") or pending.get("push_id") or "")
        p.sampler.load_state_dict(meta["sampler"])
        p.progress.syncs, p.progress.tokens_seen = int(meta["syncs"]), int(meta["tokens_seen"])
        p.progress.contribution_total = int(meta.get("contribution_total", 0))
        logger.info(
            "%s: loaded local checkpoint %s (version %d, %d syncs%s)",
            p.replica.name,
            path,
            meta["version"],
            p.progress.syncs,
            f", {pending['steps']:g} unpushed steps" if pending else "",
        )
        return Restored(meta, model, path)

    def _latest(self) -> tuple[dict[str, np.ndarray], dict[str, Any], Path] | None:
        """The newest checkpoint that loads, with its shard folder when it has one (else an older one)."""
        for _, path in reversed(self.store.files()):
            try:  # mapped: verified in place, nothing allocated for the file (the model and optimizer copy out)
                tensors, meta = load_tensors(path, mapped=True)
            except CheckpointError as exc:
                logger.warning("skipping unreadable checkpoint %s, trying an older one: %s", path, exc)
                continue
            folder = (meta.get("shards") or {}).get("dir")
            if folder and not (self.store.directory / str(folder)).is_dir():
                logger.warning("skipping checkpoint %s: its shards %s are gone, trying an older one", path, folder)
                continue
            return tensors, meta, path
        return None

    def _load_shards(self, shards: dict[str, Any], path: Path) -> None:
        """Every rank reads its shard; written by another number of ranks, DCP reshards them (and we say so)."""
        group, written = self.parts.group, int(shards.get("world_size", 0))
        if written != group.world_size:
            logger.warning(
                "%s: checkpoint %s was written by %d ranks, this job has %d: resharding its model and optimizer",
                self.parts.replica.name,
                path.name,
                written,
                group.world_size,
            )
        try:
            group.load_shards(stamp_of(str(shards["dir"])))
        except (OSError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"cannot read the shards {shards['dir']} of checkpoint {path}: {exc}") from exc

    def _check_model(self, meta: dict[str, Any], path: Path) -> None:
        diff = shape_difference(self.cfg, meta.get("model"))
        if diff is None:
            return
        key, theirs, ours = diff
        raise CheckpointError(
            f"checkpoint {path} is of another model ({key}={theirs!r}, this run has {ours!r}): use its config, or "
            f"move {self.store.directory} away to start afresh"
        )
