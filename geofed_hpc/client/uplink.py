"""Pushing a site's work: encode local - base (error feedback, codec choice), push ids, work held through outages."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from geofed_hpc import codec
from geofed_hpc.client.deferred import Deferred
from geofed_hpc.client.events import EventLog
from geofed_hpc.client.progress import Progress
from geofed_hpc.client.telemetry import SyncTimer
from geofed_hpc.config import RunConfig
from geofed_hpc.errors import UnavailableError
from geofed_hpc.log import logger
from geofed_hpc.paradigms.exchange import Params
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient

# Once a push has spent ps.retry_budget, the site trains on; the attempts at the end of each later interval
# (and the heartbeats in between) are short: the next interval is the retry.
OFFLINE_ATTEMPT_BUDGET = timedelta(seconds=10)
# While the PS still receives a push we ask about, we ask again this often (its fate is not known yet).
RECEIVING_POLL = timedelta(seconds=1)


@dataclass
class Work:
    """The work since the base that one push carries."""

    session_id: str
    base_version: int
    steps: int  # every step since the base (confirmed ones of an outage included)
    tokens_per_step: int
    loss: float


class Uplink:
    """Encodes and pushes a site's work. `work_id` is the push id of the work since the base: every attempt of it,
    and a resume from a checkpoint holding it, reuses it, so the PS applies it once. `deferred` holds work the
    PS did not confirm because it was unreachable (deferred.py explains how it goes out later)."""

    def __init__(
        self,
        cfg: RunConfig,
        name: str,
        events: EventLog,
        progress: Progress,
        additive: bool = True,
        error_feedback: bool = True,
        on_push: Callable[[m.PushHeader], None] | None = None,
    ) -> None:
        self.cfg, self.name, self.events, self.progress = cfg, name, events, progress
        self.on_push = on_push  # told of each push just before it goes out (the site records it on disk)
        self.additive = additive  # the paradigm's later steps can be pushed apart from confirmed ones
        self.error_feedback = error_feedback  # the paradigm's deltas carry the codec's residual forward
        self.feedback = codec.ErrorFeedback()  # the residual the codec lost, added to the next delta
        self.link = codec.LinkAdaptive(cfg.codec, name)  # codec=adaptive: picks the codec from push throughput
        self.deferred = Deferred()
        self.work_id = ""
        self.attempt: tuple[m.PushHeader, bytes] | None = None  # the push in flight (its bytes, if unanswered)
        self.push_version = 0  # the global version our last applied push made

    def budget(self) -> timedelta:
        """How long a push may keep retransmitting: ps.retry_budget, or a short attempt while already offline."""
        ps = self.cfg.ps
        return min(ps.retry_budget, OFFLINE_ATTEMPT_BUDGET) if self.deferred.active else ps.retry_budget

    def new_base(self) -> None:
        """A new base was pulled: work since it is new work, with a new push id."""
        self.work_id = ""

    def pending_id(self) -> str:
        """The id the pending work's push will carry, fixed now because a checkpoint records it."""
        self.work_id = self.work_id or uuid.uuid4().hex
        return self.work_id

    def push(
        self,
        client: PSClient,
        work: Work,
        local_update: Callable[[], Params],
        settings: m.RunSettings,
        timer: SyncTimer,
    ) -> tuple[int, int]:
        """Push local - base plus the residual the codec lost last time. After an outage the PS is first asked
        about the attempt whose reply never came: only work it does not hold goes out. Returns (bytes sent, raw
        bytes)."""
        self.attempt = None
        confirmed = self.deferred.attempt is not None and self.settle(client, work, timer)
        d = self.remaining(local_update())
        raw = sum(v.nbytes for v in d.values())
        steps = work.steps - self.deferred.applied_steps
        if confirmed and (steps == 0 or not self.additive):
            if steps:
                logger.warning("%s: %s cannot push later steps apart: %d dropped", self.name, settings.paradigm, steps)
            elif self.error_feedback:
                self.feedback.keep(d)  # nothing new: what the codec lost rides on the next delta
            return 0, raw
        name = settings.codec
        if name == "adaptive":
            name = self.link.choose(raw // 4, settings.sync_interval_s)
        cfg = dataclasses.replace(self.cfg.codec, name=name, block_size=settings.block_size)
        t_enc = time.monotonic()
        if self.error_feedback:
            payload, residual = self.feedback.encode(d, cfg)
        else:
            payload, residual = codec.encode(d, cfg), self.feedback.residual
        timer.encode_s += time.monotonic() - t_enc
        tokens = steps * work.tokens_per_step
        push_id = self.work_id = self.work_id or uuid.uuid4().hex
        header = m.PushHeader(
            work.session_id, work.base_version, steps, tokens, name, 0, b"", push_id, train_loss=work.loss
        )
        self.attempt = (header, payload)  # unanswered (UnavailableError): `defer` keeps it, to ask the PS about
        if self.on_push is not None:
            self.on_push(header)
        t0 = time.monotonic()
        reply = client.push_delta(header, payload, budget=self.budget())
        self.attempt, self.work_id = None, ""
        self.link.observe(name, len(payload), raw // 4, time.monotonic() - t0)
        timer.push_s += time.monotonic() - t_enc
        timer.staleness = reply.staleness
        if reply.accepted:
            self.feedback.commit(residual)  # a refused push keeps the old residual; its delta is dropped
            self.push_version = reply.version
            if reply.duplicate:  # an earlier attempt of this work went in (before a restart, say): applied once
                logger.info("%s: the PS already holds push %s; not applied twice", self.name, push_id[:8])
            else:
                self._contributed(tokens, timer)
        else:
            logger.warning("%s: push not applied: %s", self.name, reply.reason)
        return len(payload), raw

    def settle(self, client: PSClient, work: Work, timer: SyncTimer) -> bool:
        """Ask the PS about the attempt whose reply never came. True: it holds it (its work is in; what was trained
        since goes out on its own). False: it does not, and the whole work goes out under that attempt's push id
        (should the old attempt still arrive first, the PS applies one of the two, never both).
        UnavailableError: still unreachable."""
        held = self.deferred
        assert held.attempt is not None
        push_id = str(held.attempt["push_id"])
        reply = self.ask(client, work.session_id, work.base_version, push_id)
        self.events("unanswered_push", push_id=push_id, state=reply.push or "not held", version=reply.version)
        if reply.push != "applied":
            self.work_id = push_id
            held.forget_attempt()
            return False
        logger.info("%s: the PS applied our push %s (only its reply was lost)", self.name, push_id[:8])
        self._contributed(int(held.attempt["tokens"]), timer)
        self.push_version = reply.version
        held.confirm()
        return True

    def ask(self, client: PSClient, session_id: str, version: int, push_id: str) -> m.HeartbeatReply:
        """What the PS knows of `push_id`: "applied", or "" (not held). While a stream of it is still arriving
        ("receiving") its fate is not known, so the PS is asked again until it is, within the push budget
        (then UnavailableError: the work stays held, and the next interval asks again)."""
        budget = self.budget()
        deadline = time.monotonic() + budget.total_seconds()
        request = m.HeartbeatRequest(session_id, version, push_id=push_id)
        reply = client.heartbeat(request, budget=budget)
        while reply.push == "receiving":
            if time.monotonic() >= deadline:
                raise UnavailableError(f"the PS is still receiving push {push_id[:8]}; asking again later")
            time.sleep(RECEIVING_POLL.total_seconds())
            reply = client.heartbeat(request, budget=budget)
        return reply

    def remaining(self, update: Params) -> Params:
        """`update` (local - base) less the confirmed attempts of this outage (their decoded payloads), in place:
        the work the PS does not hold yet. Their codec error stays in it; the old residual is added on encoding."""
        for payload in self.deferred.applied:
            for name, value in codec.decode(payload).items():
                update[name] -= value
        return update

    def defer(self, steps: int, loss_sum: float) -> bool:
        """The PS stayed unreachable for the whole retry budget: keep this work (still relative to the same base)
        and the bytes of the attempt that may have reached it. True for the first interval of an outage."""
        attempt = self.attempt  # None: the attempt held from before is still the unanswered one
        if attempt is not None:
            self.work_id = ""  # those bytes keep their id; new work gets a new one
        return self.deferred.record(steps, loss_sum, attempt)

    def _contributed(self, tokens: int, timer: SyncTimer) -> None:
        timer.contribution += tokens
        self.progress.contribution_total += tokens
