"""The parameter server: `ps.*` (listening, TLS, tokens, aggregation, persistence, limits, timeouts)."""

from __future__ import annotations

from dataclasses import field
from datetime import timedelta
from typing import Annotated, Literal

from pydantic import Field, StrictBool, StrictFloat, StrictInt

from geofed_hpc.config.codec import WIRE_CODECS
from geofed_hpc.config.fields import Duration, HostPort, HostPorts, Name, OneOrMany, check, choice, pattern
from geofed_hpc.config.section import section

Port = Annotated[StrictInt, Field(ge=0, le=65535)]
AtLeastOne = Annotated[StrictInt, Field(ge=1)]
REQUEST_HEADROOM = 1 << 16  # what a chunk's header may add to its data (its strings are bounded at parse)
_DNS_NAME = pattern(r"[A-Za-z0-9*.:-]+", "expected DNS names or IP addresses, got {value!r}")


@section("ps")
class PSConfig:
    """The parameter server: where it listens, where clients dial, and how it aggregates."""

    host: str = "127.0.0.1"
    """The address the PS listens on (in a PS group, its group store and gloo connections too)."""
    port: Port = 0
    """The port it listens on (0: a free one, picked at start)."""
    address: HostPorts = ""
    """host:port where sites dial ("": host:port above); with a PS group several, nearest first
    ([a:50051,b:50051]): a site fails over to the next when its PS is gone."""
    failover_after: Duration = timedelta(seconds=10)
    """With several ps.address: a PS that does not answer for this long is left for the next one."""
    insecure: StrictBool = True
    """Plaintext gRPC (local demos only); false: TLS with the files below."""
    cert_file: str = ""
    """PS: its TLS certificate."""
    key_file: str = ""
    """PS: its TLS private key."""
    ca_file: str = ""
    """Sites: the CA that signed the PS's certificate."""
    tls_name: str = ""
    """Sites: the name the PS's certificate is checked against when ps.address is not the PS itself but a relay or
    an SSH tunnel to it (ps.address=login1:50051 ps.tls_name=vm.example.org); "": the host of ps.address."""
    client_ca_file: str = ""
    """Mutual TLS, PS: accept only sites whose certificate this CA signed ("": server-only TLS)."""
    client_cert_file: str = ""
    """Mutual TLS, site: the certificate it presents (from `ps init ps.tls_sites=[osc]`)."""
    client_key_file: str = ""
    """Mutual TLS, site: that certificate's private key."""
    tls_names: Annotated[list[Annotated[str, _DNS_NAME]], OneOrMany] = field(default_factory=list)
    """`ps init`: extra DNS names / IP addresses of the PS in its certificate."""
    tls_sites: Annotated[list[Name], OneOrMany] = field(default_factory=list)
    """`ps init`: the sites to issue client certificates for (mutual TLS)."""
    tls_overwrite: StrictBool = False
    """`ps init`: existing server and site keys may be replaced (the CA never is)."""
    enroll_token: str = ""
    """A token every site must present on Join ("": any site, unless per-site tokens were issued)."""
    token_ttl: Duration = timedelta(days=30)
    """How long a token from `token issue` admits new enrollments (0: forever)."""
    max_sessions_per_site: AtLeastOne = 8
    """Sessions per site name; at the limit the least recently seen inactive one makes room."""
    max_sessions: AtLeastOne = 4096
    """Sessions in all (at least max_sessions_per_site)."""
    aggregation: Literal["sync", "async", "buffered"] = "sync"
    """sync: rounds of every active site; async: each delta on arrival; buffered: after buffer_size deltas."""
    outer_optimizer: Literal["plain", "nesterov", "fednova"] = "plain"
    """plain: Theta + global_lr x D; nesterov: DiLoCo's outer momentum; fednova: D over local steps."""
    global_lr: Annotated[StrictFloat, Field(gt=0)] = 1.0
    """The global (outer) learning rate."""
    momentum: Annotated[StrictFloat, Field(ge=0, lt=1)] = 0.9
    """The outer momentum of nesterov."""
    weighting: Literal["uniform", "tokens"] = "uniform"
    """uniform: every delta counts the same; tokens: by the tokens it was trained on."""
    robust: Literal["none", "trimmed_mean", "median"] = "none"
    """A robust rule for untrusted federations (unweighted, several deltas per update)."""
    trim_fraction: Annotated[StrictFloat, Field(ge=0, lt=0.5)] = 0.1
    """trimmed_mean: the share of values dropped at each end, per coordinate."""
    clip_norm: Annotated[StrictFloat, Field(ge=0)] = 0.0
    """Scale each delta to at most this L2 norm (0: off)."""
    buffer_size: AtLeastOne = 4
    """buffered: deltas per update."""
    min_sites: AtLeastOne = 1
    """sync: a round closes before its deadline only once this many sites pushed (so sites that start late join
    the first round); in a PS group, this many sites of the whole group."""
    round_timeout: Duration = timedelta(minutes=2)
    """sync: a round closes at the latest this long after it opened; buffered: after its first delta."""
    max_staleness: Annotated[StrictInt, Field(ge=0)] = 4
    """Deltas older than this many versions are refused and the site pulls again."""
    state_dir: str = ""
    """Global model snapshots ("": in memory only; `launch` uses <run_dir>/ps); a folder, or s3://bucket/prefix to
    keep them on object storage (endpoint and credentials from the standard AWS variables and files)."""
    state_cache: str = ""
    """With state_dir=s3://...: the local working folder written through to it ("": ~/.geofed/ps/cache/<bucket>/
    <prefix>); any folder works, a new machine starts with an empty one."""
    staging_dir: str = ""
    """Where pushes land while their checksum is verified ("": <state_dir>/staging, or a temp dir the PS removes on
    a clean stop); made again should it disappear while the PS runs."""
    snapshot_every: AtLeastOne = 1
    """Snapshot every this many versions (and on SIGTERM)."""
    downlink_codec: Annotated[str, choice(("", *WIRE_CODECS))] = ""
    """Codec of the global updates sent to sites that hold a recent version ("": the run's codec)."""
    downlink_density: Annotated[StrictFloat, Field(ge=0, le=0.5)] = 0.0
    """A sparse downlink's codec.density (0: codec.density); the updates it leaves out wait on the PS."""
    downlink_history: Annotated[StrictInt, Field(ge=0)] = 16
    """Updates kept for those sites (0: always full models)."""
    max_concurrent_pushes: AtLeastOne = 4
    """Pushes read off the network at once (the others wait, held back by gRPC flow control)."""
    max_concurrent_downloads: AtLeastOne = 4
    """Model or update downloads sent at once."""
    decode_threads: AtLeastOne = 2
    """Threads that decode pushes as they arrive (each keeps a model's worth of buffers to decode into)."""
    stream_window_bytes: Annotated[StrictInt, Field(ge=0)] = 1 << 20
    """Receive window of each stream, at least 65536 (0: gRPC sizes windows by bandwidth x delay)."""
    max_workers: Annotated[StrictInt, Field(ge=4)] = 128
    """gRPC handler threads: each site may hold two (a push and a long-poll)."""
    reserved_workers: AtLeastOne = 16
    """Handler threads no push, download or long-poll may take: they always serve Join, Heartbeat and Status."""
    max_uploads_per_session: AtLeastOne = 2
    """Pushes and split uploads one session may have open at once (a retry may overlap a stream still ending)."""
    max_downloads_per_session: AtLeastOne = 2
    """Model downloads and long-polls one session may have open at once."""
    max_streams_per_peer: AtLeastOne = 64
    """Pushes, downloads and long-polls from one host at once (sites behind one NAT share it: raise it for many)."""
    stream_idle_timeout: Annotated[Duration, Field(gt=timedelta(0))] = timedelta(seconds=60)
    """A stream whose caller moves no data for this long (a push that stalls after its header, a download nobody
    reads) is ended, and what it held is freed."""
    stream_min_rate: Annotated[StrictInt, Field(ge=0)] = 16384
    """Bytes per second a stream must move on average, once it has waited stream_idle_timeout on its caller in all
    (0: no floor)."""
    shutdown_grace: Duration = timedelta(seconds=60)
    """On SIGTERM: how long pushes in flight may take to finish before the final snapshot."""
    init_from: str = ""
    """Seed the global model from this file (a site checkpoint or PS snapshot) unless state_dir holds one."""
    chunk_bytes: StrictInt = 1 << 20
    """Bytes per streamed chunk: 4096 to half of max_message_bytes."""
    max_message_bytes: StrictInt = 64 << 20
    """The largest gRPC message."""
    max_request_bytes: StrictInt = 4 << 20
    """PS: the largest message it reads from a caller (a chunk of ps.chunk_bytes and its header fit, with 64 KiB to
    spare); gRPC refuses a longer one as it arrives, before it is read whole."""
    max_delta_bytes: StrictInt = 8 << 30
    """The largest encoded delta or model one transfer may carry."""
    connect_timeout: Duration = timedelta(seconds=30)
    """How long a site waits for the PS to answer at connect."""
    rpc_timeout: Duration = timedelta(minutes=10)
    """The deadline of one call."""
    retry_budget: Duration = timedelta(minutes=2)
    """A failed push or pull is retried for this long, then the site trains on and pushes later."""
    heartbeat_interval: Annotated[Duration, Field(ge=timedelta(milliseconds=100))] = timedelta(seconds=10)
    """A site heartbeats this often while it trains."""
    metrics_port: Port = 0
    """Prometheus /metrics of the PS on this port (0: no endpoint)."""
    metrics_host: str = ""
    """The host of /metrics ("": host above)."""
    peers: Annotated[list[HostPort], OneOrMany] = field(default_factory=list)
    """A PS group: every member's host:port (where its sites dial), the same list in the same order on each
    ([]: a single PS)."""
    peer_rank: Annotated[StrictInt, Field(ge=-1)] = -1
    """This PS's index in ps.peers (-1: no group)."""
    peer_rendezvous: HostPort = ""
    """Where the peers dial the group's rendezvous, a TCP store that peer 0 serves on ps.host at this port ("": peer
    0's host, its port + 1). When peer 0 dies, the lowest peer left serves the store on its ps.host at its port + 1."""
    peer_secret: str = ""
    """The secret every peer proves it knows at rendezvous (an HMAC, never sent)."""
    peer_secret_file: str = ""
    """A file holding ps.peer_secret (its first line), kept out of command lines."""
    peer_timeout: Duration = timedelta(seconds=60)
    """How long the rendezvous waits for every peer, and one exchange between peers may take."""
    peer_tick: Annotated[Duration, Field(ge=timedelta(milliseconds=10))] = timedelta(milliseconds=200)
    """How often the peers compare their rounds (whether the group's round may close)."""
    peer_codec: Literal["int8", "fp32"] = "int8"
    """How round sums travel between peers: int8 (all-gathered, 4x smaller) or fp32 (a ring all-reduce)."""
    peer_sync_interval: Duration = timedelta(0)
    """A group with ps.aggregation=async or buffered: the peers pool the deltas their sites push (each weighed by
    its staleness as the mode does) and apply them together this often (sync rounds: unused)."""

    def __post_init__(self) -> None:
        check(
            not self.state_dir.startswith("s3://") or bool(self.state_dir[5:].split("/")[0]),
            "ps.state_dir",
            f"{self.state_dir!r} names no bucket; write s3://BUCKET/PREFIX",
        )
        check(
            self.max_sessions >= self.max_sessions_per_site,
            "ps.max_sessions",
            f"must be at least ps.max_sessions_per_site ({self.max_sessions_per_site}), got {self.max_sessions}",
        )
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
            self.reserved_workers <= self.max_workers - 2,
            "ps.reserved_workers",
            f"must leave at least 2 of ps.max_workers ({self.max_workers}) for pushes and downloads, "
            f"got {self.reserved_workers}",
        )
        check(
            self.chunk_bytes + REQUEST_HEADROOM <= self.max_request_bytes,
            "ps.max_request_bytes",
            f"must hold a chunk of ps.chunk_bytes ({self.chunk_bytes}) and its header: at least "
            f"{self.chunk_bytes + REQUEST_HEADROOM}, got {self.max_request_bytes}",
        )
        check(
            4096 <= self.chunk_bytes <= self.max_message_bytes // 2,
            "ps.chunk_bytes",
            f"must be in 4096..{self.max_message_bytes // 2} (half of ps.max_message_bytes)",
        )
        if not self.insecure:
            check(
                bool(self.ca_file or self.cert_file),
                "ps.insecure",
                "TLS is on: set ps.ca_file (clients) and ps.cert_file/ps.key_file (server), "
                "or ps.insecure=true for a local plaintext demo",
            )
        check(
            bool(self.client_cert_file) == bool(self.client_key_file),
            "ps.client_cert_file",
            "a site's client certificate needs both ps.client_cert_file and ps.client_key_file",
        )
        if self.insecure:
            for key in ("client_ca_file", "client_cert_file"):
                check(not getattr(self, key), f"ps.{key}", "mutual TLS needs TLS: set ps.insecure=false")

        if self.peers or self.peer_rank >= 0:
            check(
                len(self.peers) >= 2 and 0 <= self.peer_rank < len(self.peers),
                "ps.peer_rank",
                f"a PS group needs ps.peers (2 or more) and ps.peer_rank in 0..{len(self.peers) - 1}, got "
                f"{len(self.peers)} peer(s) and rank {self.peer_rank}",
            )
            check(len(set(self.peers)) == len(self.peers), "ps.peers", f"lists a peer twice: {self.peers}")
            check(self.robust == "none", "ps.robust", "a PS group all-reduces weighted sums: use ps.robust=none")
            check(
                self.aggregation == "sync" or self.peer_sync_interval > timedelta(0),
                "ps.peer_sync_interval",
                f"a PS group with ps.aggregation={self.aggregation} applies its peers' pooled deltas every "
                "ps.peer_sync_interval: set one (e.g. 30s), or use ps.aggregation=sync",
            )
            check(
                self.peer_sync_interval <= self.rpc_timeout / 2,
                "ps.peer_sync_interval",
                f"a grouped PS answers a push once the group applied it: keep it at most half of ps.rpc_timeout "
                f"({self.rpc_timeout}), got {self.peer_sync_interval}",
            )

    @property
    def grouped(self) -> bool:
        """This PS is one of a group (ps.peers)."""
        return bool(self.peers)

    def dial_address(self) -> str:
        """The host:port clients dial (ps.address, the nearest when it lists several; else host:port)."""
        return self.dial_addresses()[0]

    def dial_addresses(self) -> list[str]:
        """Every host:port clients may dial, nearest first (ps.address, else host:port)."""
        return self.address.split(",") if self.address else [f"{self.host}:{self.port}"]
