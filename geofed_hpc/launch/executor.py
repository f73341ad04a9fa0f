"""Pure functions from a site config to Slurm job parameters and the exact sbatch text submitit submits."""

from __future__ import annotations

import getpass
import math
import os
import re
import shlex
import sys
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from submitit.slurm.slurm import _make_sbatch_string

from geofed_hpc.config import RunConfig
from geofed_hpc.errors import ConfigError

# Filesystems that every node of a cluster mounts (a run directory elsewhere is likely node-local).
SHARED_FS_TYPES = frozenset(
    {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "ceph", "cephfs", "cifs", "smb3", "panfs", "wekafs", "vast", "9p"}
)
_VAR = re.compile(r"\$(\w+)|\$\{(\w+)\}")


def _fmt(delta: timedelta) -> str:
    """90s, 5m, 6m30s, 2h: how durations are written in the config."""
    seconds = delta.total_seconds()
    if seconds != int(seconds):
        return f"{seconds:g}s"
    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    text = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "") + (f"{secs}s" if secs else "")
    return text or "0s"


def site_names(cfg: RunConfig) -> list[str]:
    """The name of every site job this config launches (also its folder under run_dir/sites)."""
    return [f"{cfg.site.name}-{i}" for i in range(cfg.site.num_sites)]


def site_run_dir(cfg: RunConfig, environ: Mapping[str, str] | None = None, strict: bool = True) -> Path:
    """The fixed run directory: `site.run_dir/<federation>` when the site names a root, else `run_dir`.

    Environment variables ($SCRATCH, $USER) are expanded here, on the login node; `strict=False` (a dry run
    elsewhere) leaves unset ones as they are.
    """
    env = os.environ if environ is None else environ
    key, raw = ("site.run_dir", cfg.site.run_dir) if cfg.site.run_dir else ("run_dir", cfg.run_dir)
    expanded = _expand(raw, env)
    unset = unset_variables(raw, env)
    if unset and strict:
        raise ConfigError(
            f"{key}: {raw!r} uses ${unset[0]}, which is not set here; export it on this login node, or give {key}=PATH"
        )
    root = Path(expanded).expanduser()
    root = root if unset else root.absolute()
    return root / cfg.federation if cfg.site.run_dir else root


def _fallback(name: str) -> str | None:
    """$USER and $HOME where the environment lacks them (a container, a cron job): from the password database."""
    if name in ("USER", "LOGNAME"):
        return getpass.getuser()
    if name == "HOME":
        return str(Path.home())
    return None


def _expand(text: str, env: Mapping[str, str]) -> str:
    """$VAR and ${VAR} from `env` ($USER, $HOME from the system when unset); unknown variables stay as they are."""
    return _VAR.sub(
        lambda m: env.get(m.group(1) or m.group(2)) or _fallback(m.group(1) or m.group(2)) or m.group(0), text
    )


def unset_variables(text: str, env: Mapping[str, str]) -> list[str]:
    """The $VARIABLES of `text` that neither `env` nor the system's fallback knows."""
    names = [m.group(1) or m.group(2) for m in _VAR.finditer(text)]
    return [n for n in names if not env.get(n) and _fallback(n) is None]


def job_folder(run_dir: Path, site_name: str) -> Path:
    """submitit's folder for one site's jobs: sbatch file, pickles and logs (`%j` is the job id)."""
    return run_dir / "jobs" / site_name / "%j"


def check_slurm_site(cfg: RunConfig) -> None:
    """Checks that need more than the site section: the time limit against the sync cadence."""
    site = cfg.site
    if site.executor != "slurm":
        raise ConfigError(f"site.executor: site {site.name!r} is {site.executor!r}, not a Slurm site")
    if cfg.train.device == "cuda" and not site.gpus_per_node and site.gpu_style != "none":
        raise ConfigError(
            "train.device: is cuda but site.gpus_per_node is 0, so the job would get no GPU; set site.gpus_per_node "
            "(or site.gpu_style=none where the partition brings its GPUs)"
        )
    need = cfg.train.sync_interval + site.signal_delay
    if site.timeout < need:
        raise ConfigError(
            f"site.timeout: {_fmt(site.timeout)} is shorter than train.sync_interval ({_fmt(cfg.train.sync_interval)})"
            f" + site.signal_delay ({_fmt(site.signal_delay)}) = {_fmt(need)}: a job would be told to stop before "
            "it finished one sync; raise site.timeout or lower one of the others"
        )


def setup_lines(cfg: RunConfig) -> list[str]:
    """Shell lines the batch script runs before the job: the site's own, then the compute-node proxy."""
    lines = list(cfg.site.setup)
    if cfg.site.proxy:
        p = shlex.quote(cfg.site.proxy)
        lines.append(f"export https_proxy={p} http_proxy={p} grpc_proxy={p}  # compute nodes reach out via this")
    return lines


def _gpus(cfg: RunConfig) -> dict[str, Any]:
    site = cfg.site
    if not site.gpus_per_node or site.gpu_style == "none":
        return {}
    count = f"{site.gpu_type}:{site.gpus_per_node}" if site.gpu_type else str(site.gpus_per_node)
    if site.gpu_style == "gres":
        return {"gres": f"gpu:{count}"}
    return {"gpus_per_node": count}


