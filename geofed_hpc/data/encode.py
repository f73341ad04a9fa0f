"""Text pieces to token arrays, on one thread or on several (the tokenizer releases the GIL), in order and with
bounded memory."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer as Backend

if TYPE_CHECKING:
    from geofed_hpc.data.tokenizer import Tokenizer

BATCH_CHARS = 1 << 18  # characters of text per unit of work
IN_FLIGHT = 4  # units of work queued per worker (bounds memory, keeps every worker busy)
# (text, separate): `separate` puts the end-of-text id before the text (it starts a document, not the first).
Batch = list[tuple[str, bool]]


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
    """The token array of each unit, in order: on this thread (workers <= 1), or on `workers` threads with at most
    IN_FLIGHT units per thread waiting, so memory does not grow with the corpus. Each call into the tokenizer uses one
    core and releases the GIL, so `workers` threads keep `workers` cores busy with one copy of the tokenizer
    (bench/data_prepare.py: two threads 1.8-1.9x as fast as one on 2 cores, where two worker processes reached 1.6x)."""
    with _one_core():
        if workers <= 1:
            for unit in units:
                yield encode(tok.backend, unit, tok.eot_id, tok.dtype)
            return
        pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")
        pending: deque[Future[np.ndarray]] = deque()
        try:
            for unit in units:
                pending.append(pool.submit(encode, tok.backend, unit, tok.eot_id, tok.dtype))
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
