"""Typed, validated configuration dataclasses built from the composed Hydra tree."""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from geofed_hpc.errors import ConfigError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: Any, name: str) -> timedelta:
    """Read `30`, `30s`, `5m`, `2h`, `250ms` or a timedelta; the error names the field."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a duration like 30s, 5m or 2h, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise ConfigError(f"{name}: expected a duration like 30s, 5m or 2h, got {value!r}")
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2) or "s"]
    if seconds < 0:
        raise ConfigError(f"{name}: a duration cannot be negative, got {value!r}")
    return timedelta(seconds=seconds)


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {message}")


def _one_of(value: str, choices: tuple[str, ...], name: str) -> None:
    _check(value in choices, name, f"must be one of {', '.join(choices)}; got {value!r}")


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
        _one_of(self.executor, ("local", "slurm"), "site.executor")
        _check(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", self.name)), "site.name", "use letters, digits, _ . -")
        _check(1 <= self.num_sites <= 64, "site.num_sites", f"must be in 1..64, got {self.num_sites}")
        _check(self.first_shard >= 0, "site.first_shard", f"must be 0 or more, got {self.first_shard}")
        _check(
            self.shard_count == 0 or self.shard_count >= self.first_shard + self.num_sites,
            "site.shard_count",
            f"is {self.shard_count}, but sites {self.first_shard}..{self.first_shard + self.num_sites - 1} need "
            f"at least {self.first_shard + self.num_sites} shards (0: first_shard + num_sites)",
        )
        _check(self.cpus_per_site >= 1, "site.cpus_per_site", "must be at least 1")
        for key in ("nodes", "tasks_per_node"):
            _check(getattr(self, key) >= 1, f"site.{key}", f"must be at least 1, got {getattr(self, key)}")
        _check(self.gpus_per_node >= 0, "site.gpus_per_node", "must be 0 (CPU only) or more")
        _check(self.mem_gb >= 0, "site.mem_gb", "must be 0 (the partition's default) or more")
        _check(self.max_requeues >= 0, "site.max_requeues", "must be 0 or more")
        _one_of(self.gpu_style, ("gres", "gpus", "none"), "site.gpu_style")
        if self.gpu_type:
            _check(
                self.gpu_type in GPU_TYPES,
                "site.gpu_type",
                f"unknown GPU type {self.gpu_type!r}; known: {', '.join(GPU_TYPES)} "
                "(or leave it empty and put the cluster's own gres string in site.sbatch_extra)",
            )
            _check(self.gpus_per_node > 0, "site.gpu_type", "is set but site.gpus_per_node is 0")
        self.setup = list(self.setup)
        _check(all(isinstance(s, str) for s in self.setup), "site.setup", "must be a list of shell lines")
        self.sbatch_extra = dict(self.sbatch_extra)
        for key, value in self.sbatch_extra.items():
            _check(
                bool(re.fullmatch(r"[a-z][a-z0-9_-]*", str(key))) and isinstance(value, (str, int, bool)),
                "site.sbatch_extra",
                f"expected sbatch option names (no leading --) to string values, got {key!r}: {value!r}",
            )
        if self.proxy:
            _check(
                bool(re.fullmatch(r"https?://[^\s/]+(:\d+)?/?", self.proxy)),
                "site.proxy",
                f"expected http://host:port, got {self.proxy!r}",
            )
        if self.executor == "slurm":
            _check(bool(self.partition), "site.partition", "a Slurm site needs a partition (`sinfo -s` lists them)")
            _check(
                not self.embedded_ps,
                "site.embedded_ps",
                "Slurm jobs outlive `launch`: set it false, run `geofed-hpc ps up` and pass ps.address",
            )
            _check(
                self.timeout >= timedelta(minutes=1),
                "site.timeout",
                f"Slurm time limits are whole minutes, got {self.timeout.total_seconds():g}s",
            )
            _check(
                self.signal_delay >= timedelta(seconds=10),
                "site.signal_delay",
                "leave a Slurm job at least 10s between its warning signal and the kill",
            )


@dataclass
class ModelConfig:
    """A decoder-only causal language model's shape."""

    name: str = "tiny"
    arch: str = "gpt2"
    vocab_size: int = 50257
    context: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    dropout: float = 0.0
    tie_embeddings: bool = True
    # Llama only: grouped-query attention (0 = n_heads), RoPE base and Llama 3 frequency scaling (1 = off).
    n_kv_heads: int = 0
    rope_theta: float = 10000.0
    rope_scaling: float = 1.0
    rope_original_context: int = 8192
    norm_eps: float = 1e-5
    # A local Hugging Face-format .safetensors file or folder to start from (fine-tuning); "" = random init.
    init_from: str = ""

    def __post_init__(self) -> None:
        _one_of(self.arch, ("gpt2", "llama"), "model.arch")
        for key in ("vocab_size", "context", "d_model", "n_layers", "n_heads", "d_ff", "rope_original_context"):
            _check(getattr(self, key) >= 1, f"model.{key}", f"must be at least 1, got {getattr(self, key)}")
        _check(
            self.d_model % self.n_heads == 0,
            "model.d_model",
            f"must be divisible by model.n_heads ({self.d_model} % {self.n_heads} != 0)",
        )
        _check(0.0 <= self.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {self.dropout}")
        _check(self.n_kv_heads >= 0, "model.n_kv_heads", f"must be 0 (= n_heads) or positive, got {self.n_kv_heads}")
        _check(
            self.n_heads % self.kv_heads == 0,
            "model.n_kv_heads",
            f"must divide model.n_heads ({self.n_heads} % {self.kv_heads} != 0)",
        )
        _check(self.arch == "llama" or self.kv_heads == self.n_heads, "model.n_kv_heads", "is for arch=llama only")
        _check(self.arch != "llama" or self.head_dim % 2 == 0, "model.n_heads", "RoPE needs an even head size")
        _check(self.rope_theta > 0, "model.rope_theta", f"must be positive, got {self.rope_theta}")
        _check(self.rope_scaling >= 1.0, "model.rope_scaling", f"must be 1 (off) or more, got {self.rope_scaling}")
        _check(self.norm_eps > 0, "model.norm_eps", f"must be positive, got {self.norm_eps}")

    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_kv_heads, or n_heads when it is 0)."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.d_model // self.n_heads


