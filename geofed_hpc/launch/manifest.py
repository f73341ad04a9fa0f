"""The launch manifest: which job runs which site, where its logs are, which PS it dials, with what config."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from geofed_hpc.errors import ConfigError

FILE_NAME = "launch.json"


@dataclass
class JobRecord:
    """One submitted site job (a requeued job keeps its id, so one record covers all its segments)."""

    site: str
    job_id: str
    cluster_site: str
    executor: str
    stdout: str
    stderr: str
    submitted: float = field(default_factory=time.time)


@dataclass
class Manifest:
    """Everything `launch` submitted into one run directory, newest last."""

    federation: str
    run_dir: str
    ps_address: str = ""
    jobs: list[JobRecord] = field(default_factory=list)
    configs: dict[str, Any] = field(default_factory=dict)

    def latest(self, cluster_site: str | None = None) -> dict[str, JobRecord]:
        """The newest job of every site (optionally only those of one site config), by site name."""
        out: dict[str, JobRecord] = {}
        for job in self.jobs:
            if cluster_site is None or job.cluster_site == cluster_site:
                out[job.site] = job
        return dict(sorted(out.items()))


def manifest_path(run_dir: Path) -> Path:
    return Path(run_dir) / FILE_NAME


def load_manifest(run_dir: Path) -> Manifest | None:
    """The manifest in `run_dir`, or None when nothing was launched there."""
    path = manifest_path(run_dir)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable launch manifest ({exc}); move it away and launch again") from None
    try:
        jobs = [JobRecord(**j) for j in raw.pop("jobs", [])]
        return Manifest(jobs=jobs, **raw)
    except TypeError as exc:
        raise ConfigError(f"{path}: unexpected launch manifest layout ({exc})") from None


def save_manifest(manifest: Manifest) -> Path:
    """Write atomically (temp file, then rename) so a reader never sees half a manifest; readable by its owner only,
    since the configs it records hold the sites' tokens."""
    path = manifest_path(Path(manifest.run_dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the configs hold each site's site.token
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(asdict(manifest), indent=2, sort_keys=True) + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def record_jobs(
    run_dir: Path, federation: str, ps_address: str, cluster_site: str, config: dict[str, Any], jobs: list[JobRecord]
) -> Path:
    """Add freshly submitted jobs (and the config they run) to the run directory's manifest."""
    manifest = load_manifest(run_dir) or Manifest(federation=federation, run_dir=str(run_dir))
    manifest.ps_address = ps_address
    manifest.configs[cluster_site] = config
    manifest.jobs.extend(jobs)
    return save_manifest(manifest)


def private_folder(folder: Path) -> Path:
    """`folder` made (or tightened) 0700: the jobs' folders hold their pickled config, site.token included."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder
