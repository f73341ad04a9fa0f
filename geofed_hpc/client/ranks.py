"""Where a site job's process sits (ranks, nodes, rendezvous address): from submitit, torchrun, or one process."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import submitit
from submitit.helpers import TorchDistributedEnvironment
from submitit.slurm.slurm import SlurmJobEnvironment, SlurmParseException

from geofed_hpc.errors import ConfigError

LOOPBACK = "127.0.0.1"
# The range submitit's TorchDistributedEnvironment draws a job's rendezvous port from, seeded by the job id.
PORT_RANGE = (20000, 60000)


@dataclass(frozen=True)
class SiteRanks:
    """Where this process sits in its site job, and where rank 0 listens for the others."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    master_addr: str = LOOPBACK
    master_port: int = 0
    job_id: str = ""
    local_world_size: int = 1
    num_nodes: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def port_for(key: str) -> int:
    """The rendezvous port for a job id (or any key): submitit's rule, so two site jobs on one node differ."""
    return random.Random(key).randint(*PORT_RANGE)


def _node_list_error() -> ConfigError:
    return ConfigError(f"SLURM_JOB_NODELIST: cannot read a host name from {os.environ.get('SLURM_JOB_NODELIST')!r}")


def _slurm_head() -> str:
    """The first host of this Slurm allocation's node list (submitit's parser), or 127.0.0.1 outside one."""
    if not os.environ.get("SLURM_JOB_ID") or not os.environ.get("SLURM_JOB_NODELIST"):
        return LOOPBACK
    try:
        return SlurmJobEnvironment().hostnames[0]
    except SlurmParseException:
        raise _node_list_error() from None


def _in_submitit_job() -> SiteRanks | None:
    """Ranks from submitit's job environment (Slurm's or LocalExecutor's variables); None outside a submitit job."""
    try:
        job = submitit.JobEnvironment()
    except RuntimeError:
        return None
    try:
        dist = TorchDistributedEnvironment()  # first host of the node list, port from $MASTER_PORT or the job id
    except SlurmParseException:
        raise _node_list_error() from None
    head = dist.master_addr if job.cluster == "slurm" else LOOPBACK  # LocalExecutor: one node, loopback
    return SiteRanks(
        rank=dist.rank,
        local_rank=dist.local_rank,
        world_size=dist.world_size,
        master_addr=os.environ.get("MASTER_ADDR", "") or head,
        master_port=dist.master_port,
        job_id=job.job_id,
        local_world_size=dist.local_world_size,
        num_nodes=job.num_nodes,
    )


def site_ranks() -> SiteRanks:
    """Ranks from submitit's JobEnvironment inside a job, else torchrun's RANK/WORLD_SIZE/LOCAL_RANK, else one
    process.

    MASTER_ADDR: $MASTER_ADDR, else the first host of the job's Slurm node list, else 127.0.0.1.
    MASTER_PORT: $MASTER_PORT, else derived from the job id as submitit's TorchDistributedEnvironment does.
    """
    env = os.environ
    ranks = _in_submitit_job()
    if ranks is None:  # torchrun's variables, or one process
        world = int(env.get("WORLD_SIZE", 1))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        job_id = env.get("SLURM_JOB_ID", "")
        ranks = SiteRanks(
            rank=int(env.get("RANK", 0)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=world,
            master_addr=env.get("MASTER_ADDR", "") or _slurm_head(),
            master_port=int(env.get("MASTER_PORT", 0)) or port_for(job_id or str(os.getppid())),
            job_id=job_id,
            local_world_size=local_world,
            num_nodes=max(1, world // max(1, local_world)),
        )
    if not 0 <= ranks.rank < ranks.world_size:
        tasks = ranks.world_size
        raise ConfigError(f"rank {ranks.rank} is outside the job's {tasks} tasks; check the job's task count")
    return ranks
