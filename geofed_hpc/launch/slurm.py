"""Submit site jobs to Slurm through submitit, and ask Slurm about them (squeue, sacct where it exists, scontrol)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import FailedJobError

from geofed_hpc.client.job import ClientJob
from geofed_hpc.config import RunConfig, to_dict
from geofed_hpc.errors import LaunchError
from geofed_hpc.launch.executor import (
    check_slurm_site,
    job_folder,
    python_command,
    sbatch_parameters,
    shared_fs_warning,
    site_names,
    site_run_dir,
)
from geofed_hpc.launch.manifest import JobRecord, private_folder
from geofed_hpc.log import logger

COMMAND_TIMEOUT = timedelta(seconds=30)
KEEP_SLURM_CONF = "SLURM_CONF"  # inherited, yet kept while submitting: it names the cluster sbatch talks to
# States a job passes through on its way back to RUNNING: never shown as failed.
TRANSIENT = frozenset(
    {
        "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING",
        "STAGE_OUT", "PREEMPTED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD",
    }
)  # fmt: skip
WHY = {
    "PREEMPTED": "preempted; Slurm requeues it and it resumes from its checkpoint",
    "REQUEUED": "requeued; it resumes from its checkpoint",
    "REQUEUE_HOLD": "requeued and held; `scontrol release` it",
    "TIMEOUT": "hit its time limit more than site.max_requeues times",
}


@dataclass
class JobState:
    """What the scheduler says about one job, and which command said it."""

    job_id: str
    state: str
    source: str
    reason: str = ""
    elapsed: str = ""

    @property
    def active(self) -> bool:
        """Still queued, running or coming back; a job no Slurm command knows any more is not (it ended long ago)."""
        return self.state in TRANSIENT or (self.state == "UNKNOWN" and self.source != "none")

    @property
    def failed(self) -> bool:
        """Ended without completing (failed, timed out for good, out of memory, node failure); not a cancelled one."""
        return not self.active and self.source != "none" and self.state not in ("COMPLETED", "CANCELLED", "UNKNOWN")

    def describe(self) -> str:
        note = WHY.get(self.state) or (self.reason if self.reason not in ("", "None") else "")
        return f"{self.state} ({note})" if note else self.state


def require(command: str, why: str) -> str:
    """The full path of `command`, or a LaunchError saying what was looked for and why."""
    found = shutil.which(command)
    if found is None:
        raise LaunchError(
            f"`{command}` not found on PATH ({why}); run this on the cluster's login node, "
            "or load its Slurm module first (`module load slurm`)"
        )
    return found


@contextlib.contextmanager
def submission_environment() -> Iterator[list[str]]:
    """Submit without what an enclosing allocation or job left in the environment (submitit's clean_env: SLURM_*,
    SLURMD_*, SRUN_*, SBATCH_*, SUBMITIT_*, MASTER_ADDR, RANK, WORLD_SIZE...), which would confuse sbatch and srun
    in the new job; SLURM_CONF (which Slurm to talk to) stays. Yields the names dropped; all come back after."""
    before = set(os.environ)
    conf = os.environ.get(KEEP_SLURM_CONF)
    with submitit.helpers.clean_env():
        if conf is not None:
            os.environ[KEEP_SLURM_CONF] = conf
        dropped = sorted(before - set(os.environ))
        if dropped:
            logger.info("submitting without inherited %s", ", ".join(dropped))
        yield dropped


def require_slurm(cfg: RunConfig) -> None:
    """What submitting needs besides the checks of commands/preflight.py: the site's arithmetic, Slurm's commands."""
    check_slurm_site(cfg)
    require("sbatch", f"site.executor=slurm: site {cfg.site.name!r} submits its jobs with sbatch")
    require("srun", "submitit's SlurmExecutor refuses to start without it")


def submit_site(cfg: RunConfig, ps_address: str) -> list[JobRecord]:
    """Submit one ClientJob per site of `cfg.site` into the fixed run directory; return what was submitted."""
    require_slurm(cfg)
    run_dir = site_run_dir(cfg)
    if not cfg.site.shared_fs:
        warning = shared_fs_warning(run_dir, Path("/proc/mounts").read_text() if Path("/proc/mounts").exists() else "")
        if warning:
            logger.warning("%s", warning)
    plain = to_dict(cfg)
    plain["run_dir"] = str(run_dir)
    records = []
    private_folder(run_dir / "jobs")
    with submission_environment():
        for index, name in enumerate(site_names(cfg)):
            executor = submitit.SlurmExecutor(
                folder=job_folder(run_dir, name), max_num_timeout=cfg.site.max_requeues, python=python_command(cfg)
            )
            executor.update_parameters(**sbatch_parameters(cfg, index))
            try:
                job = executor.submit(ClientJob(plain, index, ps_address))
            except (subprocess.CalledProcessError, FailedJobError) as exc:
                detail = getattr(exc, "stderr", None) or getattr(exc, "output", None) or str(exc)
                if isinstance(detail, bytes):
                    detail = detail.decode(errors="replace")
                raise LaunchError(f"sbatch refused site {name}: {str(detail).strip().splitlines()[-1]}") from None
            records.append(
                JobRecord(name, str(job.job_id), cfg.site.name, "slurm", str(job.paths.stdout), str(job.paths.stderr))
            )
    return records


def _run(args: Sequence[str]) -> subprocess.CompletedProcess[str] | None:
    if shutil.which(args[0]) is None:
        return None
    try:
        return subprocess.run(
            list(args), capture_output=True, text=True, timeout=COMMAND_TIMEOUT.total_seconds(), check=False
        )
    except subprocess.TimeoutExpired as exc:
        said = [line.strip() for line in (exc.stderr or b"").decode(errors="replace").splitlines() if line.strip()]
        raise LaunchError(
            f"Slurm does not answer here: {args[0]} did not answer within {COMMAND_TIMEOUT}"
            + (f" ({said[-1]})" if said else "")
            + "; check SLURM_CONF (the cluster's slurm.conf, or load its Slurm module) and that slurmctld runs; the "
            "jobs' state is unknown, not ended"
        ) from None


# What Slurm's commands print when they cannot reach the controller at all (no SLURM_CONF, slurmctld down): not a
# verdict on the jobs, which `status` must not call ended.
_NO_SLURM = (
    "fetch_config",
    "_establish_config_source",
    "Unable to contact slurm controller",
    "SLURM_CONF",
    "Connection refused",
    "could not open config file",
    "Zero Bytes were transmitted",
)


def _check_answers(out: subprocess.CompletedProcess[str] | None) -> None:
    """LaunchError when squeue says that it reached no Slurm controller, naming what it said."""
    if out is None or out.returncode == 0 and not out.stderr:
        return
    said = [line.strip() for line in out.stderr.splitlines() if line.strip()]
    if any(marker in line for line in said for marker in _NO_SLURM):
        raise LaunchError(
            f"Slurm does not answer here ({said[-1]}): check SLURM_CONF (the cluster's slurm.conf, or load its "
            "Slurm module) and that slurmctld runs; the jobs' state is unknown, not ended"
        )


def job_states(job_ids: Sequence[str]) -> dict[str, JobState]:
    """State of each job: squeue (live and recently ended), then sacct (if the cluster has it), then scontrol."""
    states: dict[str, JobState] = {}
    ids = [str(j) for j in job_ids]
    if not ids:
        return states
    if not any(shutil.which(c) for c in ("squeue", "sacct", "scontrol")):
        raise LaunchError(
            "no Slurm command here (squeue, sacct, scontrol are not on PATH): run this on the cluster's login node, "
            "or load its Slurm module first (`module load slurm`)"
        )
    conf = os.environ.get("SLURM_CONF", "")
    if conf and not Path(conf).is_file():  # Slurm's commands would retry reading it for a minute
        raise LaunchError(
            f"Slurm does not answer here: SLURM_CONF names {conf}, which does not exist; point it at the cluster's "
            "slurm.conf (or unset it); the jobs' state is unknown, not ended"
        )
    out = _run(["squeue", "-h", "-t", "all", "-j", ",".join(ids), "-o", "%i|%T|%M|%r"])
    _check_answers(out)
    for line in out.stdout.splitlines() if out else []:
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0] in ids:
            states[parts[0]] = JobState(parts[0], parts[1], "squeue", parts[3], parts[2])
    missing = [j for j in ids if j not in states]
    if missing:
        out = _run(["sacct", "-X", "-n", "-P", "-j", ",".join(missing), "-o", "JobIDRaw,State,Elapsed"])
        for line in out.stdout.splitlines() if out and out.returncode == 0 else []:
            parts = line.strip().split("|")
            if len(parts) == 3 and parts[0] in missing:
                states[parts[0]] = JobState(parts[0], parts[1].split()[0], "sacct", "", parts[2])
    for job_id in [j for j in ids if j not in states]:
        out = _run(["scontrol", "-o", "show", "job", job_id])
        fields = dict(t.split("=", 1) for t in out.stdout.split() if "=" in t) if out and out.returncode == 0 else {}
        if "JobState" in fields:
            states[job_id] = JobState(job_id, fields["JobState"], "scontrol", fields.get("Reason", ""))
        else:
            states[job_id] = JobState(job_id, "UNKNOWN", "none", "no longer known to squeue, sacct or scontrol")
    return states


def cancel_jobs(job_ids: Sequence[str]) -> None:
    """scancel: each job gets SIGTERM, checkpoints at its next step and ends (it is not requeued)."""
    if job_ids:
        scancel = require("scancel", "`cancel` stops Slurm jobs with scancel")
        out = subprocess.run(
            [scancel, *job_ids], capture_output=True, text=True, timeout=COMMAND_TIMEOUT.total_seconds(), check=False
        )
        if out.returncode != 0:
            raise LaunchError(f"scancel {' '.join(job_ids)} failed: {out.stderr.strip() or out.stdout.strip()}")


def submit_helper(
    cfg: RunConfig, name: str, fn: Callable[..., Any], *args: Any, minutes: int = 5, partition: str = ""
) -> submitit.Job:
    """A short one-task job (the site's account, setup lines and sbatch_extra; no GPU) that runs fn(*args) on
    `partition` (the site's by default): `site check`'s probe from a compute node, the relay job of site.relay=job."""
    require_slurm(cfg)
    run_dir = site_run_dir(cfg)
    private_folder(run_dir / "jobs")
    params = sbatch_parameters(cfg, 0)
    for key in ("gres", "gpus_per_node", "mem"):
        params.pop(key, None)
    params.update(
        job_name=f"geofed-{cfg.federation}-{cfg.site.name}-{name}",
        partition=partition or cfg.site.partition,
        time=minutes,
        nodes=1,
        ntasks_per_node=1,
        cpus_per_task=1,
        additional_parameters=dict(cfg.site.sbatch_extra),
    )
    with submission_environment():
        folder = job_folder(run_dir, name)
        executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=0, python=python_command(cfg))
        executor.update_parameters(**params)
        try:
            return executor.submit(fn, *args)
        except (subprocess.CalledProcessError, FailedJobError) as exc:
            detail = getattr(exc, "stderr", None) or getattr(exc, "output", None) or str(exc)
            if isinstance(detail, bytes):
                detail = detail.decode(errors="replace")
            raise LaunchError(f"sbatch refused the {name} job: {str(detail).strip().splitlines()[-1]}") from None
