"""What a launch will do and hold: its plan in one line, its checkpoints per site, and whether the disk holds them."""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Literal

from geofed_hpc.commands.options import OPTIONS
from geofed_hpc.config import RunConfig
from geofed_hpc.config.run import Footprint, footprint, size
from geofed_hpc.config.train import KEEP_LATEST
from geofed_hpc.launch.executor import mount_entry

DEMO_CORPUS = "bible"
QUOTA_TIMEOUT = timedelta(seconds=10)
Runner = Callable[[Sequence[str]], "str | None"]
# A preflight verdict as preflight.Finding takes it: (level, what, message).
Verdict = tuple[Literal["ok", "warning", "error"], str, str]


def check_corpus(cfg: RunConfig) -> list[Verdict]:
    """A Slurm site on the demo corpus: refused at launch unless --demo asks for it (a local run is the demo)."""
    if cfg.site.executor != "slurm" or cfg.data.source != DEMO_CORPUS:
        return []
    if OPTIONS.demo:
        return [("ok", "data", f"{DEMO_CORPUS}: the demo corpus, as --demo asks")]
    refused = not OPTIONS.dry_run and OPTIONS.command == "launch"  # --dry-run and `site check` say what launch does
    text = (
        f"data.source: {DEMO_CORPUS} is the demo corpus (about 1M tokens: minutes of a GPU, not a cluster run)"
        f"{'' if refused else ', which launch refuses on a Slurm site'}; give yours with data.source=PATH (text files, "
        "or a `geofed-hpc data prepare` folder), or pass --demo to train on the demo corpus here"
    )
    return [("error" if refused else "warning", "data", text)]


def nearest_folder(path: Path) -> Path:
    """`path`, or its nearest parent that exists here."""
    here = Path(path).absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    return here


def run_command(args: Sequence[str], timeout: timedelta = QUOTA_TIMEOUT) -> str | None:
    """stdout of a login node's query (a quota command, sinfo, sacctmgr), or None when the command is missing,
    fails or hangs past `timeout`."""
    if shutil.which(args[0]) is None:
        return None
    try:
        out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout.total_seconds(), check=False)
    except (subprocess.TimeoutExpired, OSError):
        return None
    return out.stdout if out.returncode == 0 else None


def _run(args: Sequence[str]) -> str | None:
    return run_command(args, QUOTA_TIMEOUT)


def _room(numbers: Sequence[str]) -> int | None:
    """Bytes left under a block quota from (used, soft, hard) in KiB ('*' marks one exceeded); None: no limit."""
    try:
        used, soft, hard = (int(n.rstrip("*")) for n in numbers[:3])
    except ValueError:
        return None
    limit = hard or soft
    return max(0, limit - used) * 1024 if limit > 0 else None


def parse_quota(text: str, device: str, point: str) -> int | None:
    """Bytes left on `device` (or `point`) in `quota -w -p` output (Filesystem blocks quota limit ...)."""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[0] in (device, point):
            return _room(fields[1:4])
    return None


def parse_lfs_quota(text: str) -> int | None:
    """Bytes left in `lfs quota -q -u USER MOUNT` output (filesystem kbytes quota limit grace ...)."""
    fields = text.split()
    return _room(fields[1:4]) if len(fields) >= 4 else None


def quota_room(folder: Path, run: Runner = _run, mounts: str | None = None) -> int | None:
    """Bytes this user may still write on `folder`'s filesystem under a block quota; None where no quota command
    answers (or there is no limit)."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return None
    device, point, fstype = mount_entry(folder, mounts)
    user = os.environ.get("USER") or getpass.getuser()
    if fstype == "lustre":
        out = run(["lfs", "quota", "-q", "-u", user, point])
        return parse_lfs_quota(out) if out else None
    out = run(["quota", "-w", "-p", "-u", user])
    return parse_quota(out, device, point) if out else None


def held_bytes(cfg: RunConfig, run_dir: Path) -> int:
    """What the sites' checkpoint folders hold already (a resumed run counts them towards its footprint)."""
    from geofed_hpc.launch.executor import site_names

    total = 0
    for name in site_names(cfg):
        for root, _, files in os.walk(run_dir / "sites" / name / "ckpt"):
            for file in files:
                try:
                    total += (Path(root) / file).stat().st_size
                except OSError:
                    pass
    return total


def disk_finding(fp: Footprint, free: int, where: str, held: int = 0) -> Verdict:
    """Error when the latest checkpoints every run keeps cannot fit in `free` bytes (beside the `held` ones there);
    warning when all it keeps (the best ones too), or the moment one more is written, might not; else ok."""
    surely = fp.sites * KEEP_LATEST * fp.full - held
    need, peak = fp.sites * fp.per_site - held, fp.sites * fp.peak_per_site - held
    text = f"{where}: {size(free)} free; the sites' checkpoints need {size(fp.sites * fp.per_site)}"
    text += f" ({size(held)} there already)" if held else ""
    advice = "free space, lower train.keep_best, or put run_dir (site.run_dir) on a larger filesystem"
    if surely > free:
        return ("error", "disk", f"run_dir: {text}: even the {KEEP_LATEST} latest of each site cannot fit; {advice}")
    if need > free:
        return ("warning", "disk", f"run_dir: {text}: they do not fit once the best ones are kept; {advice}")
    if peak > free:
        return ("warning", "disk", f"run_dir: {text}, up to {size(fp.sites * fp.peak_per_site)}: may not fit")
    return ("ok", "disk", text)


def check_run(cfg: RunConfig, run_dir: Path, run: Runner = _run) -> list[Verdict]:
    """The corpus of a Slurm site (check_corpus); the sites' checkpoints against the free space of the run
    directory's filesystem, and the user's quota there where a quota command answers."""
    found = check_corpus(cfg)
    fp = footprint(cfg)
    folder = nearest_folder(run_dir)
    if folder == Path(folder.anchor) and len(Path(run_dir).absolute().parts) > 2:
        text = f"{size(fp.sites * fp.per_site)} of checkpoints; free space not checked: no folder of {run_dir} is here"
        return [*found, ("ok", "disk", text)]
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return [*found, ("ok", "disk", f"{size(fp.sites * fp.per_site)} of checkpoints; {folder} not readable")]
    room = quota_room(folder, run)
    where = f"{folder}" if room is None or room >= free else f"{folder} (your quota)"
    return [*found, disk_finding(fp, free if room is None else min(free, room), where, held_bytes(cfg, run_dir))]
