"""What the PS shows about itself: push counters, validation losses, the applied-update history, site metrics."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from geofed_hpc.log import logger
from geofed_hpc.rpc import messages as m

APPLIED_KEPT = 256  # recent global updates kept for `ps up`'s progress lines


@dataclass
class Contribution:
    """One delta admitted to the open round."""

    site: str
    staleness: int
    tokens: int
    nbytes: int


@dataclass
class AppliedVersion:
    """One global update: which sites' deltas made it, how stale, how many tokens and bytes."""

    version: int
    time: float
    sites: list[str]
    staleness: int  # the largest among its deltas
    tokens: int
    nbytes: int
    active: int
    why: str


class Observer:
    """Owns the PS's observability, none of it persisted: pushes and bytes received, each site's newest validation
    loss, the contributions of the open round and the last APPLIED_KEPT global updates (`ps up`'s progress
    table), and the hook that hands a site's values to Prometheus (`on_site_metrics`).

    Lock: its own `_lock` guards every field; it calls nothing while holding it, so callers may hold theirs (the
    coordinator's) around any method, and readers (`ps up`, the metrics ticker) never wait for a round to close.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pushes_total = 0
        self.bytes_received_total = 0
        self._val_losses: dict[str, tuple[int, float]] = {}  # site -> (version it evaluated, validation loss)
        self._contributions: list[Contribution] = []  # of the open round
        self._applied: deque[AppliedVersion] = deque(maxlen=APPLIED_KEPT)
        self.on_site_metrics: Callable[[str, dict[str, float]], None] | None = None

    def received(self, nbytes: int) -> None:
        """One push of `nbytes` was applied to the open round."""
        with self._lock:
            self.pushes_total += 1
            self.bytes_received_total += nbytes

    def val_loss(self, site: str, version: int, loss: float) -> None:
        with self._lock:
            self._val_losses[site] = (version, loss)

    def contributed(self, contribution: Contribution) -> None:
        with self._lock:
            self._contributions.append(contribution)

    def round_dropped(self) -> None:
        """The open round is gone without an update (a model was adopted, or its aggregation failed)."""
        with self._lock:
            self._contributions = []

    def applied(self, version: int, active: int, why: str) -> None:
        """The open round became global `version`."""
        with self._lock:
            parts, self._contributions = self._contributions, []
            self._applied.append(
                AppliedVersion(
                    version,
                    time.time(),
                    [c.site for c in parts],
                    max((c.staleness for c in parts), default=0),
                    sum(c.tokens for c in parts),
                    sum(c.nbytes for c in parts),
                    active,
                    why,
                )
            )

    def applied_since(self, version: int) -> list[dict]:
        """The kept global updates after `version`, oldest first, as plain dicts."""
        with self._lock:
            return [asdict(a) for a in self._applied if a.version > version]

    def global_val_loss(self) -> tuple[int, float]:
        """The newest version any site evaluated, and the mean validation loss the sites reported for it
        ((-1, nan): none yet)."""
        with self._lock:
            if not self._val_losses:
                return -1, float("nan")
            newest = max(v for v, _ in self._val_losses.values())
            losses = [loss for v, loss in self._val_losses.values() if v == newest]
            return newest, sum(losses) / len(losses)

    def values(self, version: int, active: int) -> dict[str, float | int]:
        """The ps/* metric values for global `version` (its validation loss once a site reported it)."""
        with self._lock:
            values: dict[str, float | int] = {
                "ps/version": version,
                "ps/active_sites": active,
                "ps/pushes_total": self.pushes_total,
                "ps/bytes_received_total": self.bytes_received_total,
            }
        evaluated, loss = self.global_val_loss()
        if evaluated == version:  # a loss of an older version is not the global model's
            values["ps/global_val_loss"] = loss
        return values

    def pushed(self, site: str, header: m.PushHeader, staleness: int, nbytes: int, site_tokens: int) -> None:
        """Hand a site's applied push to the hook (`site_tokens`: all the site contributed so far)."""
        values = {
            "sync/bytes_sent": nbytes,
            "sync/staleness": staleness,
            "sync/local_steps": header.local_steps,
            "train/loss": header.train_loss,
            "site/contribution_tokens": header.tokens,
            "site/contribution_total": site_tokens,
        }
        self.site_metrics(site, values)

    def site_metrics(self, site: str, metrics: dict[str, float]) -> None:
        """Hand one site's values to the observer hook (Prometheus); a hook never fails an RPC."""
        hook = self.on_site_metrics
        if hook is None:
            return
        try:
            hook(site, metrics)
        except Exception:  # noqa: BLE001
            logger.debug("site metrics observer failed", exc_info=True)
