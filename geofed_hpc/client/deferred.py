"""Work the PS has not confirmed yet: the steps since the base, and the attempt whose reply never came.

A push that spends ps.retry_budget without a reply may still have reached the PS (only the reply was lost).
So its header and bytes are kept. When the PS answers again, the site asks it (Heartbeat.push_id) whether it
holds that push. If not, all the work since the base goes out under the same push id, so that the PS applies
at most one of the two. If it does, the work trained since goes out on its own, as local - base - (the decoded
bytes of the confirmed attempts): no step is lost and none is applied twice.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from geofed_hpc.errors import CheckpointError
from geofed_hpc.rpc import messages as m

TENSOR_PREFIX = "deferred/"  # checkpoint tensors: deferred/attempt, deferred/applied/<i> (payload bytes)
_HEADER_FIELDS = ("base_version", "local_steps", "tokens", "codec", "push_id", "train_loss")


@dataclass
class Deferred:
    """Local work whose push failed because the PS was unreachable. It stays relative to the base version the
    site last pulled. `attempt`/`payload`: the last push of it that may have reached the PS (header fields and
    bytes); `applied`/`applied_steps`: the payloads of earlier attempts the PS has confirmed since the base."""

    steps: int = 0  # every step since the base, confirmed ones included
    loss_sum: float = 0.0
    intervals: int = 0
    since: float = 0.0  # time.time() of the first failed push
    attempt: dict[str, Any] | None = None
    applied_steps: int = 0
    payload: bytes = field(default=b"", repr=False)
    applied: list[bytes] = field(default_factory=list, repr=False)

    @property
    def active(self) -> bool:
        return self.intervals > 0

    def record(self, steps: int, loss_sum: float, attempt: tuple[m.PushHeader, bytes] | None) -> bool:
        """One more interval could not be pushed; `steps`/`loss_sum` are the totals since the base, `attempt`
        the push that went unanswered (None: the unanswered one is still `attempt`). True for the first one of
        an outage."""
        first = not self.active
        if first:
            self.since = time.time()
        if attempt is not None:
            header, payload = attempt
            self.attempt = {k: getattr(header, k) for k in _HEADER_FIELDS}
            self.payload = payload
        self.steps, self.loss_sum, self.intervals = steps, loss_sum, self.intervals + 1
        return first

    def confirm(self) -> None:
        """The PS says it applied the unanswered attempt: its work is in the global model."""
        assert self.attempt is not None
        self.applied.append(self.payload)
        self.applied_steps += int(self.attempt["local_steps"])
        self.attempt, self.payload = None, b""

    def forget_attempt(self) -> None:
        """The PS does not hold the unanswered attempt: all work since the base goes out again, as one push."""
        self.attempt, self.payload = None, b""

    def offline_seconds(self) -> float:
        return time.time() - self.since if self.active else 0.0

    def clear(self) -> None:
        self.steps, self.loss_sum, self.intervals, self.since = 0, 0.0, 0, 0.0
        self.attempt, self.applied_steps, self.payload, self.applied = None, 0, b"", []

    def to_meta(self) -> dict[str, Any] | None:
        """For a checkpoint's meta (the payloads go in `tensors()`)."""
        if not self.active:
            return None
        return {k: v for k, v in asdict(self).items() if k not in ("payload", "applied")} | {
            "applied_count": len(self.applied)
        }

    def tensors(self) -> dict[str, np.ndarray]:
        out = {f"{TENSOR_PREFIX}applied/{i}": _array(p) for i, p in enumerate(self.applied)}
        if self.payload:
            out[f"{TENSOR_PREFIX}attempt"] = _array(self.payload)
        return out

    @classmethod
    def from_checkpoint(cls, meta: dict[str, Any] | None, tensors: dict[str, np.ndarray]) -> Deferred:
        """From `to_meta()` and `tensors()` (an older checkpoint's meta, without attempt bytes, loads too)."""
        names = {f.name for f in fields(cls)} - {"payload", "applied"}
        held = cls(**{k: v for k, v in (meta or {}).items() if k in names})
        count = int((meta or {}).get("applied_count", 0))
        missing = [f"{TENSOR_PREFIX}applied/{i}" for i in range(count) if f"{TENSOR_PREFIX}applied/{i}" not in tensors]
        if missing:
            raise CheckpointError(f"the checkpoint's deferred work lacks tensor {missing[0]}: it cannot be pushed")
        held.applied = [tensors[f"{TENSOR_PREFIX}applied/{i}"].tobytes() for i in range(count)]
        attempt = tensors.get(f"{TENSOR_PREFIX}attempt")
        held.payload = attempt.tobytes() if attempt is not None and held.attempt is not None else b""
        if held.attempt is not None and not held.payload:
            held.attempt = None  # its bytes are gone: the work goes out as one new push
        return held


def _array(payload: bytes) -> np.ndarray:
    return np.frombuffer(payload, np.uint8)