@dataclass
class PSConfig:
    """The parameter server: where it listens, where clients dial, and how it aggregates."""

    host: str = "127.0.0.1"
    port: int = 0
    address: str = ""
    insecure: bool = True
    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    client_ca_file: str = ""
    client_cert_file: str = ""
    client_key_file: str = ""
    tls_names: list[str] = field(default_factory=list)
    tls_sites: list[str] = field(default_factory=list)
    tls_overwrite: bool = False
    enroll_token: str = ""
    token_ttl: timedelta = timedelta(days=30)
    max_sessions_per_site: int = 8
    max_sessions: int = 4096
    aggregation: str = "sync"
    outer_optimizer: str = "plain"
    global_lr: float = 1.0
    momentum: float = 0.9
    weighting: str = "uniform"
    robust: str = "none"
    trim_fraction: float = 0.1
    clip_norm: float = 0.0
    buffer_size: int = 4
    round_timeout: timedelta = timedelta(minutes=2)
    max_staleness: int = 4
    state_dir: str = ""
    staging_dir: str = ""
    snapshot_every: int = 1
    downlink_codec: str = ""
    downlink_history: int = 16
    max_concurrent_pushes: int = 4
    max_concurrent_downloads: int = 4
    decode_threads: int = 2
    stream_window_bytes: int = 1 << 20
    max_workers: int = 128
    shutdown_grace: timedelta = timedelta(seconds=60)
    init_from: str = ""
    chunk_bytes: int = 1 << 20
    max_message_bytes: int = 64 << 20
    max_delta_bytes: int = 8 << 30
    connect_timeout: timedelta = timedelta(seconds=30)
    rpc_timeout: timedelta = timedelta(minutes=10)
    retry_budget: timedelta = timedelta(minutes=2)
    heartbeat_interval: timedelta = timedelta(seconds=10)
    metrics_port: int = 0
    metrics_host: str = ""

    def __post_init__(self) -> None:
        self.round_timeout = parse_duration(self.round_timeout, "ps.round_timeout")
        self.connect_timeout = parse_duration(self.connect_timeout, "ps.connect_timeout")
        self.rpc_timeout = parse_duration(self.rpc_timeout, "ps.rpc_timeout")
        self.shutdown_grace = parse_duration(self.shutdown_grace, "ps.shutdown_grace")
        self.retry_budget = parse_duration(self.retry_budget, "ps.retry_budget")
        self.heartbeat_interval = parse_duration(self.heartbeat_interval, "ps.heartbeat_interval")
        _check(
            self.heartbeat_interval >= timedelta(milliseconds=100),
            "ps.heartbeat_interval",
            f"must be at least 100ms (a site heartbeats this often while it trains), got {self.heartbeat_interval}",
        )
        self.token_ttl = parse_duration(self.token_ttl, "ps.token_ttl")
        _check(0 <= self.port <= 65535, "ps.port", f"must be in 0..65535, got {self.port}")
        _check(
            0 <= self.metrics_port <= 65535,
            "ps.metrics_port",
            f"must be 0 (no Prometheus endpoint) or a port in 1..65535, got {self.metrics_port}",
        )
        _one_of(self.aggregation, ("sync", "async", "buffered"), "ps.aggregation")
        _one_of(self.outer_optimizer, ("plain", "nesterov", "fednova"), "ps.outer_optimizer")
        _one_of(self.weighting, ("uniform", "tokens"), "ps.weighting")
        _one_of(self.robust, ("none", "trimmed_mean", "median"), "ps.robust")
        _one_of(self.downlink_codec, ("", *WIRE_CODECS), "ps.downlink_codec")
        _check(self.global_lr > 0, "ps.global_lr", f"must be positive, got {self.global_lr}")
        _check(0.0 <= self.momentum < 1.0, "ps.momentum", f"must be in [0, 1), got {self.momentum}")
        _check(0.0 <= self.trim_fraction < 0.5, "ps.trim_fraction", f"must be in [0, 0.5), got {self.trim_fraction}")
        _check(self.clip_norm >= 0, "ps.clip_norm", f"must be 0 (off) or positive, got {self.clip_norm}")
        _check(self.max_staleness >= 0, "ps.max_staleness", "must be 0 or more")
        limits = ("max_concurrent_pushes", "max_concurrent_downloads", "decode_threads", "max_sessions_per_site")
        for key in ("buffer_size", "snapshot_every", *limits):
            _check(getattr(self, key) >= 1, f"ps.{key}", f"must be at least 1, got {getattr(self, key)}")
        _check(self.downlink_history >= 0, "ps.downlink_history", "must be 0 (always full models) or more")
        _check(
            self.max_sessions >= self.max_sessions_per_site,
            "ps.max_sessions",
            f"must be at least ps.max_sessions_per_site ({self.max_sessions_per_site}), got {self.max_sessions}",
        )
        _check(self.max_workers >= 4, "ps.max_workers", f"must be at least 4, got {self.max_workers}")
        _check(
            self.stream_window_bytes == 0 or self.stream_window_bytes >= 1 << 16,
            "ps.stream_window_bytes",
            f"must be 0 (gRPC's automatic windows) or at least 65536, got {self.stream_window_bytes}",
        )
        if self.robust != "none":
            _check(
                self.aggregation != "async",
                "ps.robust",
                f"{self.robust} needs several deltas per update: use ps.aggregation=sync or buffered",
            )
            _check(
                self.weighting == "uniform",
                "ps.weighting",
                f"robust rule {self.robust} is unweighted: set ps.weighting=uniform",
            )
        _check(
            4096 <= self.chunk_bytes <= self.max_message_bytes // 2,
            "ps.chunk_bytes",
            f"must be in 4096..{self.max_message_bytes // 2} (half of ps.max_message_bytes)",
        )
        if self.address:
            _check(
                bool(re.fullmatch(r"[^\s:]+:\d{1,5}", self.address)),
                "ps.address",
                f"expected host:port, got {self.address!r}",
            )
        if not self.insecure:
            _check(
                bool(self.ca_file or self.cert_file),
                "ps.insecure",
                "TLS is on: set ps.ca_file (clients) and ps.cert_file/ps.key_file (server), "
                "or ps.insecure=true for a local plaintext demo",
            )
        self._check_tls()

    def _check_tls(self) -> None:
        """Mutual TLS and `ps init` fields (rpc/tls.py, rpc/channel.py)."""
        _check(
            bool(self.client_cert_file) == bool(self.client_key_file),
            "ps.client_cert_file",
            "a site's client certificate needs both ps.client_cert_file and ps.client_key_file",
        )
        if self.insecure:
            for key in ("client_ca_file", "client_cert_file"):
                _check(not getattr(self, key), f"ps.{key}", "mutual TLS needs TLS: set ps.insecure=false")
        self.tls_names = [str(n) for n in self.tls_names]
        for name in self.tls_names:
            _check(
                bool(re.fullmatch(r"[A-Za-z0-9*.:-]+", name)),
                "ps.tls_names",
                f"expected DNS names or IP addresses, got {name!r}",
            )
        self.tls_sites = [str(n) for n in self.tls_sites]
        for name in self.tls_sites:
            _check(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", name)), "ps.tls_sites", f"bad site name {name!r}")

    def dial_address(self) -> str:
        """The host:port clients dial (ps.address, else host:port)."""
        return self.address or f"{self.host}:{self.port}"


# Codecs on the wire (geofed_hpc.codec implements each); "adaptive" lets each site pick one per push.
WIRE_CODECS = ("fp32", "bf16", "int16", "int8", "int4", "paper_int8")


@dataclass
class CodecConfig:
    """How deltas are compressed on the wire; the adaptive_* fields steer codec.name=adaptive on each site."""

    name: str = "int8"
    block_size: int = 1 << 16
    zstd_level: int = 1
    stochastic_rounding: bool = False
    # most accurate first: a site pushes with the first one whose predicted push time fits the budget
    adaptive_codecs: list[str] = field(default_factory=lambda: ["fp32", "int16", "bf16", "int8", "int4"])
    adaptive_fraction: float = 0.1  # budget: this share of the sync interval per push
    adaptive_ema: float = 0.3  # weight of the newest throughput measurement

    def __post_init__(self) -> None:
        _one_of(self.name, (*WIRE_CODECS, "adaptive"), "codec.name")
        _check(64 <= self.block_size <= 1 << 31, "codec.block_size", f"must be in 64..{1 << 31}, got {self.block_size}")
        _check(1 <= self.zstd_level <= 22, "codec.zstd_level", f"must be in 1..22, got {self.zstd_level}")
        self.adaptive_codecs = list(self.adaptive_codecs)
        _check(bool(self.adaptive_codecs), "codec.adaptive_codecs", "must name at least one codec")
        for name in self.adaptive_codecs:
            _one_of(name, WIRE_CODECS, "codec.adaptive_codecs")
        _check(len(set(self.adaptive_codecs)) == len(self.adaptive_codecs), "codec.adaptive_codecs", "has duplicates")
        _check(
            0 < self.adaptive_fraction <= 1,
            "codec.adaptive_fraction",
            f"must be in (0, 1], got {self.adaptive_fraction}",
        )
        _check(0 < self.adaptive_ema <= 1, "codec.adaptive_ema", f"must be in (0, 1], got {self.adaptive_ema}")


@dataclass
class DataConfig:
    """Training text and tokenizer."""

    source: str = "bible"
    tokenizer: str = "gpt2"
    cache_dir: str = ""
    val_fraction: float = 0.02
    max_tokens: int = 0
    val_batches: int = 8

    def __post_init__(self) -> None:
        _one_of(self.tokenizer, ("gpt2",), "data.tokenizer")
        _check(0.0 < self.val_fraction < 0.5, "data.val_fraction", f"must be in (0, 0.5), got {self.val_fraction}")
        _check(self.max_tokens >= 0, "data.max_tokens", "must be 0 (all) or positive")
        _check(self.val_batches >= 1, "data.val_batches", "must be at least 1")
        if self.source != "bible":
            _check(
                Path(self.source).exists(),
                "data.source",
                f"{self.source!r} is neither 'bible' nor an existing .txt/.jsonl file",
            )


@dataclass
class TrainConfig:
    """Local training and the sync cadence (Algorithm 1: H local steps or T seconds)."""

    lr: float = 3e-3
    weight_decay: float = 0.0
    batch_size: int = 8
    sync_interval: timedelta = timedelta(seconds=30)
    max_local_steps: int = 0
    max_syncs: int = 0
    seed: int = 0
    threads: int = 1
    eval_every: int = 0
    keep_best: int = 10
    # Emulated slower hardware: after each optimizer step, sleep (slowdown - 1) x that step's compute time.
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        self.sync_interval = parse_duration(self.sync_interval, "train.sync_interval")
        _check(
            self.eval_every >= 0,
            "train.eval_every",
            f"must be 0 (only at each sync) or positive, got {self.eval_every}",
        )
        _check(self.keep_best >= 0, "train.keep_best", f"must be 0 (keep none) or positive, got {self.keep_best}")
        _check(self.lr > 0, "train.lr", f"must be positive, got {self.lr}")
        _check(self.batch_size >= 1, "train.batch_size", "must be at least 1")
        _check(
            self.sync_interval.total_seconds() > 0 or self.max_local_steps > 0,
            "train.sync_interval",
            "set a positive sync interval or train.max_local_steps",
        )
        _check(self.max_local_steps >= 0, "train.max_local_steps", "must be 0 (no cap) or positive")
        _check(self.max_syncs >= 0, "train.max_syncs", "must be 0 (until stopped) or positive")
        _check(self.threads >= 1, "train.threads", "must be at least 1")
        _check(
            1.0 <= self.slowdown <= 1000.0,
            "train.slowdown",
            f"must be in 1..1000 (1: full speed, 4: a quarter of this machine's speed), got {self.slowdown}",
        )


PARADIGMS = ("identity", "lora", "hybrid_lora", "ravan", "zo")


@dataclass
class ParadigmConfig:
    """The reparametrization phi(theta) that sites train and exchange (Algorithm 1): identity (pretraining),
    lora (FedIT), hybrid_lora (base exchanged, private adapters), ravan (shared frozen A, B; heads H
    exchanged), zo (zeroth-order: a seed from the PS, one scalar per step back)."""

    name: str = "identity"
    # lora / hybrid_lora / ravan: the nn.Linear layers to adapt, by name or dotted suffix (attn.qkv matches
    # blocks.0.attn.qkv, blocks.1.attn.qkv, ...)
    targets: list[str] = field(default_factory=lambda: ["attn.qkv", "attn.proj"])
    rank: int = 4
    alpha: float = 8.0
    heads: int = 4  # ravan: heads H_i per layer
    base_steps: int = 2  # hybrid_lora: steps on the base weights per round, then
    adapter_steps: int = 2  # ... steps on the private adapters
    seed: int = 0  # adapter init; zo: the PS's seed for the random directions
    zo_eps: float = 1e-3  # zo: perturbation size of the two forward passes
    zo_lr: float = 1e-4  # zo: step size along each direction

    def __post_init__(self) -> None:
        _one_of(self.name, PARADIGMS, "paradigm.name")
        self.targets = [str(t) for t in self.targets]
        if self.name in ("lora", "hybrid_lora", "ravan"):
            _check(bool(self.targets), "paradigm.targets", "name at least one layer (e.g. [attn.qkv])")
        _check(self.rank >= 1, "paradigm.rank", f"must be at least 1, got {self.rank}")
        _check(self.alpha > 0, "paradigm.alpha", f"must be positive, got {self.alpha}")
        _check(self.heads >= 1, "paradigm.heads", f"must be at least 1, got {self.heads}")
        for key in ("base_steps", "adapter_steps"):
            _check(getattr(self, key) >= 0, f"paradigm.{key}", f"must be 0 or more, got {getattr(self, key)}")
        _check(self.base_steps + self.adapter_steps >= 1, "paradigm.base_steps", "base + adapter steps must be >= 1")
        _check(self.zo_eps > 0, "paradigm.zo_eps", f"must be positive, got {self.zo_eps}")
        _check(self.zo_lr > 0, "paradigm.zo_lr", f"must be positive, got {self.zo_lr}")

    def describe(self) -> str:
        """The paradigm and the settings every replica must share, as one line (compared at Join)."""
        targets = "+".join(self.targets)
        if self.name == "lora":
            return f"lora(rank={self.rank}, alpha={self.alpha:g}, targets={targets})"
        if self.name == "hybrid_lora":
            return f"hybrid_lora(rank={self.rank}, alpha={self.alpha:g}, targets={targets})"
        if self.name == "ravan":
            return f"ravan(heads={self.heads}, rank={self.rank}, alpha={self.alpha:g}, targets={targets})"
        if self.name == "zo":
            return f"zo(eps={self.zo_eps:g}, lr={self.zo_lr:g})"
        return "identity"


@dataclass
class RunConfig:
    """Everything one `geofed-hpc` command needs."""

    federation: str = "geofed"
    run_dir: str = "runs/geofed"
    wandb_mode: str = "offline"
    verbosity: int = 0
    site: SiteConfig = field(default_factory=SiteConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    paradigm: ParadigmConfig = field(default_factory=ParadigmConfig)

    def __post_init__(self) -> None:
        _one_of(self.wandb_mode, ("offline", "online", "disabled"), "wandb_mode")
        if self.paradigm.name == "zo":
            _check(
                self.train.max_local_steps >= 1,
                "train.max_local_steps",
                "paradigm=zo sends one scalar per step: set train.max_local_steps (the steps per round), e.g. 8",
            )
            _check(
                self.ps.aggregation == "sync",
                "ps.aggregation",
                "paradigm=zo draws each round's directions from the global version: use ps.aggregation=sync",
            )
        _check(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", self.federation)), "federation", "use letters, digits, _ . -")


def from_dict(cls: type, raw: Any, prefix: str = "") -> Any:
    """Build dataclass `cls` from a plain mapping; unknown keys and wrong types raise ConfigError."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]}; valid keys in {where}: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, prefix + name)
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, name: str) -> Any:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_dict(hint, value, name + ".")
    if hint is timedelta:
        return parse_duration(value, name)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    return value


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain, YAML/JSON-friendly dict of a config dataclass (durations as seconds strings)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        elif isinstance(value, timedelta):
            out[f.name] = f"{value.total_seconds():f}".rstrip("0").rstrip(".") + "s"  # never 2.592e+06s
        else:
            out[f.name] = value
    return out
