"""`geofed-hpc relay` (forward sites' connections to their PS from a node with both networks) and the probe of the
paths to the PS that `site check` runs from a compute node."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from geofed_hpc.commands.options import OPTIONS
from geofed_hpc.config import RunConfig, to_dict
from geofed_hpc.config.fields import parse_duration, split_host_port
from geofed_hpc.egress.relay import Relay, run_relay
from geofed_hpc.errors import ConfigError, LaunchError


def cmd_relay(cfg: RunConfig) -> int:
    """Forward to --to (default ps.address) from --listen (default 0.0.0.0 on the PS's port) until Ctrl-C."""
    if OPTIONS.relay_spool:
        return cmd_spool_relay(cfg)
    to = OPTIONS.relay_to or cfg.ps.address
    if not to:
        raise ConfigError("relay: --to HOST:PORT is missing: the parameter server's address, as the relay reaches it")
    target = _address(to, "--to")
    listen = _address(OPTIONS.relay_listen or f"0.0.0.0:{target[1]}", "--listen")
    if OPTIONS.relay_max_connections < 1:
        raise ConfigError(f"--max-connections: expected at least 1, got {OPTIONS.relay_max_connections}")
    idle = parse_duration(OPTIONS.relay_idle, "--idle")
    return run_relay(Relay(target, listen, OPTIONS.relay_max_connections, idle))


def _address(value: str, flag: str) -> tuple[str, int]:
    try:
        return split_host_port(value)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def cmd_spool_relay(cfg: RunConfig) -> int:
    """`relay --spool DIR --to PS`: answer the request files sites leave in DIR/out through the PS (ps.ca_file,
    ps.tls_name and ps.client_* say how to dial it), until Ctrl-C, or with --once until the spool is drained."""
    from dataclasses import replace
    from pathlib import Path

    from geofed_hpc.egress.spoolfile import Spool
    from geofed_hpc.egress.spoolrelay import SpoolRelay, run_spool_relay

    to = OPTIONS.relay_to or cfg.ps.address
    if not to:
        raise ConfigError("relay: --to HOST:PORT is missing: the parameter server's address, as the relay reaches it")
    host, port = _address(to, "--to")
    if OPTIONS.relay_max_connections < 1:
        raise ConfigError(f"--max-connections: expected at least 1, got {OPTIONS.relay_max_connections}")
    poll = parse_duration(OPTIONS.relay_poll, "--poll")
    if not timedelta(milliseconds=10) <= poll <= timedelta(minutes=10):
        raise ConfigError(f"--poll: expected 10ms to 10m, got {poll.total_seconds():g}s")
    spool = Spool(Path(OPTIONS.relay_spool).expanduser().absolute())
    ps = replace(cfg.ps, address=f"{host}:{port}")
    workers = min(OPTIONS.relay_max_connections, 64)
    return run_spool_relay(SpoolRelay(spool, f"{host}:{port}", ps, poll, workers, once=OPTIONS.relay_once))


# How long each path of site.egress may take to answer the probe, and how long `site check` waits for its job.
PROBE_PATH_TIMEOUT = timedelta(seconds=10)
PROBE_JOB_WAIT = timedelta(minutes=10)


def check_paths(cfg: RunConfig, run_dir: Path, address: str) -> list[str]:
    """Probe each path of site.egress (and the others the site file sets up) against the PS where the jobs run: a
    short job through submitit on a Slurm site, this machine for a local one. The result is saved in the run
    directory for `launch`'s preflight; returns one line per path."""
    from geofed_hpc.egress.check import PathResult, probe_job, save

    plain = to_dict(cfg)
    plain["run_dir"] = str(run_dir)
    seconds = PROBE_PATH_TIMEOUT.total_seconds()
    if cfg.site.executor == "slurm":
        from geofed_hpc.launch.slurm import submit_helper

        job = submit_helper(cfg, "egress-check", probe_job, plain, address, seconds, minutes=5)
        print(f"site check: probing the paths to {address} from a compute node (job {job.job_id})", flush=True)
        deadline = time.monotonic() + PROBE_JOB_WAIT.total_seconds()
        while not job.done():  # submitit asks Slurm, at most every few seconds
            if time.monotonic() > deadline:
                job.cancel(check=False)
                raise LaunchError(
                    f"site check: the probe job {job.job_id} did not run within {PROBE_JOB_WAIT}: queued?"
                )
            time.sleep(1)
        try:
            result = job.result()
        except Exception as exc:  # submitit's own errors: the job failed, was cancelled, or its result is lost
            said = str(exc).strip().splitlines()
            raise LaunchError(f"site check: the probe job {job.job_id} failed: {said[-1] if said else exc}") from None
    else:
        result = probe_job(plain, address, seconds)
    path = save(run_dir, result)
    lines = [f"egress   {PathResult(**p).line()}" for p in result["paths"]]
    return [*lines, f"egress   saved in {path} (from {result['node']}): `launch` uses it"]


def _relay_minutes(cfg: RunConfig) -> int:
    """The relay job's time limit: it outlives the site jobs' requeues."""
    import math

    return max(1, math.ceil(cfg.site.timeout.total_seconds() * (1 + cfg.site.max_requeues) / 60))


def relay_job_plan(cfg: RunConfig, run_dir: Path, job_id: str = "RELAY_JOB_ID") -> tuple[list[str], RunConfig]:
    """What site.relay=job submits before the site jobs (lines a dry run prints), and the config the sites are
    submitted with: they depend on the relay job `job_id` (sbatch --dependency=after), so start once it runs (pure)."""
    from dataclasses import replace

    from geofed_hpc.egress.relay import RELAY_FILE

    site, to = cfg.site, cfg.ps.address.split(",")[0]
    lines = [
        f"relay job (site.relay=job): submitted first, on partition {site.relay_partition} for "
        f"{_relay_minutes(cfg)} min: `geofed-hpc relay --to {to}`, its address written to {run_dir / RELAY_FILE}",
        f"  the site jobs depend on it (--dependency=after:{job_id}): they start once it runs, and dial the PS "
        "through it",
    ]
    extra = {**site.sbatch_extra, "dependency": f"after:{job_id}"}
    return lines, replace(cfg, site=replace(site, sbatch_extra=extra))


def start_relay_job(cfg: RunConfig, run_dir: Path) -> tuple[RunConfig, Any]:
    """site.relay=job: submit the relay on site.relay_partition (a partition whose nodes reach the PS) before the site
    jobs; the config the sites are submitted with (they start only once the relay started: --dependency=after) and
    the relay's JobRecord (so that `status`, `logs` and `cancel` see it)."""
    from geofed_hpc.egress.relay import RELAY_FILE, relay_job
    from geofed_hpc.launch.manifest import JobRecord
    from geofed_hpc.launch.slurm import submit_helper

    site = cfg.site
    (run_dir / RELAY_FILE).unlink(missing_ok=True)  # a relay of an earlier launch: gone, or about to be
    to = cfg.ps.address.split(",")[0]
    job = submit_helper(
        cfg, "relay", relay_job, to, str(run_dir), minutes=_relay_minutes(cfg), partition=site.relay_partition
    )
    print(f"submitted the relay to {to} on partition {site.relay_partition}: job {job.job_id}", flush=True)
    record = JobRecord(f"{site.name}-relay", str(job.job_id), site.name, "slurm", str(job.paths.stdout),
                       str(job.paths.stderr))  # fmt: skip
    return relay_job_plan(cfg, run_dir, str(job.job_id))[1], record
