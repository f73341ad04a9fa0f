"""Push ingest: a push's frames are decoded on a pool thread while its chunks still arrive, then verified and used."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from geofed_hpc import codec
from geofed_hpc.codec.stream import Scratch
from geofed_hpc.errors import CodecError, ProtocolError
from geofed_hpc.ps.aggregate import Delta
from geofed_hpc.ps.journal import sync_file
from geofed_hpc.ps.slots import FairSlots
from geofed_hpc.ps.staging import Staging
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.stream import drain

QUEUE_CHUNKS = 8  # chunks a stream may run ahead of its decoder (then gRPC flow control holds the site back)
_END, _ABORT = object(), object()

# What a decoded delta is handed to once its stream verified: (delta, payload bytes, staged file or None).
Admit = Callable[[Delta, int, Path | None], m.PushReply]


class Ingest:
    """Decodes pushes as they arrive. A push that finds one of the `threads` (ps.decode_threads) decoder slots
    free streams its chunks to a decoder on a pool of as many threads while the handler thread hashes them (and
    writes them to a staging file when the delta may be journaled); zstd and numpy release the GIL, so concurrent
    dense pushes decode on every core (not sparse ones: their many small numpy steps each take the GIL back), and a
    push's decoding overlaps its transfer. Nothing decoded is used before the stream's length and sha256 verified:
    a broken stream leaves the model untouched. A push that finds no free slot is staged whole and decoded later
    (ParameterServerLogic's staged path), and takes a slot then.

    Memory: no model-sized buffer. A dense delta is kept as its pieces' contents (codec.PackedTensor: the
    decompressed symbols and scales, about a quarter of its float32 size for int8), each piece decoded once here
    into the slot's piece buffer (a Scratch: one piece, reused) to check it and take its norm, and decoded again
    piece by piece when it is folded; a sparse delta as its kept indices and values. Plus QUEUE_CHUNKS chunks per
    stream being decoded.

    Lock: the free slots are a queue (`_free`, each with its Scratch); each stream's queue belongs to its push.
    """

    def __init__(self, threads: int, staging: Staging, contended: Callable[[], bool] = lambda: True) -> None:
        self.staging = staging
        self._free: queue.LifoQueue[Scratch] = queue.LifoQueue()
        for _ in range(threads):
            self._free.put(Scratch())
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ps-ingest")
        self._shares = FairSlots(threads, contended=contended)  # with several families, one never takes them all
        self._family: dict[int, str] = {}  # id(Scratch) -> the family streaming into it

    def take(self, family: str = "") -> Scratch | None:
        """A decoder slot (its Scratch) if one is free now for `family` (a site and its numbered jobs: while other
        families have sites too, it never streams into the last quarter of them, at least one, so that its pushes,
        stalled or not, leave the others a decoder), else None; hand it to `receive` or `give_back`."""
        if not self._shares.try_take(family):
            return None
        try:
            scratch = self._free.get_nowait()
        except queue.Empty:  # a staged push is decoding in it
            self._shares.give_back(family)
            return None
        self._family[id(scratch)] = family
        return scratch

    def give_back(self, scratch: Scratch) -> None:
        family = self._family.pop(id(scratch), None)
        self._free.put(scratch)
        if family is not None:
            self._shares.give_back(family)

    @contextmanager
    def held(self) -> Iterator[Scratch]:
        """Hold a decoder slot, waiting for one (the staged path, before it decodes into its buffers)."""
        scratch = self._free.get()
        try:
            yield scratch
        finally:
            self._free.put(scratch)

    def receive(
        self,
        scratch: Scratch,
        header: m.PushHeader,
        first: m.Chunk,
        rest: Iterable[m.Chunk],
        expected: dict[str, tuple[tuple[int, ...], str]],
        keep_file: bool,
        admit: Admit,
    ) -> m.PushReply:
        """Receive a push (with a slot from `take`, given back when done), decode it as it arrives and, once
        it verified, hand the delta to `admit` on the decoder thread. With `keep_file` the bytes also go to a
        staging file (for the journal), removed after."""
        chunks: queue.Queue[Any] = queue.Queue(QUEUE_CHUNKS)
        path = self.staging.new_path("push") if keep_file else None
        try:
            task = self._pool.submit(self._decode, header, chunks, expected, path, admit, scratch)
        except BaseException:
            self.give_back(scratch)
            raise
        try:
            with open(path, "xb") if path is not None else nullcontext(None) as f:

                def sink(data: bytes) -> None:
                    if f is not None:
                        f.write(data)
                    chunks.put(data)

                drain(header, first, rest, sink)
        except BaseException:
            chunks.put(_ABORT)
            _settle(task)  # the decoder stops: nothing more is read from this stream
            if path is not None:
                path.unlink(missing_ok=True)
            raise
        chunks.put(_END)  # the stream verified: the decoder may hand its delta over
        try:
            return task.result()
        finally:
            if path is not None:
                path.unlink(missing_ok=True)

    def _decode(
        self,
        header: m.PushHeader,
        chunks: queue.Queue[Any],
        expected: dict[str, tuple[tuple[int, ...], str]],
        path: Path | None,
        admit: Admit,
        scratch: Scratch,
    ) -> m.PushReply:
        """On a pool thread: decode the stream's chunks as they come (dense pieces checked in the slot's piece
        buffer, kept as their contents); once the stream verified (it ends with _END, never _ABORT) admit the
        delta."""
        try:
            feed = _Feed(chunks)
            try:
                name, delta = codec.decode_stream(feed, expected, sparse=True, scratch=scratch, packed=True)
            except BaseException as exc:
                feed.drain()  # whatever went wrong, the handler must never block on a full queue
                if feed.aborted:
                    raise _Aborted() from None
                if isinstance(exc, CodecError):
                    raise ProtocolError(f"delta refused: {exc}") from None
                raise
            if feed.aborted:
                raise _Aborted()
            if name != header.codec:
                raise ProtocolError(f"header says codec {header.codec!r}, payload is {name!r}")
            if path is not None:
                sync_file(path)  # on disk before the journal may take it
            return admit(delta, header.total_bytes, path)
        finally:
            self.give_back(scratch)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _Aborted(Exception):
    """The stream broke before it verified: its own error is what the site hears."""


def _settle(task: Future[m.PushReply]) -> None:
    try:
        task.result()
    except Exception:  # noqa: BLE001 - the stream's own error is raised by the caller
        pass


class _Feed:
    """The byte chunks a handler thread puts in a queue, as an iterable the stream decoder reads; it ends at _END,
    and at _ABORT (the stream broke) with `aborted` set."""

    def __init__(self, chunks: queue.Queue[Any]) -> None:
        self._chunks = chunks
        self.aborted = False
        self._done = False

    def __iter__(self) -> Iterator[bytes]:
        while not self._done:
            item = self._chunks.get()
            if item is _END or item is _ABORT:
                self._done, self.aborted = True, item is _ABORT
                return
            yield item

    def drain(self) -> None:
        """Discard what is left, so the handler thread is never blocked on a full queue."""
        for _ in self:
            pass
