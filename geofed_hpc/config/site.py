"""Where site jobs run: `site.*` (local processes or a Slurm cluster)."""

from __future__ import annotations

import re
from dataclasses import field
from datetime import timedelta
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, StrictBool, StrictFloat, StrictInt

from geofed_hpc.config.fields import Duration, Name, OneOrMany, check, pattern, split_host_port
from geofed_hpc.config.section import section

# GPU type names as clusters spell them in --gres=gpu:TYPE:N / --gpus-per-node=TYPE:N.
GPU_TYPES = (
    "a10", "a100", "a100_80gb", "a100-sxm4-80gb", "a30", "a40", "gh200", "h100", "h100_80gb", "h200", "l4",
    "l40", "l40s", "mi100", "mi210", "mi250", "mi300a", "mi300x", "p100", "quadro_rtx_6000", "rtx6000",
    "rtx_a6000", "t4", "v100", "v100s", "v100_32gb",
)  # fmt: skip

_SBATCH_OPTION = pattern(r"[a-z][a-z0-9_-]*", "expected sbatch option names without the leading --, got {value!r}")
_PROXY_URL = re.compile(r"https?://(?:[^\s/@]+@)?(?P<where>[^\s/@]+)/?")


def _proxy(value: str) -> str:
    """http://[user:pass@]host:port (the port in 1..65535), or empty."""
    match = _PROXY_URL.fullmatch(value)
    if value and not match:
        raise ValueError(f"expected http://[USER:PASS@]host:port, got {value.rsplit('@', 1)[-1]!r}")
    if match and ":" in match.group("where").rsplit("]", 1)[-1]:
        split_host_port(match.group("where"))
    return value


def _relay(value: str) -> str:
    """HOST:PORT, `job`, or empty."""
    if value and value != "job":
        split_host_port(value)
    return value


def _tunnel(value: str) -> str:
    """USER@HOST[:PORT], or empty."""
    if value and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*@[A-Za-z0-9_.-]+(:\d{1,5})?", value):
        raise ValueError(f"expected USER@LOGIN_HOST[:SSH_PORT], got {value!r}")
    return value


