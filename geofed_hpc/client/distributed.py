"""torch.distributed for a site job: ranks from submitit/Slurm (or torchrun), gloo on CPU, nccl on GPU."""

from __future__ import annotations

import os
import re
import sys
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import submitit
import torch
import torch.distributed as dist

from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger

PORT_BASE, PORT_SPAN = 20000, 20000
# How long `wait_released` waits for the process group's threads to let go of a collective's tensor.
RELEASE_TIMEOUT = timedelta(seconds=10)
RELEASE_LINGER = timedelta(milliseconds=20)


@dataclass(frozen=True)
class SiteRanks:
    """Where this process sits in its site job, and where rank 0 listens for the others."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    job_id: str = ""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[007-009,012],cpu1' -> 'gpu007', 'a,b' -> 'a'."""
    match = re.match(r"^([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", nodelist.strip())
    if not match or not match.group(1):
        raise ConfigError(f"SLURM_JOB_NODELIST: cannot read a host name from {nodelist!r}")
    prefix, ranges, suffix = match.groups()
    if not ranges:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{suffix}"


def port_for(job_id: str) -> int:
    """A rendezvous port derived from the job id, so two site jobs on one node do not collide."""
    return PORT_BASE + zlib.crc32(job_id.encode()) % PORT_SPAN


def site_ranks(env: Mapping[str, str] | None = None) -> SiteRanks:
    """Ranks from submitit's JobEnvironment inside a job, else torchrun's RANK/WORLD_SIZE, else one process.

    MASTER_ADDR: $MASTER_ADDR, else the first host of SLURM_JOB_NODELIST under Slurm, else 127.0.0.1.
    MASTER_PORT: $MASTER_PORT, else derived from the job id.
    """
    env = os.environ if env is None else env
    nodes = env.get("SLURM_JOB_NODELIST", "")
    try:
        job = submitit.JobEnvironment()
        rank, local, world, job_id = job.global_rank, job.local_rank, job.num_tasks, job.job_id
        head = job.hostnames[0] if job.cluster == "slurm" and nodes else "127.0.0.1"
    except RuntimeError:  # not inside a submitit job: torchrun's variables, or one process
        rank, local = int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0))
        world, job_id = int(env.get("WORLD_SIZE", 1)), env.get("SLURM_JOB_ID", "")
        head = first_host(nodes) if nodes and job_id else "127.0.0.1"
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside the job's {world} tasks; check the job's task count")
    addr = env.get("MASTER_ADDR", "") or head
    port = int(env.get("MASTER_PORT", 0)) or port_for(job_id or str(os.getppid()))
    return SiteRanks(rank, local, world, addr, port, job_id)


def pick_device(ranks: SiteRanks, want: str = "auto") -> torch.device:
    """cuda:local_rank when a GPU is there (and `want` is auto or cuda), else cpu."""
    if want not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device: must be auto, cpu or cuda, got {want!r}")
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda was asked for but no GPU is visible to this task")
    if want != "cpu" and torch.cuda.is_available():
        count = torch.cuda.device_count()
        index = ranks.local_rank % count
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_distributed(ranks: SiteRanks, device: torch.device, timeout: timedelta) -> bool:
    """Join the site's process group (nccl on GPU, gloo on CPU); False (and nothing done) for one process."""
    if ranks.world_size == 1 or dist.is_initialized():
        return dist.is_initialized()
    backend = "nccl" if device.type == "cuda" else "gloo"
    logger.info(
        "rank %d/%d: %s process group via %s:%d on %s",
        ranks.rank,
        ranks.world_size,
        backend,
        ranks.master_addr,
        ranks.master_port,
        device,
    )
    dist.init_process_group(
        backend,
        init_method=f"tcp://{ranks.master_addr}:{ranks.master_port}",
        rank=ranks.rank,
        world_size=ranks.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    return True


def close_distributed() -> None:
    """Leave the process group, if any: waits for its pending work (call it before the interpreter exits, never
    after an error inside a collective: a peer may be gone mid-operation). Best effort: the process ends next."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001
            logger.warning("leaving the process group failed: %s", exc)


def holders(tensor: torch.Tensor) -> int:
    """How many references `tensor` has now; after a collective on it, `wait_released` waits until it is back."""
    return sys.getrefcount(tensor)


def wait_released(tensor: torch.Tensor, before: int, timeout: timedelta = RELEASE_TIMEOUT) -> None:
    """After a rank's last collective on `tensor`: wait (sleeping, so without the GIL) until the process group's
    worker thread has dropped its reference, i.e. until `tensor` has the `before` holders it had.

    A gloo worker frees a finished collective after the caller's wait returned, and freeing a tensor Python
    knows needs the GIL. If the interpreter is already exiting by then, Python ends that thread in the middle
    of a C++ destructor and the process aborts ("terminate called without an active exception") after all its
    work was done. Only the last collective needs this: a process that goes on gives the worker its GIL.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    while sys.getrefcount(tensor) > before and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(RELEASE_LINGER.total_seconds())  # the group's other worker thread may still free an earlier one
