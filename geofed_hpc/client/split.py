"""A site's side of split learning: its cut-layer activations to the server part beside the PS, and what comes back."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta

import numpy as np

from geofed_hpc import codec
from geofed_hpc.client.events import EventLog
from geofed_hpc.client.link import PSLink
from geofed_hpc.config import CodecConfig, RunConfig
from geofed_hpc.errors import AuthError, GeofedError, ProtocolError
from geofed_hpc.log import logger
from geofed_hpc.paradigms.site import SplitSite
from geofed_hpc.rpc import messages as m

FP32 = CodecConfig(name="fp32")
# An upload that does not wait for a gradient (fsl_sage), an evaluation or a fetch gives up soon when the PS does
# not answer: the site trains on without it (split's gradient is retried for ps.retry_budget: it cannot).
QUICK_BUDGET = timedelta(seconds=4)


class SplitLink:
    """paradigms.split.CutLink over the site's session (`link`): activations go up encoded with paradigm.act_codec,
    targets losslessly. fsl_sage's uploads ("train") and evaluations that fail are skipped with a warning (the site
    trains on with its estimate); split's gradients are waited for. `after_pull` takes the server's fitted
    auxiliary model after a pull of an alignment version. `metrics` reports, per sync, the bytes of training traffic
    (uploads, gradients, fitted models) and of evaluations apart, and the server part's mean loss on the uploads."""

    def __init__(
        self, cfg: RunConfig, link: PSLink, paradigm: SplitSite, events: EventLog, version: Callable[[], int]
    ) -> None:
        self.cfg, self.link, self.paradigm, self.events, self.version = cfg, link, paradigm, events, version
        self.acts_codec = CodecConfig(name=cfg.paradigm.act_codec, block_size=cfg.codec.block_size)
        self.bytes_up = self.bytes_down = self.eval_bytes = self.failed = 0
        self.losses: list[float] = []
        self.alignments = 0  # the server's count, as last heard

    # ---------------------------------------------------------------- CutLink
    def train(self, acts: np.ndarray, targets: np.ndarray) -> float:
        try:
            reply, _ = self._send("train", acts, targets, QUICK_BUDGET)
        except GeofedError as exc:
            self.failed += 1
            logger.warning("%s: upload of activations skipped: %s", self.link.name, exc)
            return math.nan
        self.losses.append(reply.loss)
        return reply.loss

    def gradient(self, acts: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
        reply, data = self._send("gradient", acts, targets, None)
        try:
            grad = codec.decode(data, expected={"grad": (tuple(acts.shape), "float32")})["grad"]
        except GeofedError as exc:
            raise ProtocolError(f"the server part's gradient does not decode: {exc}") from None
        self.losses.append(reply.loss)
        return reply.loss, grad

    def evaluate(self, acts: np.ndarray, targets: np.ndarray) -> float:
        try:
            reply, _ = self._send("eval", acts, targets, QUICK_BUDGET)
        except GeofedError as exc:
            logger.warning("%s: evaluation by the server part failed: %s", self.link.name, exc)
            return math.nan
        return reply.loss

    def _send(
        self, kind: str, acts: np.ndarray, targets: np.ndarray, budget: timedelta | None
    ) -> tuple[m.SplitHeader, bytes]:
        encoded = codec.encode({"acts": np.ascontiguousarray(acts, np.float32)}, self.acts_codec)
        payload = encoded + codec.encode({"targets": np.asarray(targets, np.float32)}, FP32)
        cut, shape = self.cfg.paradigm.cut, [int(v) for v in acts.shape]

        def send() -> tuple[m.SplitHeader, bytes]:
            header = m.SplitHeader(self.link.session_id, kind, cut, shape, self.acts_codec.name, 0, b"", len(encoded))
            header.version = self.version()
            return self.link.connected().split(header, payload, budget)

        try:
            reply, data = send()
        except AuthError as exc:  # the PS restarted without our session: join again, once
            self.link.rejoin(exc, self.version())
            reply, data = send()
        self.alignments = max(self.alignments, reply.alignments)
        if kind == "eval":
            self.eval_bytes += len(payload) + len(data)
        else:
            self.bytes_up, self.bytes_down = self.bytes_up + len(payload), self.bytes_down + len(data)
        return reply, data

    # ---------------------------------------------------------------- alignment, metrics
    def after_pull(self, version: int) -> None:
        """fsl_sage, after a pull of `version`: at an alignment version, fetch the auxiliary model the server fitted
        and hand it to the paradigm (it goes in at the first step of the round that starts from `version`)."""
        if not self.paradigm.alignment_due(version):
            return
        request = m.AuxRequest(self.link.session_id, version, self.cfg.paradigm.cut)
        try:
            header, data = self.link.connected().fetch_aux(request, QUICK_BUDGET)
        except GeofedError as exc:
            logger.warning("%s: no aligned auxiliary model for version %d: %s", self.link.name, version, exc)
            return
        self.bytes_down += len(data)
        self.alignments = max(self.alignments, header.alignments)
        if not data:
            self.events("align_skipped", version=version, why="the server keeps no activations yet")
            return
        self.paradigm.take_fitted(codec.decode(data), version)
        self.events("aligned", version=version, fitted_at=header.version, alignments=header.alignments)

    def metrics(self) -> dict[str, float | int]:
        """This sync's split traffic and server loss (the counters start again)."""
        out: dict[str, float | int] = {
            "split/bytes_up": self.bytes_up,
            "split/bytes_down": self.bytes_down,
            "split/eval_bytes": self.eval_bytes,
            "split/failed_uploads": self.failed,
            "split/alignments": self.alignments,
        }
        if self.losses:
            out["split/server_loss"] = float(np.mean(self.losses))
        self.bytes_up = self.bytes_down = self.eval_bytes = self.failed = 0
        self.losses = []
        return out
