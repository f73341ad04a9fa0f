"""Where site jobs run: `site.*` (local processes or a Slurm cluster)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta

from geofed_hpc.config.fields import check, one_of, parse_duration

# GPU type names as clusters spell them in --gres=gpu:TYPE:N / --gpus-per-node=TYPE:N.
GPU_TYPES = (
    "a10", "a100", "a100_80gb", "a100-sxm4-80gb", "a30", "a40", "gh200", "h100", "h100_80gb", "h200", "l4",
    "l40", "l40s", "mi100", "mi210", "mi250", "mi300a", "mi300x", "p100", "quadro_rtx_6000", "rtx6000",
    "rtx_a6000", "t4", "v100", "v100s", "v100_32gb",
)  # fmt: skip


@dataclass
class SiteConfig:
    """Where site jobs run: `local` processes through submitit, or a Slurm cluster (the fields below `token`)."""

    name: str = "local"
    executor: str = "local"
    num_sites: int = 2
    # Data shards: this config's sites train shards first_shard.. of shard_count (0: first_shard + num_sites),
    # so several site configs of one federation never train on the same data.
    first_shard: int = 0
    shard_count: int = 0
    embedded_ps: bool = True
    cpus_per_site: int = 1
    timeout: timedelta = timedelta(hours=1)
    token: str = ""
    partition: str = ""
    account: str = ""
    qos: str = ""
    constraint: str = ""
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    gpu_type: str = ""
    gpu_style: str = "gres"
    mem_gb: float = 0.0
    setup: list[str] = field(default_factory=list)
    python: str = ""
    signal_delay: timedelta = timedelta(seconds=90)
    max_requeues: int = 3
    use_srun: bool = True
    proxy: str = ""
    run_dir: str = ""
    shared_fs: bool = False
    sbatch_extra: dict[str, str] = field(default_factory=dict)

    @property
    def shards(self) -> int:
        """How many data shards the federation's data is split into."""
        return self.shard_count or self.first_shard + self.num_sites

    def __post_init__(self) -> None:
        self.timeout = parse_duration(self.timeout, "site.timeout")
        self.signal_delay = parse_duration(self.signal_delay, "site.signal_delay")
        one_of(self.executor, ("local", "slurm"), "site.executor")
        check(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", self.name)), "site.name", "use letters, digits, _ . -")
        check(1 <= self.num_sites <= 64, "site.num_sites", f"must be in 1..64, got {self.num_sites}")
        check(self.first_shard >= 0, "site.first_shard", f"must be 0 or more, got {self.first_shard}")
        check(
            self.shard_count == 0 or self.shard_count >= self.first_shard + self.num_sites,
            "site.shard_count",
            f"is {self.shard_count}, but sites {self.first_shard}..{self.first_shard + self.num_sites - 1} need "
            f"at least {self.first_shard + self.num_sites} shards (0: first_shard + num_sites)",
        )
        check(self.cpus_per_site >= 1, "site.cpus_per_site", "must be at least 1")
        for key in ("nodes", "tasks_per_node"):
            check(getattr(self, key) >= 1, f"site.{key}", f"must be at least 1, got {getattr(self, key)}")
        check(self.gpus_per_node >= 0, "site.gpus_per_node", "must be 0 (CPU only) or more")
        check(self.mem_gb >= 0, "site.mem_gb", "must be 0 (the partition's default) or more")
        check(self.max_requeues >= 0, "site.max_requeues", "must be 0 or more")
        one_of(self.gpu_style, ("gres", "gpus", "none"), "site.gpu_style")
        if self.gpu_type:
            check(
                self.gpu_type in GPU_TYPES,
                "site.gpu_type",
                f"unknown GPU type {self.gpu_type!r}; known: {', '.join(GPU_TYPES)} "
                "(or leave it empty and put the cluster's own gres string in site.sbatch_extra)",
            )
            check(self.gpus_per_node > 0, "site.gpu_type", "is set but site.gpus_per_node is 0")
        self.setup = list(self.setup)
        check(all(isinstance(s, str) for s in self.setup), "site.setup", "must be a list of shell lines")
        self.sbatch_extra = dict(self.sbatch_extra)
        for key, value in self.sbatch_extra.items():
            check(
                bool(re.fullmatch(r"[a-z][a-z0-9_-]*", str(key))) and isinstance(value, (str, int, bool)),
                "site.sbatch_extra",
                f"expected sbatch option names (no leading --) to string values, got {key!r}: {value!r}",
            )
        if self.proxy:
            check(
                bool(re.fullmatch(r"https?://[^\s/]+(:\d+)?/?", self.proxy)),
                "site.proxy",
                f"expected http://host:port, got {self.proxy!r}",
            )
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
