"""One sync with the parameter server: push the interval's work (rejoining or deferring as needed), then pull."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from geofed_hpc.client.checkpoints import Restored
from geofed_hpc.client.group import SiteGroup
from geofed_hpc.client.link import PSLink
from geofed_hpc.client.progress import Interval, Progress
from geofed_hpc.client.replica import PSBehind, Replica
from geofed_hpc.client.split import SplitLink
from geofed_hpc.client.telemetry import RttMeter, SyncTimer, gpu_metrics, rss_gb
from geofed_hpc.client.uplink import Uplink, Work
from geofed_hpc.config import RunConfig
from geofed_hpc.errors import AuthError, StaleError, UnavailableError
from geofed_hpc.log import logger
from geofed_hpc.metrics import Recorder
from geofed_hpc.paradigms.exchange import Params
from geofed_hpc.paradigms.site import SiteParadigm

# The pull after a push waits for the version it makes: up to the round's timeout and this much more.
EXTRA_PULL_WAIT = timedelta(seconds=30)
# A site that leaves waits this long at most for the report of its last overlapped landing.
REPORT_WAIT = timedelta(seconds=30)


class SafePoints(Protocol):
    """What the site's loop does at the moves of a sync (the trainer: phases, checkpoints, stop requests)."""

    def busy(self) -> None: ...

    def pushed(self) -> None: ...

    def checkpointed(self) -> None: ...

    def save(self, pending: dict[str, Any] | None = None) -> object: ...


@dataclass
class Synced:
    """What one sync did: bytes sent (encoded) and raw, seconds pushing, deferred intervals it carried."""

    sent: int
    raw: int
    push_s: float
    held: int
    offline_s: float


