"""Plain dataclasses for every geofed.v1 message; the rest of the package speaks only these."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunSettings:
    codec: str = "int8"
    sync_interval_s: float = 30.0
    max_local_steps: int = 0
    paradigm: str = "identity"
    aggregation: str = "sync"
    block_size: int = 1 << 16
    paradigm_seed: int = 0


@dataclass
class JoinRequest:
    site: str
    token: str = ""
    client_version: str = ""
    resume_session: str = ""
    paradigm: str = "identity"


@dataclass
class JoinReply:
    session_id: str
    rejoin_token: str
    version: int
    initialized: bool
    settings: RunSettings = field(default_factory=RunSettings)


@dataclass
class ModelRequest:
    session_id: str
    min_version: int = 0
    wait_s: float = 0.0
    have_version: int = 0
    want_updates: bool = False


@dataclass
class ModelHeader:
    version: int
    codec: str
    total_bytes: int
    sha256: bytes
    kind: str = "full"
    base_version: int = 0
    segments: list[int] = field(default_factory=list)
    model_digest: bytes = b""


@dataclass
class PushHeader:
    session_id: str
    base_version: int
    local_steps: int
    tokens: int
    codec: str
    total_bytes: int
    sha256: bytes
    push_id: str
    init: bool = False
    train_loss: float = 0.0


@dataclass
class SplitHeader:
    """Split learning's activations up, or the server part's answer down (geofed.proto says each field)."""

    session_id: str
    kind: str
    cut: int = 0
    shape: list[int] = field(default_factory=list)
    codec: str = ""
    total_bytes: int = 0
    sha256: bytes = b""
    acts_bytes: int = 0
    version: int = 0
    loss: float = 0.0
    server_steps: int = 0
    alignments: int = 0


@dataclass
class AuxRequest:
    session_id: str
    version: int = 0
    cut: int = 0


@dataclass
class Chunk:
    """One streamed piece; the first of a stream carries exactly one header."""

    data: bytes = b""
    model: ModelHeader | None = None
    push: PushHeader | None = None
    split: SplitHeader | None = None


@dataclass
class PushReply:
    accepted: bool
    version: int
    reason: str = ""
    staleness: int = 0
    duplicate: bool = False


@dataclass
class HeartbeatRequest:
    session_id: str
    version: int = 0
    local_steps: int = 0
    leaving: bool = False
    val_loss: float = 0.0
    push_id: str = ""  # asks whether the PS holds this push (its reply never came)
    goodput: float = 0.0  # the site's share of wall-clock inside training steps (0: none to report)


@dataclass
class HeartbeatReply:
    version: int
    sync_now: bool = False
    push: str = ""  # for push_id: "applied", "receiving" or "" (not held)


@dataclass
class StatusRequest:
    pass


@dataclass
class SiteStatus:
    site: str
    session_id: str
    pushes: int = 0
    last_base_version: int = 0
    last_seen_s: float = 0.0
    tokens: int = 0
    last_train_loss: float = 0.0
    state: str = ""
    last_push_s: float = -1.0
    last_staleness: int = 0
    bytes_received: int = 0
    version: int = 0
    refused: int = 0


@dataclass
class PeerStatus:
    """One peer of a PS group as a member saw it at its last sync point."""

    address: str
    member: bool
    version: int = -1
    digest: str = ""


@dataclass
class StatusReply:
    version: int
    initialized: bool
    aggregation: str
    num_params: int = 0
    uptime_s: float = 0.0
    sites: list[SiteStatus] = field(default_factory=list)
    pending_deltas: int = 0
    outer_optimizer: str = ""
    robust: str = ""
    active_sites: int = 0
    snapshot_version: int = -1
    updates_kept: int = 0
    pushes_in_flight: int = 0
    peers: list[PeerStatus] = field(default_factory=list)
    group_generation: int = 0
    identical_versions: int = 0
    allreduce_s: float = 0.0
    allreduce_bytes: int = 0
    allreduce_ago_s: float = -1.0
    streams: int = 0
    caller_site: str = ""  # the site the caller's credential is for (an enrollment token or session); "": any
