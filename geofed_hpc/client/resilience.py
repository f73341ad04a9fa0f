"""Riding out an unreachable parameter server: train on; when it answers, ask whether it holds the unanswered
push, then push only the work it does not hold, against the same base."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

import numpy as np

from geofed_hpc import codec
from geofed_hpc.client.deferred import Deferred
from geofed_hpc.client.trainer_api import Site
from geofed_hpc.config import PSConfig
from geofed_hpc.errors import AuthError, GeofedError, UnavailableError
from geofed_hpc.log import logger
from geofed_hpc.paradigms.exchange import Params
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient

# Once a push has spent ps.retry_budget, the site trains on; the attempts at the end of each later interval
# (and the heartbeats in between) are short: the next interval is the retry.
OFFLINE_ATTEMPT_BUDGET = timedelta(seconds=10)
# A heartbeat between training steps waits at most this long (a PS behind a dropped link must not stall training).
TRAINING_HEARTBEAT_TIMEOUT = timedelta(seconds=3)


def push_budget(cfg: PSConfig, deferred: Deferred) -> timedelta:
    """How long a push may keep retransmitting: ps.retry_budget, or a short attempt while already offline."""
    return min(cfg.retry_budget, OFFLINE_ATTEMPT_BUDGET) if deferred.active else cfg.retry_budget


@dataclass
class HeartbeatClock:
    """When the next heartbeat of a training interval is due (every ps.heartbeat_interval)."""

    interval: timedelta
    _next: float = 0.0

    def start(self) -> None:
        self._next = time.monotonic() + self.interval.total_seconds()

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.interval.total_seconds()
        return True


class RidesOutages:
    """SiteTrainer's steps for a PS that does not answer: a start from the checkpoint alone, heartbeats while
    training, a deferred push (settling the unanswered attempt first), training on from the local model when the
    pull after a push fails."""

    def _offline_session(self: Site, meta: dict[str, Any] | None, exc: UnavailableError) -> m.JoinReply:
        """The PS is unreachable as the job starts. A checkpoint that holds a base (the global model at its
        version, or unpushed work with its base), its session and the run settings is enough to train on: its
        work goes out, as a deferred push, when the PS answers. Without one, `exc` is raised."""
        if not meta or not (meta.get("session_id") and meta.get("settings")):
            raise exc
        if not (meta.get("pending") or meta.get("global_model")):  # a pushed delta's pull never came: need the PS
            raise exc
        version = int(meta["version"])
        logger.warning(
            "%s: %s; training on from the local checkpoint (version %d): its work goes out when the PS answers",
            self.name,
            exc,
            version,
        )
        self._event("offline_start", version=version, error=str(exc)[:300])
        known = {f.name for f in fields(m.RunSettings)}
        settings = m.RunSettings(**{k: v for k, v in meta["settings"].items() if k in known})
        return m.JoinReply(str(meta["session_id"]), "", version, True, settings)

    def _heartbeat_ends_interval(self: Site, steps: int) -> bool:
        """A heartbeat while training (liveness). True ends the interval: in sync mode the PS says the round
        waits for us ("sync now"); after a failed push, the PS answers again."""
        if self.client is None:
            return False
        request = m.HeartbeatRequest(self.session.session_id, self.version, local_steps=steps)
        try:
            reply = self.client.heartbeat(request, budget=timedelta(0), timeout=TRAINING_HEARTBEAT_TIMEOUT)
        except AuthError as exc:  # the PS answers but forgot our session: push now (joining it again first)
            logger.info("%s: the parameter server does not know us any more (%s); pushing now", self.name, exc)
            return True
        except GeofedError as exc:  # unreachable: the push at the interval's end retries
            logger.debug("%s: heartbeat failed: %s", self.name, exc)
            return False
        if self.deferred.active:
            logger.info("%s: the parameter server answers again; pushing the deferred work now", self.name)
            self._event("ps_reachable", version=reply.version, offline_s=round(self.deferred.offline_seconds(), 1))
            return True
        if reply.sync_now:
            logger.info("%s: the round waits for us (sync now): pushing after %d local steps", self.name, steps)
            self._event("sync_now", steps=steps, version=self.version, global_version=reply.version)
            return True
        return False

    def _pull_after_push(self: Site, client: PSClient, wait: timedelta) -> None:
        """Pull the version after our push. If the PS became unreachable since the push went in, train on from
        the local model: it becomes the base at the version pushed to (not bit-identical to the PS: the next
        pull is a full one)."""
        try:
            self._pull(client, self.version + 1, wait)
        except (UnavailableError, AuthError) as exc:
            logger.warning("%s: %s; our delta is in, training on from the local model", self.name, exc)
            self._event("pull_failed", version=self._push_version, error=str(exc)[:300])
            self.base = {k: np.array(v, copy=True) for k, v in self.group.model_arrays().items()}
            self.version, self.base_global = self._push_version, False
            if isinstance(exc, AuthError):  # the PS restarted without its state since our push: join it again
                self._rejoin(client, exc)  # (re-seeding it with this model if it holds none)
                self._pull(client, 0, timedelta(0))

    def _push_or_rejoin(self: Site, client: PSClient, steps: int, loss: float) -> tuple[int, int]:
        """Push this interval's work. A PS that answers but no longer knows our session (it restarted without its
        state) is joined again, and re-seeded with our base when it holds no model; then the work goes out."""
        try:
            return self._push(client, self.session.settings, steps, loss)
        except AuthError as exc:
            self._rejoin(client, exc)
        return self._push(client, self.session.settings, steps, loss)

    def _defer(self: Site, steps: int, loss: float, exc: UnavailableError) -> None:
        """The PS stayed unreachable for the whole retry budget: keep this work (still relative to the same base)
        and the bytes of the attempt that may have reached it, checkpoint both, train on."""
        attempt = self._attempt  # None: the attempt held from before is still the unanswered one
        if attempt is not None:
            self._work_id = ""  # those bytes keep their id; new work gets a new one
        if self.deferred.record(steps, loss * steps, attempt):
            logger.warning(
                "%s: %s; training on: the %d steps since version %d go out when the PS answers again",
                self.name,
                exc,
                steps,
                self.version,
            )
        self._event("push_deferred", version=self.version, steps=steps, intervals=self.deferred.intervals)
        if self.rec is not None:
            self.rec.log({"sync/deferred_intervals": self.deferred.intervals, "sync/version": self.version})
        self._save(pending={"steps": steps, "loss_sum": loss * steps, "elapsed_s": 0.0})
        self._checkpointed()

    def _settle_unanswered(self: Site, client: PSClient) -> bool:
        """Ask the PS about the attempt whose reply never came. True: it holds it (its work is in; what was trained
        since goes out on its own). False: it does not, and the whole work goes out under that attempt's push id
        (should the old attempt still arrive first, the PS applies one of the two, never both).
        UnavailableError: still unreachable."""
        held = self.deferred
        assert held.attempt is not None
        push_id = str(held.attempt["push_id"])
        request = m.HeartbeatRequest(self.session.session_id, self.version, push_id=push_id)
        reply = client.heartbeat(request, budget=push_budget(self.cfg.ps, held))
        self._event("unanswered_push", push_id=push_id, state=reply.push or "not held", version=reply.version)
        if reply.push != "applied":
            self._work_id = push_id
            held.forget_attempt()
            return False
        logger.info("%s: the PS applied our push %s (only its reply was lost)", self.name, push_id[:8])
        self.timer.contribution += int(held.attempt["tokens"])
        self.contribution_total += int(held.attempt["tokens"])
        self._push_version = reply.version
        held.confirm()
        return True

    def _remaining(self: Site, update: Params) -> Params:
        """`update` (local - base) less the confirmed attempts of this outage (their decoded payloads), in place:
        the work the PS does not hold yet. Their codec error stays in it; the old residual is added on encoding."""
        for payload in self.deferred.applied:
            for name, value in codec.decode(payload).items():
                update[name] -= value
        return update