def sbatch_parameters(cfg: RunConfig, site_index: int) -> dict[str, Any]:
    """submitit SlurmExecutor parameters (Slurm's own names) for one site job."""
    site = cfg.site
    params: dict[str, Any] = {
        "job_name": f"geofed-{cfg.federation}-{site.name}-{site_index}",
        "partition": site.partition,
        "time": max(1, math.ceil(site.timeout.total_seconds() / 60)),
        "nodes": site.nodes,
        "ntasks_per_node": site.tasks_per_node,
        "cpus_per_task": site.cpus_per_task,
        "signal_delay_s": int(site.signal_delay.total_seconds()),
        "use_srun": site.use_srun,
        "stderr_to_stdout": False,
        # --requeue: clusters whose JobRequeue=0 refuse `scontrol requeue` (submitit's own requeue) without it
        "additional_parameters": {"requeue": True, **site.sbatch_extra},
        **_gpus(cfg),
    }
    for key in ("account", "qos", "constraint"):
        if getattr(site, key):
            params[key] = getattr(site, key)
    if site.mem_gb:
        params["mem"] = f"{site.mem_gb:g}GB" if site.mem_gb == int(site.mem_gb) else f"{int(site.mem_gb * 1024)}MB"
    lines = setup_lines(cfg)
    if lines:
        params["setup"] = lines
    return params


def python_command(cfg: RunConfig) -> str:
    """How the batch script starts Python: the site's `python`, else the interpreter running `launch`."""
    return cfg.site.python or shlex.quote(sys.executable)


def submit_command(cfg: RunConfig, folder: Path) -> str:
    """The command submitit puts in the batch script (same text as SlurmExecutor builds)."""
    return " ".join([python_command(cfg), "-u -m submitit.core._submit", shlex.quote(str(folder))])


def sbatch_preview(cfg: RunConfig, site_index: int, run_dir: Path) -> str:
    """The batch script submitit will write for this site job, built by submitit's own function."""
    folder = job_folder(run_dir, f"{cfg.site.name}-{site_index}")
    return _make_sbatch_string(command=submit_command(cfg, folder), folder=folder, **sbatch_parameters(cfg, site_index))


def mount_entry(path: Path, mounts: str) -> tuple[str, str, str]:
    """(device, mount point, filesystem type) holding `path`, from /proc/mounts text."""
    best = ("", "/", "")
    target = str(path)
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[1]):
            best = (parts[0], point, parts[2])
    return best


def shared_fs_warning(path: Path, mounts: str) -> str | None:
    """A warning when `path` sits on a filesystem that compute nodes are unlikely to share."""
    _, point, fstype = mount_entry(path, mounts)
    if fstype in SHARED_FS_TYPES or fstype.startswith("fuse."):
        return None
    return (
        f"run directory {path} is on {fstype or 'an unknown filesystem'} (mounted at {point}), which compute nodes "
        "usually do not share: requeued jobs would not find their checkpoints. Put site.run_dir on a shared "
        "filesystem ($SCRATCH, $WORK, project space), or set site.shared_fs=true if it is shared"
    )


def federation_summary(cfg: RunConfig, run_dir: Path, environ: Mapping[str, str] | None = None) -> list[str]:
    """What a launch sets up, paths expanded as this login node expands them: the jobs, where they write, the PS
    they dial (TLS files, token), the model, codec, paradigm and cadence; then what the run will do (syncs, hours,
    tokens, data) and the checkpoints each site keeps."""
    from geofed_hpc.config.run import footprint, run_plan

    env = os.environ if environ is None else environ
    site, ps, train = cfg.site, cfg.ps, cfg.train

    def path(text: str) -> str:
        return str(Path(_expand(text, env)).expanduser()) if text else "-"

    names = site_names(cfg)
    shown = ", ".join(names[:4]) + (f", ... ({len(names)})" if len(names) > 4 else "")
    lines = [
        f"federation {cfg.federation}: site {site.name} submits {len(names)} job{'s' * (len(names) != 1)} ({shown}) on "
        f"data shards {site.first_shard}..{site.first_shard + site.num_sites - 1} of {site.shards}",
        f"run directory {run_dir} (checkpoints in sites/, job files and logs in jobs/, metrics in metrics/)",
    ]
    unset = unset_variables(site.run_dir or cfg.run_dir, env)
    if unset:
        lines.append(f"  ${unset[0]} is not set here: `launch` refuses it until it is (or give site.run_dir=PATH)")
    if ps.insecure:
        tls = "plaintext (ps.insecure=true: local tests only)"
    else:
        tls = f"TLS, CA {path(ps.ca_file)}"
        if ps.client_cert_file:
            tls += f", client certificate {path(ps.client_cert_file)}"
    token = "set" if site.token else "none (site.token=...)"
    lines.append(f"parameter server {ps.address or '(ps.address not set)'}, {tls}, enrollment token {token}")
    start = f", from {path(cfg.model.init_from)}" if cfg.model.init_from else ""
    cadence = f"every {_fmt(train.sync_interval)}" if train.sync_interval.total_seconds() > 0 else ""
    cadence += f"{' or ' if cadence else 'every '}{train.max_local_steps} steps" if train.max_local_steps else ""
    syncs = f", {train.max_syncs} syncs" if train.max_syncs else ""
    lines.append(
        f"model {cfg.model.name} ({cfg.model.arch}{start}), paradigm {cfg.paradigm.name}, codec {cfg.codec.name}, "
        f"sync {cadence}{syncs}, data {cfg.data.source}, python {python_command(cfg)}"
    )
    lines.append(run_plan(cfg))
    lines.append(footprint(cfg).describe())
    return lines
