"""What the parts of SiteTrainer (checkpointing.py, joining.py, resilience.py) need of the trainer they are part of."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from geofed_hpc import codec
from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.ckpt.best import BestCheckpoints
from geofed_hpc.client.group import SiteGroup
from geofed_hpc.client.runtime import SiteRuntime
from geofed_hpc.client.telemetry import SyncTimer
from geofed_hpc.config import RunConfig
from geofed_hpc.data import BatchSampler
from geofed_hpc.data.squad import QASampler
from geofed_hpc.metrics import Recorder
from geofed_hpc.paradigms import Exchange
from geofed_hpc.paradigms.exchange import Params
from geofed_hpc.paradigms.site import SiteParadigm
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient

if TYPE_CHECKING:
    from geofed_hpc.client.deferred import Deferred


class Site(Protocol):
    """SiteTrainer's state and steps, as its parts see them (client/trainer.py documents each)."""

    cfg: RunConfig
    name: str
    dir: Path
    runtime: SiteRuntime
    group: SiteGroup
    sampler: BatchSampler | QASampler
    paradigm: SiteParadigm
    exchange: Exchange
    private: list[str]
    store: CheckpointStore
    best: BestCheckpoints
    client: PSClient | None
    rec: Recorder | None
    session: m.JoinReply
    deferred: Deferred
    base: Params
    base_global: bool
    version: int
    syncs: int
    tokens_seen: int
    contribution_total: int
    val_loss: float
    val_version: int
    job_id: str
    timer: SyncTimer
    _disk_model: Params
    _syncs_after_push: int
    _work_id: str
    _attempt: tuple[m.PushHeader, bytes] | None
    _push_version: int
    _carry: tuple[int, float, float]
    phase: str

    def _event(self, event: str, **fields: Any) -> None: ...

    def _codec_state(self) -> tuple[codec.ErrorFeedback, codec.LinkAdaptive]: ...

    def _save(self, pending: dict[str, Any] | None = None, pushed: bool = False) -> Path: ...

    def _checkpointed(self) -> None: ...

    def _push(self, client: PSClient, settings: m.RunSettings, steps: int, loss: float) -> tuple[int, int]: ...

    def _pushed(self) -> None: ...

    def _keep_token(self) -> None: ...

    def _disk_is_current(self, meta: dict[str, Any] | None) -> bool: ...

    def _with_private(self, arrays: Params) -> Params: ...

    def _join(self, client: PSClient, meta: dict[str, Any] | None) -> m.JoinReply: ...

    def _seed(self, client: PSClient, version: int) -> bool: ...

    def _pull(self, client: PSClient, min_version: int, wait: timedelta) -> None: ...

    def _rejoin(self, client: PSClient, why: Exception) -> None: ...
