"""Text pieces to token arrays, in this process or on worker processes, in order and with bounded memory."""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer as Backend

if TYPE_CHECKING:  # worker processes import this module: keep them light (no pydantic, no config)
    from geofed_hpc.data.tokenizer import Tokenizer

BATCH_CHARS = 1 << 18  # characters of text per unit of work
IN_FLIGHT = 4  # units of work queued per worker (bounds memory, keeps every worker busy)
# (text, separate): `separate` puts the end-of-text id before the text (it starts a document, not the first).
Batch = list[tuple[str, bool]]
_worker: dict[str, Any] = {}


def batches(pieces: Iterable[tuple[str, bool]], skip: int = 0) -> Iterator[Batch]:
    """Pieces (text, starts a document) grouped into units of about BATCH_CHARS characters; the first document
    gets no separator. The first `skip` units are read but not yielded (a resumed run)."""
    batch: Batch = []
    size = count = 0
    for text, first in pieces:
        batch.append((text, first and (count > 0 or len(batch) > 0)))
        size += len(text)
        if size >= BATCH_CHARS:
            if count >= skip:
                yield batch
            batch, size, count = [], 0, count + 1
    if batch and count >= skip:
        yield batch


def encode(backend: Backend, batch: Batch, eot: int, dtype: np.dtype[Any]) -> np.ndarray:
    """The ids of one unit of work: each text's ids, with the end-of-text id before those that ask for it."""
    encoded = backend.encode_batch_fast([text for text, _ in batch], add_special_tokens=False)
    ids: list[int] = []
    for (_, separate), enc in zip(batch, encoded, strict=True):
        if separate:
            ids.append(eot)
        ids.extend(enc.ids)
    return np.array(ids, dtype=dtype)


def _start(tokenizer_json: str, eot: int, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    backend = Backend.from_str(tokenizer_json)
    backend.encode_special_tokens = True
    _worker.update(backend=backend, eot=eot, dtype=np.dtype(dtype))


def _work(batch: Batch) -> np.ndarray:
    return encode(_worker["backend"], batch, _worker["eot"], _worker["dtype"])


@contextmanager
def _one_core() -> Iterator[None]:
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def encoded(tok: Tokenizer, units: Iterable[Batch], workers: int = 1) -> Iterator[np.ndarray]:
    """The token array of each unit, in order: here (workers <= 1, one core), or on `workers` processes with at
    most IN_FLIGHT units per worker waiting, so memory does not grow with the corpus."""
    if workers <= 1:
        with _one_core():
            for unit in units:
                yield encode(tok.backend, unit, tok.eot_id, tok.dtype)
        return
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),  # a fresh interpreter: no torch, no inherited threads
        initializer=_start,
        initargs=(tok.to_json(), tok.eot_id, tok.dtype.str),
    )
    pending: deque[Future[np.ndarray]] = deque()
    try:
        for unit in units:
            pending.append(pool.submit(_work, unit))
            if len(pending) >= IN_FLIGHT * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def default_workers(requested: int) -> int:
    """data.workers, or (0) one per CPU this process may use."""
    if requested > 0:
        return requested
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)
