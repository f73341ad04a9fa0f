"""One metrics recorder: the same metric names into a JSONL file and W&B (offline on compute nodes)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger

# The one list of metric names; the client, the parameter server and the dashboards use exactly these.
METRIC_HELP: dict[str, str] = {
    # training, per site
    "train/loss": "training loss, mean over the steps since the previous log line",
    "train/tokens": "tokens this process has trained on since the run began (cumulative)",
    "train/tokens_per_s": "training throughput since the previous log line, tokens per second",
    "train/lr": "learning rate of the last local step, warmup and train.schedule included (AdamW paradigms)",
    "train/grad_norm": "global gradient norm of the last local step, before train.grad_clip (AdamW paradigms)",
    "train/skipped_steps": "local steps skipped for a NaN/Inf loss or gradient norm since this job started",
    "val/loss": "validation loss of the global model this site just pulled (every train.eval_interval)",
    "val/local_loss": "validation loss of this site's local model, every train.eval_every local steps",
    "train/step": "local optimizer steps this site has taken since the run began (its data position)",
    "sys/rss_gb": "resident memory of the site's rank-0 process, GB",
    "sys/gpu_util": "GPU utilisation of the site's rank-0 device, percent (GPU sites only)",
    "sys/gpu_mem_gb": "peak GPU memory allocated on the site's rank-0 device, GB (GPU sites only)",
    # one sync, per site
    "sync/index": "how many syncs this site has completed",
    "sync/version": "global model version after this sync (PS: the current global version)",
    "sync/local_steps": "local optimizer steps taken since the previous sync",
    "sync/staleness": "global versions between the delta's base and the version it was applied to",
    "sync/bytes_sent": "bytes of encoded delta pushed in this sync (PS: received)",
    "sync/bytes_received": "bytes of global model or updates pulled in this sync",
    "sync/compression_ratio": "raw delta bytes divided by the encoded bytes sent",
    "sync/encode_seconds": "seconds spent quantizing and entropy-coding the delta",
    "sync/push_seconds": "wall-clock seconds to push this delta",
    "sync/pull_seconds": "wall-clock seconds to pull the global model or its updates, waiting included",
    "sync/idle_seconds": "seconds this site waited for the round to close (neither training nor transferring)",
    "sync/comm_overhead": "share of this sync's wall-clock spent encoding, pushing, waiting and pulling",
    "sync/deferred_intervals": "intervals trained while the PS was unreachable whose work went out in this push",
    "sync/offline_seconds": "seconds from the first failed push of an outage until this push went through",
    "net/rtt_ms": "latest round-trip time to the parameter server (Heartbeat), milliseconds",
    "net/rtt_avg_ms": "mean round-trip time to the parameter server over this run segment, milliseconds",
    "net/send_mbps": "push throughput of this sync, megabits per second",
    "net/recv_mbps": "pull throughput of this sync, megabits per second",
    "site/contribution_tokens": "tokens behind this site's latest accepted delta",
    "site/contribution_total": "tokens behind all of this site's accepted deltas (cumulative)",
    "job/preemptions": "times this site's job was preempted or timed out and requeued",
    "resume/seconds": "seconds from job start until ready to train (model, optimizer and sampler restored)",
    "site/micro_batch": "sequences per forward/backward on each rank, as chosen at the job's start (train.micro_batch)",
    "site/world_size": "training processes (ranks) of the site job, over all its nodes",
    "site/nodes": "nodes of the site job",
    "site/goodput": "share of the site job's wall-clock since its first step spent inside training steps",
    # the parameter server
    "ps/version": "global model version",
    "ps/active_sites": "sites seen within the liveness window",
    "ps/global_val_loss": "validation loss of the global model, as evaluated by the sites that pulled it",
    "ps/pushes_total": "deltas applied since the PS started",
    "ps/bytes_received_total": "encoded delta bytes received since the PS started",
    # split learning (fsl_sage, split): per site and sync, and the server part beside the PS
    "split/bytes_up": "bytes of cut-layer activations and targets this site uploaded since the previous sync",
    "split/bytes_down": "bytes of gradients and fitted auxiliary models this site received since the previous sync",
    "split/eval_bytes": "bytes both ways of the composed model's evaluations since the previous sync",
    "split/failed_uploads": "activation uploads skipped since the previous sync (the server part did not answer)",
    "split/alignments": "alignments of the auxiliary model the server part made since it started (PS and sites)",
    "split/server_loss": "the server part's mean loss on the uploaded activations (site: since its previous sync)",
    "split/server_steps": "optimizer steps of the server part since the federation began",
    "split/kept_sequences": "uploaded sequences the server part keeps for alignment",
    "split/align_error": "relative error of the auxiliary model's gradient at the cut after the last alignment",
    "split/bytes_received_total": "activation bytes the server part received since the PS started",
    "split/bytes_sent_total": "gradient and auxiliary model bytes the server part sent since the PS started",
}
# String-valued entries (JSONL only): "resume/source" is local | global | fresh; at each start, "site/device"
# (cpu, cuda:0), "site/gpu" (the GPU model or none) and "site/precision" (fp32, bf16 or fp16).
METRIC_NAMES: tuple[str, ...] = tuple(METRIC_HELP)

WANDB_MODES: tuple[str, ...] = ("offline", "online", "disabled")
RESERVED_KEYS: tuple[str, ...] = ("time", "name", "step")
ONLINE_INIT_TIMEOUT_S = 60.0


def _coerce(key: str, value: Any) -> float | int | str:
    if isinstance(value, (str, int, float)):
        return value
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        out = item()
        if isinstance(out, (str, int, float)):
            return out
    raise TypeError(f"metric {key!r} must be a float, int or str; got {type(value).__name__}")


class Recorder:
    """Feed one set of metric names to `run_dir/{name}.metrics.jsonl` and to a new W&B run (one per Recorder).
    Folders it makes (run_dir, run_dir/wandb) are 0700 and the JSONL file it makes 0600: they say who trains what."""

    def __init__(
        self,
        run_dir: Path,
        name: str,
        *,
        job_type: str,
        group: str,
        wandb_mode: str = "offline",
        config: Mapping[str, Any] | None = None,
        project: str = "geofed-hpc",
    ) -> None:
        if wandb_mode not in WANDB_MODES:
            raise ConfigError(f"wandb_mode must be one of {', '.join(WANDB_MODES)}; got {wandb_mode!r}")
        if not name or "/" in name:
            raise ConfigError(f"recorder name must be a non-empty file-name-safe string; got {name!r}")
        self.run_dir = Path(run_dir)
        self.name = name
        _private_dir(self.run_dir)
        self.jsonl_path = self.run_dir / f"{name}.metrics.jsonl"
        self._file = os.fdopen(os.open(self.jsonl_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600), "a+b")
        if self._file.tell() > 0:  # a previous segment died mid-line: end that line so ours stay parseable
            self._file.seek(-1, 2)
            if self._file.read(1) != b"\n":
                self._file.write(b"\n")
                self._file.flush()
        self._closed = False
        self.wandb_mode = wandb_mode
        self.wandb_run: Any = None
        if wandb_mode != "disabled":
            try:
                _private_dir(self.run_dir / "wandb")  # W&B writes its files there, with the umask's modes
                self.wandb_run = self._init_wandb(wandb_mode, job_type, group, config, project)
            except BaseException:
                self._file.close()
                raise

    def _init_wandb(self, mode: str, job_type: str, group: str, config: Mapping[str, Any] | None, project: str) -> Any:
        import wandb

        def init(m: str) -> Any:
            settings = wandb.Settings(
                console="off",
                silent=True,
                quiet=True,
                disable_git=True,
                save_code=False,
                disable_job_creation=True,
                init_timeout=ONLINE_INIT_TIMEOUT_S if m == "online" else 90.0,
            )
            # The process-wide settings too: W&B's own telemetry reads them, not the run's, and would otherwise ask
            # W&B's servers from an offline run (a call nobody asked for, that can only time out on a closed node).
            wandb.setup(settings=wandb.Settings(mode=m))  # type: ignore[arg-type]
            return wandb.init(
                mode=m,  # type: ignore[arg-type]
                dir=str(self.run_dir),
                project=project,
                group=group,
                job_type=job_type,
                name=self.name,
                config=dict(config) if config is not None else None,
                reinit="create_new",
                settings=settings,
            )

        if mode == "online":
            try:
                return init("online")
            except Exception as e:  # no network or no API key: keep the metrics for a later `wandb sync`
                logger.warning(
                    "W&B online init failed for %s (%s); logging offline under %s/wandb instead, "
                    "upload later with `wandb sync`",
                    self.name,
                    str(e).splitlines()[0] if str(e) else type(e).__name__,
                    self.run_dir,
                )
                self.wandb_mode = "offline"
        return init("offline")

    def log(self, metrics: Mapping[str, float | int | str], step: int | None = None) -> None:
        """Append one JSON line (flushed) and send the numeric values to W&B."""
        if self._closed:
            raise ValueError(f"recorder {self.name!r} is closed")
        record: dict[str, Any] = {"time": time.time(), "name": self.name}
        if step is not None:
            record["step"] = int(step)
        numeric: dict[str, float | int] = {}
        for key, value in metrics.items():
            if key in RESERVED_KEYS:
                raise ValueError(f"metric name {key!r} is reserved for the recorder; rename it")
            v = _coerce(key, value)
            record[key] = v
            if not isinstance(v, str):
                numeric[key] = v
        line = json.dumps(record, ensure_ascii=False) + "\n"
        self._file.write(line.encode("utf-8"))
        self._file.flush()
        if self.wandb_run is not None and numeric:
            self.wandb_run.log(numeric, step=None if step is None else int(step))

    def close(self) -> None:
        """Finish the W&B run and close the JSONL file; calling it again does nothing."""
        self._close(exit_code=0)

    def _close(self, exit_code: int) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.wandb_run is not None:
                self.wandb_run.finish(exit_code=exit_code)
        finally:
            self._file.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._close(exit_code=0 if exc_type is None else 1)


def _private_dir(folder: Path) -> None:
    """Make `folder` (and its parents) when missing, itself 0700 (mkdir's mode passes through the umask)."""
    if not folder.is_dir():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read a metrics JSONL file; a torn line (a crash mid-write) is skipped, with a warning unless it is last."""
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    records: list[dict[str, Any]] = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            obj = None
        if not isinstance(obj, dict):
            if i == last:
                logger.debug("skipping partially written last line of %s", path)
            else:
                logger.warning("skipping unreadable line %d of %s", i + 1, path)
            continue
        records.append(obj)
    return records
