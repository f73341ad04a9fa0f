"""The parameter server: `ps.*` (listening, TLS, tokens, aggregation, persistence, limits, timeouts)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta

from geofed_hpc.config.codec import WIRE_CODECS
from geofed_hpc.config.fields import check, one_of, parse_duration


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
        check(
            self.heartbeat_interval >= timedelta(milliseconds=100),
            "ps.heartbeat_interval",
            f"must be at least 100ms (a site heartbeats this often while it trains), got {self.heartbeat_interval}",
        )
        self.token_ttl = parse_duration(self.token_ttl, "ps.token_ttl")
        check(0 <= self.port <= 65535, "ps.port", f"must be in 0..65535, got {self.port}")
        check(
            0 <= self.metrics_port <= 65535,
            "ps.metrics_port",
            f"must be 0 (no Prometheus endpoint) or a port in 1..65535, got {self.metrics_port}",
        )
        one_of(self.aggregation, ("sync", "async", "buffered"), "ps.aggregation")
        one_of(self.outer_optimizer, ("plain", "nesterov", "fednova"), "ps.outer_optimizer")
        one_of(self.weighting, ("uniform", "tokens"), "ps.weighting")
        one_of(self.robust, ("none", "trimmed_mean", "median"), "ps.robust")
        one_of(self.downlink_codec, ("", *WIRE_CODECS), "ps.downlink_codec")
        check(self.global_lr > 0, "ps.global_lr", f"must be positive, got {self.global_lr}")
        check(0.0 <= self.momentum < 1.0, "ps.momentum", f"must be in [0, 1), got {self.momentum}")
        check(0.0 <= self.trim_fraction < 0.5, "ps.trim_fraction", f"must be in [0, 0.5), got {self.trim_fraction}")
        check(self.clip_norm >= 0, "ps.clip_norm", f"must be 0 (off) or positive, got {self.clip_norm}")
        check(self.max_staleness >= 0, "ps.max_staleness", "must be 0 or more")
        limits = ("max_concurrent_pushes", "max_concurrent_downloads", "decode_threads", "max_sessions_per_site")
        for key in ("buffer_size", "snapshot_every", *limits):
            check(getattr(self, key) >= 1, f"ps.{key}", f"must be at least 1, got {getattr(self, key)}")
        check(self.downlink_history >= 0, "ps.downlink_history", "must be 0 (always full models) or more")
        check(
            self.max_sessions >= self.max_sessions_per_site,
            "ps.max_sessions",
            f"must be at least ps.max_sessions_per_site ({self.max_sessions_per_site}), got {self.max_sessions}",
        )
        check(self.max_workers >= 4, "ps.max_workers", f"must be at least 4, got {self.max_workers}")
        check(
            self.stream_window_bytes == 0 or self.stream_window_bytes >= 1 << 16,
            "ps.stream_window_bytes",
            f"must be 0 (gRPC's automatic windows) or at least 65536, got {self.stream_window_bytes}",
        )
        if self.robust != "none":
            check(
                self.aggregation != "async",
                "ps.robust",
                f"{self.robust} needs several deltas per update: use ps.aggregation=sync or buffered",
            )
            check(
                self.weighting == "uniform",
                "ps.weighting",
                f"robust rule {self.robust} is unweighted: set ps.weighting=uniform",
            )
        check(
            4096 <= self.chunk_bytes <= self.max_message_bytes // 2,
            "ps.chunk_bytes",
            f"must be in 4096..{self.max_message_bytes // 2} (half of ps.max_message_bytes)",
        )
        if self.address:
            check(
                bool(re.fullmatch(r"[^\s:]+:\d{1,5}", self.address)),
                "ps.address",
                f"expected host:port, got {self.address!r}",
            )
        if not self.insecure:
            check(
                bool(self.ca_file or self.cert_file),
                "ps.insecure",
                "TLS is on: set ps.ca_file (clients) and ps.cert_file/ps.key_file (server), "
                "or ps.insecure=true for a local plaintext demo",
            )
        self._check_tls()

    def _check_tls(self) -> None:
        """Mutual TLS and `ps init` fields (rpc/tls.py, rpc/channel.py)."""
        check(
            bool(self.client_cert_file) == bool(self.client_key_file),
            "ps.client_cert_file",
            "a site's client certificate needs both ps.client_cert_file and ps.client_key_file",
        )
        if self.insecure:
            for key in ("client_ca_file", "client_cert_file"):
                check(not getattr(self, key), f"ps.{key}", "mutual TLS needs TLS: set ps.insecure=false")
        self.tls_names = [str(n) for n in self.tls_names]
        for name in self.tls_names:
            check(
                bool(re.fullmatch(r"[A-Za-z0-9*.:-]+", name)),
                "ps.tls_names",
                f"expected DNS names or IP addresses, got {name!r}",
            )
        self.tls_sites = [str(n) for n in self.tls_sites]
        for name in self.tls_sites:
            check(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", name)), "ps.tls_sites", f"bad site name {name!r}")

    def dial_address(self) -> str:
        """The host:port clients dial (ps.address, else host:port)."""
        return self.address or f"{self.host}:{self.port}"
