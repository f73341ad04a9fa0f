"""Joining the parameter server, seeding it, resuming an interrupted interval, and taking the global model."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import numpy as np

from geofed_hpc import codec
from geofed_hpc.ckpt.secret import read_secret
from geofed_hpc.client.trainer_api import Site
from geofed_hpc.config import CodecConfig
from geofed_hpc.errors import AuthError, CodecError, ProtocolError, StaleError
from geofed_hpc.log import logger
from geofed_hpc.metrics import Recorder
from geofed_hpc.paradigms import Exchange
from geofed_hpc.paradigms.exchange import Params
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient


def apply_updates(base: Params, header: m.ModelHeader, payload: bytes, exchange: Exchange | None = None) -> Params:
    """Add the PS's encoded global updates (header.segments, in version order) to `base` in place, the same
    float32 adds the PS made (each update expanded by the paradigm as the PS does), so `base` stays
    bit-identical to the global model."""
    if sum(header.segments) != len(payload):
        raise ProtocolError(f"update segments add up to {sum(header.segments)} bytes, the payload has {len(payload)}")
    exchange = exchange or Exchange()
    shapes = {k: tuple(v.shape) for k, v in base.items()}
    expected = {k: (s, "float32") for k, s in exchange.wire_spec(shapes).items()}
    view, pos = memoryview(payload), 0
    for i, size in enumerate(header.segments):
        update = codec.decode(view[pos : pos + size], expected=expected)  # type: ignore[arg-type]
        for k, v in exchange.expand(update, header.base_version + i, shapes).items():
            base[k] += v
        pos += size
    return base


class Joining:
    """SiteTrainer's protocol steps with the PS (the state they read and set is the trainer's)."""

    def _join(self: Site, client: PSClient, meta: dict[str, Any] | None) -> m.JoinReply:
        paradigm = self.cfg.paradigm.describe()  # the PS refuses a site whose paradigm differs from its own
        if meta and meta.get("session_id"):
            try:
                token = read_secret(self.dir / "rejoin.json").get("rejoin_token") or meta.get("rejoin_token", "")
                request = m.JoinRequest(self.name, token, resume_session=meta["session_id"], paradigm=paradigm)
                return client.join(request)
            except AuthError as exc:
                logger.info("%s: rejoin refused (%s); enrolling again", self.name, exc)
        return client.join(m.JoinRequest(self.name, self.cfg.site.token, paradigm=paradigm))

    def _pull(self: Site, client: PSClient, min_version: int, wait: timedelta) -> None:
        """Take the global model: only the PS's encoded updates since our version when it still keeps them
        (self.base stays bit-identical to the PS), the full model otherwise."""
        have = self.version if self.base and self.base_global else None
        t0 = time.monotonic()
        header, payload = client.pull_model(self.session.session_id, min_version, wait, have_version=have)
        self.timer.pull_s += time.monotonic() - t0
        self.timer.wait_s += client.last_pull_wait_s
        self.timer.bytes_received += len(payload)
        if header.kind == "updates":
            try:
                if header.base_version != have:
                    raise ProtocolError(f"updates start at version {header.base_version}, we hold {have}")
                arrays = apply_updates(self.base, header, payload, self.exchange)
            except (CodecError, ProtocolError) as exc:
                logger.warning("%s: cannot apply the global updates (%s); pulling the full model", self.name, exc)
                self.base = {}
                self._pull(client, min_version, timedelta(0))
                return
        else:
            arrays = codec.decode(payload)
            if have is not None and header.version < have:
                logger.warning("%s: the PS is back at version %d (we held %d)", self.name, header.version, have)
        self.group.load_model(self._with_private(arrays))
        self.base, self.version, self.base_global = arrays, header.version, True
        self._work_id = ""  # work since this base is new work

    def _with_private(self: Site, arrays: Params) -> Params:
        """The global model plus this site's private tensors (hybrid_lora's adapters), which it never sends."""
        if not self.private:
            return arrays
        local = self.group.model_arrays()
        return {**{k: np.array(local[k], copy=True) for k in self.private}, **arrays}

    def _seed(self: Site, client: PSClient, version: int) -> bool:
        """The PS holds no model: upload ours (bootstrap at version 0), or re-seed it with our base at `version`
        (the global model we last pulled) so that our work since then still applies. False: another site was
        first."""
        arrays = self.base if self.base else self.exchange.public(self.group.model_arrays())
        if version > 0:
            logger.warning("%s: the PS has no model; re-seeding it from ours (v%d)", self.name, version)
            self._event("reseed", version=version)
        init = codec.encode(arrays, CodecConfig(name="fp32"))
        header = m.PushHeader(self.session.session_id, version, 0, 0, "fp32", 0, b"", "", init=True)
        reply = client.push_delta(header, init)
        if reply.accepted:
            self.session.version = reply.version
        else:
            logger.info("%s: the global model was seeded by another site first (%s)", self.name, reply.reason)
        return reply.accepted

    def _rejoin(self: Site, client: PSClient, why: Exception) -> None:
        """The PS answers but no longer knows our session (it restarted without its state): join again, and
        re-seed a PS that holds no model with our base, so that the federation goes on from our version."""
        logger.warning("%s: %s; joining the parameter server again", self.name, why)
        self._event("rejoin", version=self.version, error=str(why)[:300])
        self.session = self._join(client, {"session_id": self.session.session_id})
        self._keep_token()
        if not self.session.initialized and self._seed(client, self.version):
            self.base_global = True  # the PS's model is now our base, bit for bit

    def _resume(
        self: Site, client: PSClient, meta: dict[str, Any] | None, settings: m.RunSettings, rec: Recorder
    ) -> str:
        """Continue an interrupted interval, or push its work and take the live model when that is fresher."""
        pending = meta.get("pending") if meta else None
        if meta and pending and int(meta["version"]) == self.session.version:
            self.version, held = int(meta["version"]), self.deferred
            steps, loss_sum = int(pending["steps"]) - held.steps, float(pending["loss_sum"]) - held.loss_sum
            self._carry = (steps, loss_sum, float(pending["elapsed_s"]))  # deferred work goes out with it
            return "local"
        if meta and pending:
            self.version, steps = int(meta["version"]), int(pending["steps"])
            self.phase = "busy"
            try:
                loss = float(pending["loss_sum"]) / steps
                sent, _ = self._push(client, settings, steps, loss)
                self._pushed()
                self.syncs += 1
                rec.log(
                    {
                        "sync/index": self.syncs,
                        "sync/version": self.version,
                        "sync/local_steps": steps,
                        "train/loss": float(pending["loss_sum"]) / steps,
                        "sync/bytes_sent": sent,
                    }
                )
            except StaleError as exc:
                logger.warning("%s: %s; the %d steps before the requeue are dropped", self.name, exc, steps)
                self.deferred.clear()
        if not self._disk_is_current(meta):
            self._pull(client, 0, timedelta(0))
        if pending:
            self._save()
        self._checkpointed()
        return "fresh" if not meta else "local" if int(meta["version"]) == self.version else "global"
