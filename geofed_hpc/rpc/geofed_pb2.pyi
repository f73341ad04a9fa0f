from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunSettings(_message.Message):
    __slots__ = ("codec", "sync_interval_s", "max_local_steps", "paradigm", "aggregation", "block_size", "paradigm_seed")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SYNC_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    PARADIGM_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PARADIGM_SEED_FIELD_NUMBER: _ClassVar[int]
    codec: str
    sync_interval_s: float
    max_local_steps: int
    paradigm: str
    aggregation: str
    block_size: int
    paradigm_seed: int
    def __init__(self, codec: _Optional[str] = ..., sync_interval_s: _Optional[float] = ..., max_local_steps: _Optional[int] = ..., paradigm: _Optional[str] = ..., aggregation: _Optional[str] = ..., block_size: _Optional[int] = ..., paradigm_seed: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("site", "token", "client_version", "resume_session", "paradigm")
    SITE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESUME_SESSION_FIELD_NUMBER: _ClassVar[int]
    PARADIGM_FIELD_NUMBER: _ClassVar[int]
    site: str
    token: str
    client_version: str
    resume_session: str
    paradigm: str
    def __init__(self, site: _Optional[str] = ..., token: _Optional[str] = ..., client_version: _Optional[str] = ..., resume_session: _Optional[str] = ..., paradigm: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("session_id", "rejoin_token", "version", "initialized", "settings")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REJOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    rejoin_token: str
    version: int
    initialized: bool
    settings: RunSettings
    def __init__(self, session_id: _Optional[str] = ..., rejoin_token: _Optional[str] = ..., version: _Optional[int] = ..., initialized: _Optional[bool] = ..., settings: _Optional[_Union[RunSettings, _Mapping]] = ...) -> None: ...

class ModelRequest(_message.Message):
    __slots__ = ("session_id", "min_version", "wait_s", "have_version", "want_updates")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WANT_UPDATES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    min_version: int
    wait_s: float
    have_version: int
    want_updates: bool
    def __init__(self, session_id: _Optional[str] = ..., min_version: _Optional[int] = ..., wait_s: _Optional[float] = ..., have_version: _Optional[int] = ..., want_updates: _Optional[bool] = ...) -> None: ...

class ModelHeader(_message.Message):
    __slots__ = ("version", "codec", "total_bytes", "sha256", "kind", "base_version", "segments", "model_digest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    codec: str
    total_bytes: int
    sha256: bytes
    kind: str
    base_version: int
    segments: _containers.RepeatedScalarFieldContainer[int]
    model_digest: bytes
    def __init__(self, version: _Optional[int] = ..., codec: _Optional[str] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[bytes] = ..., kind: _Optional[str] = ..., base_version: _Optional[int] = ..., segments: _Optional[_Iterable[int]] = ..., model_digest: _Optional[bytes] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("session_id", "base_version", "local_steps", "tokens", "codec", "total_bytes", "sha256", "push_id", "init", "train_loss")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_version: int
    local_steps: int
    tokens: int
    codec: str
    total_bytes: int
    sha256: bytes
    push_id: str
    init: bool
    train_loss: float
    def __init__(self, session_id: _Optional[str] = ..., base_version: _Optional[int] = ..., local_steps: _Optional[int] = ..., tokens: _Optional[int] = ..., codec: _Optional[str] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[bytes] = ..., push_id: _Optional[str] = ..., init: _Optional[bool] = ..., train_loss: _Optional[float] = ...) -> None: ...

class SplitHeader(_message.Message):
    __slots__ = ("session_id", "kind", "cut", "shape", "codec", "total_bytes", "sha256", "acts_bytes", "version", "loss", "server_steps", "alignments")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ACTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SERVER_STEPS_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    kind: str
    cut: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    total_bytes: int
    sha256: bytes
    acts_bytes: int
    version: int
    loss: float
    server_steps: int
    alignments: int
    def __init__(self, session_id: _Optional[str] = ..., kind: _Optional[str] = ..., cut: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[bytes] = ..., acts_bytes: _Optional[int] = ..., version: _Optional[int] = ..., loss: _Optional[float] = ..., server_steps: _Optional[int] = ..., alignments: _Optional[int] = ...) -> None: ...

class AuxRequest(_message.Message):
    __slots__ = ("session_id", "version", "cut")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    version: int
    cut: int
    def __init__(self, session_id: _Optional[str] = ..., version: _Optional[int] = ..., cut: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("model", "push", "split", "data")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    model: ModelHeader
    push: PushHeader
    split: SplitHeader
    data: bytes
    def __init__(self, model: _Optional[_Union[ModelHeader, _Mapping]] = ..., push: _Optional[_Union[PushHeader, _Mapping]] = ..., split: _Optional[_Union[SplitHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("accepted", "version", "reason", "staleness", "duplicate")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    version: int
    reason: str
    staleness: int
    duplicate: bool
    def __init__(self, accepted: _Optional[bool] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ..., staleness: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id", "version", "local_steps", "leaving", "val_loss", "push_id", "goodput")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    version: int
    local_steps: int
    leaving: bool
    val_loss: float
    push_id: str
    goodput: float
    def __init__(self, session_id: _Optional[str] = ..., version: _Optional[int] = ..., local_steps: _Optional[int] = ..., leaving: _Optional[bool] = ..., val_loss: _Optional[float] = ..., push_id: _Optional[str] = ..., goodput: _Optional[float] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("version", "sync_now", "push")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SYNC_NOW_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    version: int
    sync_now: bool
    push: str
    def __init__(self, version: _Optional[int] = ..., sync_now: _Optional[bool] = ..., push: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SiteStatus(_message.Message):
    __slots__ = ("site", "session_id", "pushes", "last_base_version", "last_seen_s", "tokens", "last_train_loss", "state", "last_push_s", "last_staleness", "bytes_received", "version", "refused")
    SITE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    LAST_BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_PUSH_S_FIELD_NUMBER: _ClassVar[int]
    LAST_STALENESS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    site: str
    session_id: str
    pushes: int
    last_base_version: int
    last_seen_s: float
    tokens: int
    last_train_loss: float
    state: str
    last_push_s: float
    last_staleness: int
    bytes_received: int
    version: int
    refused: int
    def __init__(self, site: _Optional[str] = ..., session_id: _Optional[str] = ..., pushes: _Optional[int] = ..., last_base_version: _Optional[int] = ..., last_seen_s: _Optional[float] = ..., tokens: _Optional[int] = ..., last_train_loss: _Optional[float] = ..., state: _Optional[str] = ..., last_push_s: _Optional[float] = ..., last_staleness: _Optional[int] = ..., bytes_received: _Optional[int] = ..., version: _Optional[int] = ..., refused: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("version", "initialized", "aggregation", "num_params", "uptime_s", "sites", "pending_deltas", "outer_optimizer", "robust", "active_sites", "snapshot_version", "updates_kept", "pushes_in_flight", "peers", "group_generation", "identical_versions", "allreduce_s", "allreduce_bytes", "allreduce_ago_s", "streams", "caller_site")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    PENDING_DELTAS_FIELD_NUMBER: _ClassVar[int]
    OUTER_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    ROBUST_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SITES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATES_KEPT_FIELD_NUMBER: _ClassVar[int]
    PUSHES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    GROUP_GENERATION_FIELD_NUMBER: _ClassVar[int]
    IDENTICAL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_S_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_AGO_S_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    CALLER_SITE_FIELD_NUMBER: _ClassVar[int]
    version: int
    initialized: bool
    aggregation: str
    num_params: int
    uptime_s: float
    sites: _containers.RepeatedCompositeFieldContainer[SiteStatus]
    pending_deltas: int
    outer_optimizer: str
    robust: str
    active_sites: int
    snapshot_version: int
    updates_kept: int
    pushes_in_flight: int
    peers: _containers.RepeatedCompositeFieldContainer[PeerStatus]
    group_generation: int
    identical_versions: int
    allreduce_s: float
    allreduce_bytes: int
    allreduce_ago_s: float
    streams: int
    caller_site: str
    def __init__(self, version: _Optional[int] = ..., initialized: _Optional[bool] = ..., aggregation: _Optional[str] = ..., num_params: _Optional[int] = ..., uptime_s: _Optional[float] = ..., sites: _Optional[_Iterable[_Union[SiteStatus, _Mapping]]] = ..., pending_deltas: _Optional[int] = ..., outer_optimizer: _Optional[str] = ..., robust: _Optional[str] = ..., active_sites: _Optional[int] = ..., snapshot_version: _Optional[int] = ..., updates_kept: _Optional[int] = ..., pushes_in_flight: _Optional[int] = ..., peers: _Optional[_Iterable[_Union[PeerStatus, _Mapping]]] = ..., group_generation: _Optional[int] = ..., identical_versions: _Optional[int] = ..., allreduce_s: _Optional[float] = ..., allreduce_bytes: _Optional[int] = ..., allreduce_ago_s: _Optional[float] = ..., streams: _Optional[int] = ..., caller_site: _Optional[str] = ...) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("address", "member", "version", "digest")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    address: str
    member: bool
    version: int
    digest: str
    def __init__(self, address: _Optional[str] = ..., member: _Optional[bool] = ..., version: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...
