"""Submit local sites as submitit LocalExecutor jobs and follow them with a per-sync table."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import submitit

from geofed_hpc.client.job import ClientJob
from geofed_hpc.config import RunConfig, to_dict
from geofed_hpc.errors import LaunchError
from geofed_hpc.launch import progress
from geofed_hpc.launch.jobs import error_cause, tail
from geofed_hpc.launch.manifest import JobRecord, private_folder, record_jobs
from geofed_hpc.metrics import read_jsonl

POLL_S = 0.5
# How long the other sites get to checkpoint and leave after one failed, before they are interrupted.
STOP_WAIT = timedelta(seconds=60)


def check_local_device(cfg: RunConfig) -> None:
    """train.device=cuda for sites that run on this machine: ConfigError now, saying why, when its torch cannot
    use a GPU (torch is imported only then)."""
    if cfg.train.device == "cuda":
        from geofed_hpc.client.devices import check_device

        check_device(cfg.train.device)


def submit_local_sites(cfg: RunConfig, ps_address: str) -> list[submitit.Job]:
    """Submit `site.num_sites` ClientJobs, each `site.tasks_per_node` processes, through submitit's LocalExecutor."""
    run_dir = Path(cfg.run_dir).resolve()
    executor = submitit.LocalExecutor(folder=private_folder(run_dir / "submitit") / "%j")
    # site.tasks_per_node > 1: each site is that many processes (ranks) here, sharding its model (FSDP2, gloo)
    executor.update_parameters(
        timeout_min=cfg.site.timeout.total_seconds() / 60, tasks_per_node=cfg.site.tasks_per_node
    )
    plain = to_dict(cfg)
    plain["run_dir"] = str(run_dir)
    # Ctrl-C in this terminal reaches every process of its group: the sites must not die of it mid-step. They are
    # started ignoring SIGINT (inherited across exec), and `follow` stops them as scancel does, with a checkpoint.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return [executor.submit(ClientJob(plain, i, ps_address)) for i in range(cfg.site.num_sites)]
    finally:
        signal.signal(signal.SIGINT, previous)


def record_local(cfg: RunConfig, ps_address: str, jobs: list[submitit.Job]) -> Path:
    """The run directory's launch.json, as a Slurm launch writes it: `status`, `logs` and `cancel` find these jobs."""
    records = [
        JobRecord(
            f"{cfg.site.name}-{i}", job.job_id, cfg.site.name, "local", str(job.paths.stdout), str(job.paths.stderr)
        )
        for i, job in enumerate(jobs)
    ]
    return record_jobs(Path(cfg.run_dir).resolve(), cfg.federation, ps_address, cfg.site.name, to_dict(cfg), records)


@dataclass
class Follower:
    """Prints each new sync record of every site once, from the sites' metrics JSONL files."""

    metrics_dir: Path
    since: float
    out: TextIO = sys.stdout
    seen: dict[Path, int] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)

    def poll(self) -> None:
        for path in sorted(self.metrics_dir.glob("*.metrics.jsonl")):
            lines = read_jsonl(path)
            for record in lines[self.seen.get(path, 0) :]:
                if record.get("time", 0) < self.since:
                    continue
                self.records.append(record)
                if progress.is_sync_record(record):
                    print(progress.row(record), file=self.out, flush=True)
            self.seen[path] = len(lines)


def failure(job: submitit.Job) -> str | None:
    """Why a finished local job failed, in one line (its exception, from submitit's report or its log); None when it
    did not fail."""
    exc = job.exception()
    if exc is None:
        return None
    cause = error_cause(str(exc)) or error_cause(tail(Path(job.paths.stderr), 400))
    if cause is None:
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        cause = lines[0] if lines else type(exc).__name__
    return f"site job {job.job_id} failed: {cause}; full log: {job.paths.stderr}"


def stop_jobs(jobs: list[submitit.Job], wait: timedelta = STOP_WAIT) -> None:
    """Stop the jobs still running as scancel does: SIGTERM to each job's controller, which hands it to its tasks (a
    site checkpoints at its next safe point and leaves). Jobs still running after `wait` (or at a second Ctrl-C) are
    killed, tasks and controller."""
    running = [job for job in jobs if not job.done()]
    for job in running:
        _signal(job, signal.SIGTERM)
    try:
        deadline = time.monotonic() + wait.total_seconds()
        while any(not job.done() for job in running) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    finally:
        for job in running:
            if not job.done():
                _signal(job, signal.SIGKILL)


def _signal(job: submitit.Job, signum: int) -> None:
    """`signum` to a local job's controller (SIGTERM: it forwards it to its tasks; SIGKILL: its tasks first)."""
    process = getattr(job, "_process", None)  # submitit's LocalJob: the controller; it has no public terminate
    if process is None or process.poll() is not None:
        return
    if signum == signal.SIGKILL:
        for child in _children(process.pid):
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
    process.send_signal(signum)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a controller's tasks), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def follow(jobs: list[submitit.Job], cfg: RunConfig, since: float, out: TextIO = sys.stdout) -> list[dict[str, Any]]:
    """Print the table until every job ended. When one fails, the others are stopped (they checkpoint and leave) and
    LaunchError names the failed site, the cause and its log."""
    follower = Follower(Path(cfg.run_dir) / "metrics", since, out)
    print(progress.header(), file=out, flush=True)
    finished: set[str] = set()  # jobs that ended and did not fail
    try:
        while not all(job.done() for job in jobs):
            follower.poll()
            ended = [j for j in jobs if j.job_id not in finished and j.done()]
            why = next((w for w in map(failure, ended) if w), None)
            finished.update(j.job_id for j in ended)
            if why is not None:
                stop_jobs(jobs)
                raise LaunchError(why)
            time.sleep(POLL_S)
    except KeyboardInterrupt:  # Ctrl-C: a clean stop, as `cancel` makes one
        print("interrupted: stopping the sites (each checkpoints first; Ctrl-C again kills them)", file=out, flush=True)
        stop_jobs(jobs)
        follower.poll()
        print(f"stopped: run the same command again to resume from {cfg.run_dir}", file=out, flush=True)
        raise
    follower.poll()
    why = next((w for w in map(failure, jobs) if w), None)
    if why is not None:
        raise LaunchError(why)
    print(progress.summary(follower.records), file=out, flush=True)
    return [job.result() for job in jobs]


def launch_local(cfg: RunConfig, ps_address: str, out: TextIO = sys.stdout) -> list[dict[str, Any]]:
    since = time.time()
    jobs = submit_local_sites(cfg, ps_address)
    record_local(cfg, ps_address, jobs)
    print(
        f"submitted {len(jobs)} local sites (jobs {', '.join(j.job_id for j in jobs)}); "
        f"logs in {Path(cfg.run_dir).resolve() / 'submitit'}",
        file=out,
        flush=True,
    )
    try:
        return follow(jobs, cfg, since, out)
    finally:  # submitit also makes its folder pattern, literally and empty, beside each job's own folder
        with contextlib.suppress(OSError):
            (Path(cfg.run_dir).resolve() / "submitit" / "%j").rmdir()
