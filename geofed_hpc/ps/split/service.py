"""Serving the server part: Split (activations up; loss, gradient down) and FetchAux, checked before anything moves."""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from geofed_hpc import codec
from geofed_hpc.config import CodecConfig, RunConfig
from geofed_hpc.config.train import ACT_CODECS
from geofed_hpc.errors import CodecError, LimitError, MismatchError, ProtocolError, StaleError, UnavailableError
from geofed_hpc.log import logger
from geofed_hpc.paradigms.cutserver import CutServer
from geofed_hpc.paradigms.exchange import Params
from geofed_hpc.ps.remote import local_state
from geofed_hpc.ps.split.store import SplitSnapshots
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.stream import collect, digest, to_chunks

# What each paradigm's sites may send: fsl_sage trains the server part without waiting for a gradient, split
# waits for it; both evaluate the composed model.
KINDS = {"fsl_sage": ("train", "eval"), "split": ("gradient", "eval")}
SLACK_BYTES = 1 << 16  # framing and entropy-coding overhead an encoded upload may add to 4 bytes a value


class SplitService:
    """The server part (CutServer) behind two RPCs. Every upload is checked before its payload is read (session,
    kind, the sender's cut, codec, shape, size) and decoded and checked before the lock is taken (values finite,
    targets token ids): a refused one leaves the server part as it was. `session_site` and `global_tensors` come
    from the coordinator. Snapshots (store.py) are written every ps.snapshot_every global versions (`tick`), after
    each alignment and at `close`, and restored at start.

    Lock: `_lock` guards the server part, its counters and its snapshots (one step or alignment at a time);
    `_slots` bounds the uploads read at once (ps.max_concurrent_pushes)."""

    def __init__(
        self,
        cfg: RunConfig,
        session_site: Callable[[str], str],
        global_tensors: Callable[[list[str]], tuple[int, Params]],
    ) -> None:
        self.paradigm, self.model_cfg, self.ps = cfg.paradigm, cfg.model, cfg.ps
        # the fitted auxiliary model goes down in the activations' codec (bf16 by default: half of fp32's bytes)
        self.aux_wire = CodecConfig(name=cfg.paradigm.act_codec, block_size=cfg.codec.block_size)
        self.session_site, self.global_tensors = session_site, global_tensors
        self.server = CutServer(cfg.model, cfg.paradigm, cfg.train.seed)
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(cfg.ps.max_concurrent_pushes)
        self.bytes_received = self.bytes_sent = 0
        self.last_loss = math.nan
        self._saved_version = 0
        self._saved_at: tuple[int, int] = (0, 0)  # (server steps, alignments) at the last snapshot
        self.snapshots = SplitSnapshots(local_state(cfg.ps))  # kept on this machine only
        loaded = self.snapshots.load()
        if loaded is not None:
            tensors, meta, path = loaded
            self.server.load_state(tensors, meta, str(path))
            self._saved_at = (self.server.steps, self.server.alignments)
            logger.info(
                "server part restored from %s: %d steps, %d sequences kept, %d alignments",
                path,
                self.server.steps,
                self.server.kept.sequences,
                self.server.alignments,
            )
        logger.info(
            "server part of %s on %s: blocks %d..%d, %.1fM parameters",
            self.paradigm.describe(),
            self.server.device,
            self.paradigm.cut,
            self.model_cfg.n_layers - 1,
            sum(p.numel() for p in self.server.part.parameters()) / 1e6,
        )

    # ---------------------------------------------------------------- RPCs
    def split(self, chunks: Iterable[m.Chunk]) -> Iterator[m.Chunk]:
        """One upload: train on it (fsl_sage: "train"; split: "gradient", the gradient at the cut comes back) or
        evaluate it ("eval"); the answer streams back with the loss."""
        it = iter(chunks)
        first = next(it, None)
        if first is None or first.split is None:
            raise ProtocolError("a split upload must start with a chunk carrying a split header")
        header = first.split
        self.session_site(header.session_id)
        shape = self._check(header)
        if not self._slots.acquire(timeout=self.ps.rpc_timeout.total_seconds()):
            raise UnavailableError("the parameter server is busy with other split uploads; retry later")
        try:
            _, payload = collect(itertools.chain([first], it), self._max_bytes(shape))
        finally:
            self._slots.release()
        acts, targets = self._decode(header, shape, bytes(payload))
        with self._lock:
            if header.kind == "eval":
                loss, grad = self.server.evaluate(acts, targets), None
            else:
                loss, grad = self.server.train(acts, targets, gradient=header.kind == "gradient")
                self.last_loss = loss
            steps, alignments = self.server.steps, self.server.alignments
            self.bytes_received += len(payload)
        out = codec.encode({"grad": grad}, CodecConfig(name=header.codec)) if grad is not None else b""
        reply = m.SplitHeader("", header.kind, self.paradigm.cut, list(shape), header.codec, len(out), digest(out))
        reply.version, reply.loss, reply.server_steps, reply.alignments = header.version, loss, steps, alignments
        with self._lock:
            self.bytes_sent += len(out)
        yield from to_chunks(reply, out, self.ps.chunk_bytes)

    def fetch_aux(self, request: m.AuxRequest) -> Iterator[m.Chunk]:
        """The auxiliary model fitted at an alignment version: fitted now when the server has not aligned for
        `request.version` yet (from the global model's auxiliary model, on the activations it keeps)."""
        self.session_site(request.session_id)
        if self.paradigm.name != "fsl_sage":
            raise MismatchError(f"paradigm {self.paradigm.name} has no auxiliary model to fetch (fsl_sage has)")
        self._check_cut(request.cut)
        with self._lock:
            if self.server.aligned_version < request.version and self.server.kept.items:
                version, tensors = self.global_tensors(self.server.aux_names())
                if request.version > version:
                    raise StaleError(f"version {request.version} is newer than the global model's ({version})")
                self.server.align(tensors, version)
                before, after = self.server.align_error
                logger.info(
                    "alignment %d at version %d: gradient estimate error %.4f -> %.4f on %d kept sequences",
                    self.server.alignments,
                    version,
                    before,
                    after,
                    self.server.kept.sequences,
                )
                self._save("align")
            fitted, version = dict(self.server.fitted), self.server.aligned_version
            steps, alignments = self.server.steps, self.server.alignments
        payload = codec.encode(fitted, self.aux_wire) if fitted else b""
        header = m.SplitHeader("", "aux", self.paradigm.cut, [], self.aux_wire.name, len(payload), digest(payload))
        header.version, header.server_steps, header.alignments = version, steps, alignments
        with self._lock:
            self.bytes_sent += len(payload)
        yield from to_chunks(header, payload, self.ps.chunk_bytes)

    # ---------------------------------------------------------------- checks
    def _check_cut(self, cut: int) -> None:
        if cut != self.paradigm.cut:
            raise MismatchError(
                f"a site with paradigm.cut={cut} reached a server part that starts after block {self.paradigm.cut} "
                f"(paradigm.cut={self.paradigm.cut}): give the site the PS's paradigm settings"
            )

    def _check(self, h: m.SplitHeader) -> tuple[int, int, int]:
        """Refuse what the header alone shows to be wrong, before any payload byte is read; the shape."""
        kinds = KINDS[self.paradigm.name]
        if h.kind not in kinds:
            raise ProtocolError(f"split upload kind {h.kind!r}: paradigm {self.paradigm.name} takes {', '.join(kinds)}")
        self._check_cut(h.cut)
        if h.codec not in ACT_CODECS:
            raise ProtocolError(f"activation codec {h.codec!r}: expected one of {', '.join(ACT_CODECS)}")
        d, context = self.model_cfg.d_model, self.model_cfg.context
        if len(h.shape) != 3 or min(h.shape) < 1:
            raise ProtocolError(f"activations of shape {list(h.shape)}: expected [batch, sequence, {d}]")
        b, t, width = (int(v) for v in h.shape)
        if width != d:
            raise ProtocolError(f"activations {width} wide: the server part takes {d} (model.d_model)")
        if t > context:
            raise ProtocolError(f"activations of {t} positions: the model takes at most {context} (model.context)")
        if b > self.paradigm.buffer_sequences:
            raise LimitError(
                f"an upload of {b} sequences is over the server's buffer of {self.paradigm.buffer_sequences} "
                "(paradigm.buffer_sequences): upload fewer at a time"
            )
        if not 0 < h.acts_bytes < h.total_bytes or h.total_bytes > self._max_bytes((b, t, width)):
            raise ProtocolError(
                f"split payload of {h.total_bytes} bytes ({h.acts_bytes} of activations) cannot hold {b}x{t}x{width} "
                f"activations and their targets (at most {self._max_bytes((b, t, width))} bytes)"
            )
        return b, t, width

    def _max_bytes(self, shape: tuple[int, int, int]) -> int:
        b, t, d = shape
        return min(self.ps.max_delta_bytes, 4 * (b * t * d + b * t) + 2 * SLACK_BYTES)

    def _decode(self, h: m.SplitHeader, shape: tuple[int, int, int], payload: bytes) -> tuple[np.ndarray, np.ndarray]:
        """Activations (finite float32) and targets (token ids, -1 ignored) of a verified payload."""
        acts_part, targets_part = payload[: h.acts_bytes], payload[h.acts_bytes :]
        try:
            sent = codec.codec_name(acts_part)
            if sent != h.codec:
                raise ProtocolError(f"header says codec {h.codec!r}, the activations are {sent!r}")
            acts = codec.decode(acts_part, expected={"acts": (shape, "float32")})["acts"]
            if codec.codec_name(targets_part) != "fp32":
                raise ProtocolError("the targets must be fp32-encoded token ids")
            targets = codec.decode(targets_part, expected={"targets": (shape[:2], "float32")})["targets"]
        except CodecError as exc:
            raise ProtocolError(f"split upload refused: {exc}") from None
        if not np.isfinite(acts).all():
            raise ProtocolError("split upload refused: the activations hold NaN or Inf")
        vocab = self.model_cfg.vocab_size
        if not (np.array_equal(targets, np.round(targets)) and targets.min() >= -1 and targets.max() < vocab):
            raise ProtocolError(f"split upload refused: targets must be token ids in 0..{vocab - 1} (or -1: ignored)")
        return acts, targets.astype(np.int64)

    # ---------------------------------------------------------------- lifecycle, views (ps/app.py)
    def _save(self, why: str) -> None:
        """Snapshot the server part (hold the lock)."""
        tensors, meta = self.server.state()
        if self.snapshots.save(tensors, meta, why) is not None:
            self._saved_at = (self.server.steps, self.server.alignments)

    def tick(self, version: int) -> None:
        """Called by the PS's ticker: a snapshot every ps.snapshot_every global versions, when anything changed."""
        if version - self._saved_version < self.ps.snapshot_every:
            return
        with self._lock:
            self._saved_version = version
            if (self.server.steps, self.server.alignments) != self._saved_at:
                self._save("version")

    def close(self) -> None:
        """The final snapshot, as the PS stops."""
        with self._lock:
            if (self.server.steps, self.server.alignments) != self._saved_at:
                self._save("stop")

    def metrics(self) -> dict[str, float | int]:
        with self._lock:
            return {
                "split/server_steps": self.server.steps,
                "split/alignments": self.server.alignments,
                "split/kept_sequences": self.server.kept.sequences,
                "split/server_loss": self.last_loss,
                "split/align_error": self.server.align_error[1],
                "split/bytes_received_total": self.bytes_received,
                "split/bytes_sent_total": self.bytes_sent,
            }

    def digest(self) -> str:
        """sha256 over the server part's parameters (tests compare it around bad input)."""
        with self._lock:
            return self.server.digest()