@section("site")
class SiteConfig:
    """Where site jobs run: `local` processes through submitit, or a Slurm cluster (the fields below `token`)."""

    name: Name = "local"
    """This site's name: job names, checkpoint folders and the PS's view of it."""
    executor: Literal["local", "slurm"] = "local"
    """`local`: processes on this machine; `slurm`: one sbatch job per site."""
    num_sites: Annotated[StrictInt, Field(ge=1, le=64)] = 2
    """How many site jobs this config starts."""
    first_shard: Annotated[StrictInt, Field(ge=0)] = 0
    """This config's sites train data shards first_shard.. of `shards`, so that several site configs of one
    federation never train on the same data."""
    shard_count: Annotated[StrictInt, Field(ge=0)] = 0
    """How many shards the data is split into (0: first_shard + num_sites)."""
    embedded_ps: StrictBool = True
    """Run the parameter server inside `launch` (local demos); a Slurm site dials ps.address instead."""
    cpus_per_task: Annotated[StrictInt, Field(ge=1)] = 1
    """CPU cores per task (--cpus-per-task): per rank, so a job gets nodes x tasks_per_node x this many."""
    timeout: Duration = timedelta(hours=1)
    """The job's time limit (Slurm: whole minutes)."""
    token: str = ""
    """The site's enrollment token (`token issue` on the PS), if the PS requires one."""
    partition: str = ""
    """Slurm partition (`sinfo -s` lists them)."""
    account: str = ""
    """Slurm --account (allocation / project), if the cluster charges one."""
    qos: str = ""
    """Slurm quality of service."""
    constraint: str = ""
    """Slurm node features (--constraint)."""
    nodes: Annotated[StrictInt, Field(ge=1)] = 1
    """Nodes per site job (Slurm; more than one: srun starts tasks_per_node ranks on each, and they meet at the
    first node of the allocation)."""
    tasks_per_node: Annotated[StrictInt, Field(ge=1)] = 1
    """Training processes (ranks) per node, usually one per GPU; the site's model is sharded over all of them."""
    gpus_per_node: Annotated[StrictInt, Field(ge=0)] = 0
    """GPUs per node (0: CPU only)."""
    gpu_type: str = ""
    """GPU type in the cluster's spelling, one of GPU_TYPES ("": any)."""
    gpu_style: Literal["gres", "gpus", "none"] = "gres"
    """How GPUs are asked for: --gres=gpu:TYPE:N, --gpus-per-node=TYPE:N, or not at all."""
    mem_gb: Annotated[StrictFloat, Field(ge=0)] = 0.0
    """Memory per node in GB (0: the partition's default)."""
    setup: Annotated[list[str], OneOrMany] = field(default_factory=list)
    """Shell lines run before training (module load ..., conda activate ...); one string is one line."""
    python: str = ""
    """The interpreter after `setup` ("": the one running `launch`)."""
    signal_delay: Duration = timedelta(seconds=90)
    """USR2 comes this long before the time limit: time to checkpoint and requeue."""
    max_requeues: Annotated[StrictInt, Field(ge=0)] = 3
    """Requeues after a time-out (preemptions are not counted)."""
    use_srun: StrictBool = True
    """Start the tasks with srun inside the job."""
    proxy: Annotated[str, AfterValidator(_proxy)] = ""
    """http://[USER:PASS@]host:port when compute nodes reach the internet only through it ("": none). The PS's
    connection tunnels through it with HTTP CONNECT, TLS end to end; many proxies allow CONNECT only to port 443,
    so run the PS on ps.port=443 for such a cluster."""
    egress: Annotated[list[Literal["direct", "proxy", "relay", "tunnel", "spool"]], OneOrMany] = field(
        default_factory=lambda: ["direct", "proxy"]
    )
    """How the job reaches the PS: the first of these paths that works, in this order (direct: dial ps.address;
    proxy: through site.proxy; relay: through site.relay; tunnel: ssh -L through site.tunnel; spool: files on a
    shared filesystem). `geofed-hpc site check` tries each from a compute node."""
    relay: Annotated[str, AfterValidator(_relay)] = ""
    """HOST:PORT of a `geofed-hpc relay` the compute nodes reach, or `job`: `launch` starts the relay as a Slurm
    job on site.relay_partition (a partition with egress) first ("": none)."""
    relay_partition: str = ""
    """The partition whose nodes reach the PS, where `launch` runs the relay when site.relay=job."""
    tunnel: Annotated[str, AfterValidator(_tunnel)] = ""
    """USER@LOGIN_HOST[:SSH_PORT]: the job runs `ssh -N -L` there with the user's own keys (no passphrase, or an
    agent) and dials the PS through it ("": none)."""
    tunnel_identity: str = ""
    """The private key ssh uses for site.tunnel ("": ssh's own defaults, ~/.ssh/id_*)."""
    tunnel_known_hosts: str = ""
    """The known_hosts file that holds the login node's host key ("": ~/.ssh/known_hosts)."""
    spool: str = ""
    """A folder the compute nodes and a node that reaches the PS both see (site.egress: spool): the job's calls go
    there as files, moved to the PS and back by `geofed-hpc relay --spool SPOOL --to PS_HOST:PORT` ("": none)."""
    spool_poll: Annotated[Duration, Field(ge=timedelta(milliseconds=10), le=timedelta(minutes=10))] = timedelta(
        seconds=1
    )
    """With the spool: the longest wait between two looks for an answer (the first look comes after 5 ms)."""
    run_dir: str = ""
    """A filesystem every node shares; the run lives in <run_dir>/<federation> ("": the top-level run_dir)."""
    shared_fs: StrictBool = False
    """True silences the check that run_dir is on a shared filesystem."""
    sbatch_extra: dict[Annotated[str, _SBATCH_OPTION], str | StrictInt | StrictBool] = field(default_factory=dict)
    """More sbatch options, name (no leading --) to value."""

    @property
    def shards(self) -> int:
        """How many data shards the federation's data is split into."""
        return self.shard_count or self.first_shard + self.num_sites

    def __post_init__(self) -> None:
        check(
            self.shard_count == 0 or self.shard_count >= self.first_shard + self.num_sites,
            "site.shard_count",
            f"is {self.shard_count}, but sites {self.first_shard}..{self.first_shard + self.num_sites - 1} need "
            f"at least {self.first_shard + self.num_sites} shards (0: first_shard + num_sites)",
        )
        if self.gpu_type:
            check(
                self.gpu_type in GPU_TYPES,
                "site.gpu_type",
                f"unknown GPU type {self.gpu_type!r}; known: {', '.join(GPU_TYPES)} "
                "(or leave it empty and put the cluster's own gres string in site.sbatch_extra)",
            )
            check(self.gpus_per_node > 0, "site.gpu_type", "is set but site.gpus_per_node is 0")
        if self.nodes > 1:
            check(self.executor == "slurm", "site.nodes", f"is {self.nodes}: several nodes need site.executor=slurm")
        if self.nodes * self.tasks_per_node > 1 and self.executor == "slurm":
            check(
                self.use_srun,
                "site.use_srun",
                f"is false but the job has {self.nodes * self.tasks_per_node} tasks (site.nodes x site.tasks_per_node):"
                " only srun starts them all; set it true",
            )
        check(bool(self.egress), "site.egress", "is empty: list the paths to the PS to try, e.g. [direct, proxy]")
        check(len(set(self.egress)) == len(self.egress), "site.egress", f"names a path twice: {', '.join(self.egress)}")
        if self.relay == "job":
            check(bool(self.relay_partition), "site.relay_partition", "site.relay=job needs a partition with egress")
        if self.executor == "slurm":
            check(bool(self.partition), "site.partition", "a Slurm site needs a partition (`sinfo -s` lists them)")
            check(
                not self.embedded_ps,
                "site.embedded_ps",
                "Slurm jobs outlive `launch`: set it false, run `geofed-hpc ps up` and pass ps.address",
            )
            check(
                self.timeout >= timedelta(minutes=1),
                "site.timeout",
                f"Slurm time limits are whole minutes, got {self.timeout.total_seconds():g}s",
            )
            check(
                self.signal_delay >= timedelta(seconds=10),
                "site.signal_delay",
                "leave a Slurm job at least 10s between its warning signal and the kill",
            )
