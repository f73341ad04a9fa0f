"""A site's session with the parameter server: join or rejoin, seed an empty PS, heartbeats, report, leave."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Any

from geofed_hpc import codec
from geofed_hpc.ckpt.secret import read_secret, write_secret
from geofed_hpc.client.deferred import Deferred
from geofed_hpc.client.events import EventLog
from geofed_hpc.config import CodecConfig, RunConfig
from geofed_hpc.errors import AuthError, GeofedError, UnavailableError
from geofed_hpc.log import logger
from geofed_hpc.paradigms.exchange import Params
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient

# A heartbeat between training steps waits at most this long (a PS behind a dropped link must not stall training).
TRAINING_HEARTBEAT_TIMEOUT = timedelta(seconds=3)


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


class PSLink:
    """The session (`session`: id, one-time rejoin token, the settings the PS imposes) over `client`, the open
    connection. The rejoin token lives in a 0600 file beside the checkpoints, rewritten at every Join."""

    def __init__(self, cfg: RunConfig, name: str, directory: Path, events: EventLog) -> None:
        self.cfg, self.name, self.events = cfg, name, events
        self.token_file = directory / "rejoin.json"
        self.client: PSClient | None = None
        self.session = m.JoinReply("", "", 0, False)
        self.heartbeats = HeartbeatClock(cfg.ps.heartbeat_interval)

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def settings(self) -> m.RunSettings:
        return self.session.settings

    def connected(self) -> PSClient:
        assert self.client is not None, "the site's loop opens the connection first"
        return self.client

    def join(self, resume_session: str = "", old_token: str = "") -> m.JoinReply:
        """Join with the one-time rejoin token of `resume_session` when we have one (the token file's, else
        `old_token`, where older checkpoints kept it), else enroll with site.token; the PS refuses a site whose
        paradigm differs from its own."""
        client, paradigm = self.connected(), self.cfg.paradigm.describe()
        if resume_session:
            try:
                token = read_secret(self.token_file).get("rejoin_token") or old_token
                request = m.JoinRequest(self.name, token, resume_session=resume_session, paradigm=paradigm)
                return self._joined(client.join(request))
            except AuthError as exc:
                logger.info("%s: rejoin refused (%s); enrolling again", self.name, exc)
        return self._joined(client.join(m.JoinRequest(self.name, self.cfg.site.token, paradigm=paradigm)))

    def _joined(self, reply: m.JoinReply) -> m.JoinReply:
        self.session = reply
        write_secret(self.token_file, {"session_id": reply.session_id, "rejoin_token": reply.rejoin_token})
        return reply

    def start(self, meta: dict[str, Any] | None) -> m.JoinReply:
        """Connect and join as a job starts. When the PS is unreachable, a checkpoint that holds a base (the
        global model at its version, or unpushed work with its base), its session and the run settings is enough
        to train on: its work goes out, as a deferred push, when the PS answers. Without one, UnavailableError."""
        try:
            self.connected().connect()
            if not meta:
                return self.join()
            return self.join(str(meta.get("session_id") or ""), str(meta.get("rejoin_token") or ""))
        except UnavailableError as exc:
            if not meta or not (meta.get("session_id") and meta.get("settings")):
                raise
            if not (meta.get("pending") or meta.get("global_model")):  # a pushed delta's pull never came
                raise
            version = int(meta["version"])
            logger.warning(
                "%s: %s; training on from the local checkpoint (version %d): its work goes out when the PS answers",
                self.name,
                exc,
                version,
            )
            self.events("offline_start", version=version, error=str(exc)[:300])
            known = {f.name for f in fields(m.RunSettings)}
            settings = m.RunSettings(**{k: v for k, v in meta["settings"].items() if k in known})
            self.session = m.JoinReply(str(meta["session_id"]), "", version, True, settings)
            return self.session

    def rejoin(self, why: Exception, version: int) -> None:
        """The PS answers but no longer knows our session (it restarted without its state): join again."""
        logger.warning("%s: %s; joining the parameter server again", self.name, why)
        self.events("rejoin", version=version, error=str(why)[:300])
        self.join(self.session_id)

    def seed(self, arrays: Params, version: int, behind: int | None = None) -> bool:
        """The PS holds no model: upload `arrays` (bootstrap at version 0), or re-seed it with our base at
        `version` (the global model we last pulled) so that our work since then still applies; also when the PS
        holds an older version (`behind`: it came back from an older snapshot without its journal). False: another
        site was first."""
        if behind is not None:
            logger.warning(
                "%s: the PS is at version %d, behind our base v%d (it restarted from an older snapshot): re-seeding "
                "it from ours",
                self.name,
                behind,
                version,
            )
            self.events("reseed", version=version, ps_version=behind)
        elif version > 0:
            logger.warning("%s: the PS has no model; re-seeding it from ours (v%d)", self.name, version)
            self.events("reseed", version=version)
        init = codec.encode(arrays, CodecConfig(name="fp32"))
        header = m.PushHeader(self.session_id, version, 0, 0, "fp32", 0, b"", "", init=True)
        reply = self.connected().push_delta(header, init)
        if reply.accepted:
            self.session.version = reply.version
        else:
            logger.info("%s: the global model was seeded by another site first (%s)", self.name, reply.reason)
        return reply.accepted

    def interval_ends(self, steps: int, version: int, deferred: Deferred) -> bool:
        """A heartbeat while training (liveness), when one is due. True ends the interval: in sync mode the PS
        says the round waits for us ("sync now"); after a failed push, the PS answers again; or the PS forgot
        our session (the push joins it again)."""
        if self.client is None or not self.heartbeats.due():
            return False
        request = m.HeartbeatRequest(self.session_id, version, local_steps=steps)
        try:
            reply = self.client.heartbeat(request, budget=timedelta(0), timeout=TRAINING_HEARTBEAT_TIMEOUT)
        except AuthError as exc:  # the PS answers but forgot our session: push now (joining it again first)
            logger.info("%s: the parameter server does not know us any more (%s); pushing now", self.name, exc)
            return True
        except GeofedError as exc:  # unreachable: the push at the interval's end retries
            logger.debug("%s: heartbeat failed: %s", self.name, exc)
            return False
        if deferred.active:
            logger.info("%s: the parameter server answers again; pushing the deferred work now", self.name)
            self.events("ps_reachable", version=reply.version, offline_s=round(deferred.offline_seconds(), 1))
            return True
        if reply.sync_now:
            logger.info("%s: the round waits for us (sync now): pushing after %d local steps", self.name, steps)
            self.events("sync_now", steps=steps, version=version, global_version=reply.version)
            return True
        return False

    def ps_version(self, version: int) -> int | None:
        """The PS's global version now (one heartbeat), None when it does not answer."""
        try:
            return self.connected().heartbeat(m.HeartbeatRequest(self.session_id, version)).version
        except GeofedError as exc:
            logger.debug("%s: heartbeat failed: %s", self.name, exc)
            return None

    def report(self, version: int, val_loss: float, what: str, goodput: float = 0.0) -> float | None:
        """One heartbeat telling the PS the validation loss of the global model at `version` (0: none) and the site's
        goodput (0: none); its round-trip seconds, None when it failed (logged: `what` says which report)."""
        t0 = time.monotonic()
        try:
            request = m.HeartbeatRequest(self.session_id, version, val_loss=val_loss, goodput=goodput)
            self.connected().heartbeat(request)
        except GeofedError as exc:
            logger.warning("%s: %s failed: %s", self.name, what, exc)
            return None
        return time.monotonic() - t0

    def leave(self, version: int) -> None:
        try:
            self.connected().heartbeat(m.HeartbeatRequest(self.session_id, version, leaving=True))
        except GeofedError as exc:
            logger.warning("%s: could not tell the PS we leave: %s", self.name, exc)