class SiteSync:
    """The protocol steps of a sync, over the site's parts: the link (session), the replica (base and pulls) and
    the uplink (pushes, deferred work). `timer` collects where the current sync's time went."""

    def __init__(
        self,
        cfg: RunConfig,
        link: PSLink,
        replica: Replica,
        uplink: Uplink,
        group: SiteGroup,
        paradigm: SiteParadigm,
        safe: SafePoints,
        split: SplitLink | None = None,
    ) -> None:
        self.cfg, self.link, self.replica, self.uplink = cfg, link, replica, uplink
        self.group, self.paradigm, self.safe = group, paradigm, safe
        self.split = split  # fsl_sage / split: the way to the server part
        self.name = replica.name
        self.timer = SyncTimer()
        self.rtt = RttMeter()
        self.rec: Recorder | None = None
        self._reporting: threading.Thread | None = None  # an overlapped landing's report, on its own thread
        self._reported_rtt_s: float | None = None  # its round trip, shown with the next sync's metrics

    @property
    def version(self) -> int:
        return self.replica.version

    def tokens_per_step(self) -> int:
        return self.cfg.train.batch_size * self.cfg.model.context

    def _local_update(self) -> Params:
        return self.paradigm.wire_update(self.group.model_arrays(), self.replica.base)

    def push(self, steps: int, loss: float) -> tuple[int, int]:
        """Push the work since the base under the settings the PS imposes (a rejoin may have changed them)."""
        work = Work(self.link.session_id, self.replica.version, steps, self.tokens_per_step(), loss)
        return self.uplink.push(self.link.connected(), work, self._local_update, self.link.settings, self.timer)

    def pull(self, min_version: int, wait: timedelta, pushed: int | None = None) -> None:
        """Take the global model. A PS found behind our base came back without its journal: the freshest copy wins
        and re-seeds it, our base, or with `pushed` (the version our push made, lost with that journal) the local
        model, which holds the pushed work."""
        client, session = self.link.connected(), self.link.session_id
        try:
            self.replica.pull(client, session, min_version, wait, self.timer)
        except PSBehind as behind:
            if pushed is not None:
                self.replica.adopt_local(pushed)
            if not self.reseed_if_behind(behind.version):  # another site's copy won: take it whole
                self.replica.base = {}
                self.replica.pull(client, session, 0, timedelta(0), self.timer)
        self.uplink.new_base()  # work since this base is new work
        if self.split is not None:
            self.split.after_pull(self.replica.version)  # fsl_sage: the fitted auxiliary model, when aligned

    def exchange(self, steps: int, loss: float) -> Synced | None:
        """Push this interval's work and pull the version it makes. None: the PS stayed unreachable; the work is
        deferred (checkpointed with its base) and the site trains on."""
        deferred = self.uplink.deferred
        held, offline_s = deferred.intervals, deferred.offline_seconds()
        t1 = time.monotonic()
        try:
            sent, raw = self._push_or_rejoin(steps, loss)
            self.safe.pushed()
            push_s = time.monotonic() - t1
            self._pull_after_push(self.cfg.ps.round_timeout + EXTRA_PULL_WAIT)
        except StaleError as exc:
            logger.warning("%s: %s; dropping this delta and pulling the latest model", self.name, exc)
            deferred.clear()
            sent, raw, push_s = 0, 0, time.monotonic() - t1
            self.pull(0, timedelta(0))
        except UnavailableError as exc:  # the push's retry budget is spent: train on, push later
            self._defer(steps, loss, exc)
            return None
        if held:
            logger.info("%s: pushed %d steps trained while the PS was unreachable", self.name, steps)
            self.link.events("deferred_pushed", steps=steps, intervals=held, offline_s=round(offline_s, 1))
        return Synced(sent, raw, push_s, held, offline_s)

    def _push_or_rejoin(self, steps: int, loss: float) -> tuple[int, int]:
        """A PS that answers but no longer knows our session (it restarted without its state) is joined again, and
        re-seeded with our base when it holds no model or an older one; a PS that refuses our work as from the future
        (it came back from an older snapshot without its journal) is re-seeded with our base. Then the work goes
        out, once."""
        for attempt in range(3):
            try:
                return self.push(steps, loss)
            except AuthError as exc:
                if attempt == 2:
                    raise
                self.rejoin(exc)
            except StaleError:
                if attempt == 2 or not self.reseed_if_behind(self.link.ps_version(self.replica.version)):
                    raise
        raise AssertionError("unreachable")

    def rejoin(self, why: Exception) -> None:
        """Join again; re-seed a PS that holds no model, or an older one, with our base, so the federation goes on
        from our version."""
        self.link.rejoin(why, self.replica.version)
        if not self.link.session.initialized:
            if self.link.seed(self.replica.seed_arrays(), self.replica.version):
                self.replica.exact = True  # the PS's model is now our base, bit for bit
        else:
            self.reseed_if_behind(self.link.session.version)

    def reseed_if_behind(self, ps_version: int | None) -> bool:
        """The freshest copy wins: when the PS's version is older than our base, our base becomes the global model
        (its version ours), so that our work since then applies on top of it. Whether it did."""
        if ps_version is None or ps_version >= self.replica.version or not self.replica.base:
            return False
        if not self.link.seed(self.replica.seed_arrays(), self.replica.version, behind=ps_version):
            return False
        self.replica.exact = True
        return True

    def _pull_after_push(self, wait: timedelta) -> None:
        """Pull the version after our push. If the PS became unreachable since the push went in, train on from
        the local model: it becomes the base at the version pushed to (the next pull is a full one)."""
        try:
            self.pull(self.replica.version + 1, wait, pushed=self.uplink.push_version)
        except (UnavailableError, AuthError) as exc:
            logger.warning("%s: %s; our delta is in, training on from the local model", self.name, exc)
            self.link.events("pull_failed", version=self.uplink.push_version, error=str(exc)[:300])
            self.replica.adopt_local(self.uplink.push_version)
            self.uplink.new_base()
            if isinstance(exc, AuthError):  # the PS restarted without its state since our push: join it again
                self.rejoin(exc)  # (re-seeding it with this model if it holds none)
                self.pull(0, timedelta(0))

    def _defer(self, steps: int, loss: float, exc: UnavailableError) -> None:
        """Keep this work and the bytes of the attempt that may have reached the PS, checkpoint both, train on."""
        if self.uplink.defer(steps, loss * steps):
            logger.warning(
                "%s: %s; training on: the %d steps since version %d go out when the PS answers again",
                self.name,
                exc,
                steps,
                self.replica.version,
            )
        intervals = self.uplink.deferred.intervals
        self.link.events("push_deferred", version=self.replica.version, steps=steps, intervals=intervals)
        if self.rec is not None:
            self.rec.log({"sync/deferred_intervals": intervals, "sync/version": self.replica.version})
        self.safe.save({"steps": steps, "loss_sum": loss * steps, "elapsed_s": 0.0})
        self.safe.checkpointed()

    def telemetry(
        self,
        val_loss: float,
        sent: int,
        sync_s: float,
        progress: Progress,
        goodput: float = 0.0,
        background: bool = False,
    ) -> dict[str, float | int]:
        """This sync's transfer, link, memory and contribution metrics; one Heartbeat measures the RTT and tells
        the PS the validation loss of the global model we just evaluated (its ps/global_val_loss) and the site's
        goodput (its site/goodput on Prometheus). `background` (an overlapped landing, training goes on): that
        Heartbeat goes out on its own thread and the RTT shown is the previous one's."""
        reported = val_loss if val_loss > 0 and self.replica.exact else 0.0  # only the global model's loss
        goodput = goodput if math.isfinite(goodput) else 0.0
        if background:
            rtt_s = self._report_beside(reported, goodput)
        else:
            rtt_s = self.link.report(self.replica.version, reported, "heartbeat after the sync", goodput)
        return {
            **self.timer.metrics(sent, sync_s),
            **(self.rtt.add(rtt_s) if rtt_s is not None else {}),
            "site/contribution_total": progress.contribution_total,
            "sys/rss_gb": rss_gb(),
            **gpu_metrics(),
            **(self.split.metrics() if self.split is not None else {}),
        }

    def _report_beside(self, val_loss: float, goodput: float) -> float | None:
        """Send the per-sync report on its own thread; the training thread never waits for its round trip (one
        still out, its PS unreachable, say: this one is dropped, the next carries newer figures). The round-trip
        seconds of the previous report, None when none came back since."""
        if self._reporting is not None and self._reporting.is_alive():
            return None
        rtt_s, self._reported_rtt_s = self._reported_rtt_s, None
        version = self.replica.version

        def run() -> None:
            self._reported_rtt_s = self.link.report(version, val_loss, "heartbeat after the sync", goodput)

        self._reporting = threading.Thread(target=run, name=f"{self.name}-report", daemon=True)
        self._reporting.start()
        return rtt_s

    def settle_report(self, wait: timedelta = REPORT_WAIT) -> None:
        """Wait (at most `wait`) for a report still out, before the site tells the PS it leaves."""
        if self._reporting is not None:
            self._reporting.join(wait.total_seconds())
            self._reporting = None

    def report_first(self, val_loss: float) -> None:
        """The PS's ps/global_val_loss starts at the version the site first evaluated."""
        if val_loss > 0:
            self.link.report(self.replica.version, val_loss, "reporting the first evaluation")

    def resume(self, restored: Restored | None, interval: Interval, progress: Progress) -> str:
        """Continue an interrupted interval, or push its work and take the live model when that is fresher.
        Returns where the model came from: fresh, local (the checkpoint) or global (the PS)."""
        if restored is None:
            self._pull_live()
            self.safe.checkpointed()
            return "fresh"
        pending = restored.pending
        if pending and restored.version == self.link.session.version:
            held = self.uplink.deferred  # deferred work goes out with the carried interval
            self.replica.version = restored.version
            steps, loss_sum = int(pending["steps"]) - held.steps, float(pending["loss_sum"]) - held.loss_sum
            interval.carry = (steps, loss_sum, float(pending["elapsed_s"]))
            return "local"
        if pending:
            self._push_pending(restored.version, pending, progress)
        if not self._disk_is_current(restored):
            self._pull_live()
        if pending:
            self.safe.save()
        self.safe.checkpointed()
        return "local" if restored.version == self.replica.version else "global"

    def _pull_live(self) -> None:
        """Take the live model at (re)start. A PS that forgot the session we just joined (its peer in a group took
        over from one that died meanwhile, or it restarted without its state) is joined again first, once."""
        try:
            self.pull(0, timedelta(0))
        except AuthError as exc:
            self.rejoin(exc)
            self.pull(0, timedelta(0))

    def _push_pending(self, version: int, pending: dict[str, Any], progress: Progress) -> None:
        """The checkpoint's unpushed work is against an older version than the PS's: push it now."""
        self.replica.version, steps = version, int(pending["steps"])
        self.safe.busy()
        try:
            loss = float(pending["loss_sum"]) / steps
            sent, _ = self._push_or_rejoin(steps, loss)
            self.safe.pushed()
            progress.syncs += 1
            if self.rec is not None:
                self.rec.log(
                    {
                        "sync/index": progress.syncs,
                        "sync/version": self.replica.version,
                        "sync/local_steps": steps,
                        "train/loss": loss,
                        "sync/bytes_sent": sent,
                    }
                )
        except StaleError as exc:
            logger.warning("%s: %s; the %d steps before the requeue are dropped", self.name, exc, steps)
            self.uplink.deferred.clear()

    def _disk_is_current(self, restored: Restored) -> bool:
        """A checkpoint holding the global model is our base at its version: skip the pull when the PS is still
        there, else pull only what is newer (the PS's updates since that version, when it keeps them)."""
        meta = restored.meta
        if restored.pending or not meta.get("global_model") or not restored.model:
            return False
        self.replica.adopt_disk(restored.model, restored.version)
        return self.replica.version == self.link.session.version
