"""`data prepare`: a corpus to memory-mapped token shards, tokenized on several threads, resumable, with progress."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from geofed_hpc.config import DataConfig
from geofed_hpc.data import encode, sources
from geofed_hpc.data.remote import publish_shards
from geofed_hpc.data.shards import INDEX, ShardFile, ShardIndex, atomic_write, is_shard_dir, read_index, write_index
from geofed_hpc.data.sources import Meter, SourceFile, pieces, source_files
from geofed_hpc.data.tokenizer import Tokenizer, load_tokenizer
from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger

STAGING = ".prepare"  # the token stream so far (tokens.bin) and how far it got (progress.json), inside the output
PROGRESS_SECONDS = 5.0  # between progress lines
COMMIT_SECONDS = 10.0  # between durable records of how far the stream got (what a resumed prepare starts from)
_COPY = 1 << 22  # tokens per copy step when splitting the stream into shards


@dataclass
class Progress:
    """progress.json: the units of work whose tokens are in tokens.bin, for the stream `key` describes."""

    key: str
    units: int = 0
    tokens: int = 0
    documents: int = 0
    max_id: int = 0
    done: bool = False


def stream_key(cfg: DataConfig, tok: Tokenizer, files: list[SourceFile]) -> str:
    """What the token stream depends on: the files (path, size, mtime; an object's URL, size, ETag), the tokenizer
    and how text is read."""
    parts = [f.identity() for f in files]
    settings = [tok.identity, cfg.text_field, cfg.max_tokens, sources.PIECE, sources.MAX_PIECE, encode.BATCH_CHARS]
    return hashlib.sha256(json.dumps([parts, settings]).encode()).hexdigest()


def _load_progress(path: Path, key: str) -> Progress | None:
    try:
        raw = json.loads(path.read_text())
        progress = Progress(**raw)
    except (OSError, ValueError, TypeError):
        return None
    return progress if progress.key == key else None


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def _stage(cfg: DataConfig, tok: Tokenizer, files: list[SourceFile], staging: Path, workers: int) -> Progress:
    """Tokenize the corpus into staging/tokens.bin, continuing where an interrupted run stopped."""
    key = stream_key(cfg, tok, files)
    state_path, tokens_path = staging / "progress.json", staging / "tokens.bin"
    state = _load_progress(state_path, key)
    if state is not None and state.done:
        return state
    staging.mkdir(parents=True, exist_ok=True)
    if state is None:
        state = Progress(key)
        tokens_path.write_bytes(b"")
    else:
        logger.info("data prepare: resuming after %d documents, %d tokens", state.documents, state.tokens)
    meter = Meter()
    itemsize, limit = tok.dtype.itemsize, cfg.max_tokens
    start = last_log = last_commit = time.monotonic()
    first, new_tokens = -1.0, 0

    def commit(done: bool = False) -> None:
        f.flush()
        os.fsync(f.fileno())
        state.done = done
        atomic_write(state_path, iter([json.dumps(asdict(state)).encode()]))

    units = encode.batches(pieces(files, cfg.text_field, meter), skip=state.units)
    with tokens_path.open("r+b") as f:
        f.truncate(state.tokens * itemsize)  # drop what was written after the last durable record
        f.seek(state.tokens * itemsize)
        try:
            for ids in encode.encoded(tok, units, workers):
                if limit:
                    ids = ids[: max(0, limit - state.tokens)]
                f.write(ids.tobytes())
                state.units, state.tokens = state.units + 1, state.tokens + len(ids)
                state.documents += int(np.count_nonzero(ids == tok.eot_id)) + (state.units == 1)
                state.max_id = max(state.max_id, int(ids.max()) if len(ids) else 0)
                new_tokens += len(ids)
                now = time.monotonic()
                first = meter.fraction() if first < 0 else first
                if now - last_log >= PROGRESS_SECONDS:
                    last_log, done = now, meter.fraction()
                    eta = (now - start) * (1 - done) / (done - first) if done > first else float("inf")
                    logger.info(
                        "data prepare: %d documents, %d tokens, %.0f tokens/s, %.0f%% read, ETA %s",
                        state.documents, state.tokens, new_tokens / (now - start), 100 * done,
                        _duration(eta) if eta != float("inf") else "?",
                    )  # fmt: skip
                if now - last_commit >= COMMIT_SECONDS:
                    last_commit = now
                    commit()
                if limit and state.tokens >= limit:
                    break
        except ConfigError:
            raise  # bad input: the caller removes the staging folder
        except BaseException:
            commit()  # interrupted: keep what is complete, so that the next run continues from it
            raise
        commit(done=True)
    seconds = time.monotonic() - start
    logger.info(
        "data prepare: %d documents, %d tokens in %s (%.0f tokens/s, %d workers)",
        state.documents, state.tokens, _duration(seconds), new_tokens / max(seconds, 1e-9), workers,
    )  # fmt: skip
    return state


def write_part(
    staged: np.ndarray | Path, lo: int, hi: int, path: Path, dtype: np.dtype[Any] | None = None
) -> ShardFile:
    """Write tokens [lo, hi) of `staged` (an array, or a raw token file of `dtype` read a chunk at a time, so memory
    stays flat) to `path` atomically; its index entry (name, count, SHA-256)."""
    digest = hashlib.sha256()

    def chunks() -> Iterator[bytes]:
        for at in range(lo, hi, _COPY):
            n = min(hi, at + _COPY) - at
            if isinstance(staged, Path):
                assert dtype is not None
                data = np.fromfile(staged, dtype=dtype, count=n, offset=at * dtype.itemsize).tobytes()
            else:
                data = staged[at : at + n].tobytes()
            digest.update(data)
            yield data

    atomic_write(path, chunks())
    return ShardFile(path.name, hi - lo, digest.hexdigest())


def prepare_shards(
    cfg: DataConfig, out_dir: Path, num_shards: int, tok: Tokenizer | None = None, workers: int = 0
) -> ShardIndex:
    """Tokenize cfg.source into `num_shards` disjoint train shards and one val shard (the tail) under out_dir, on
    `workers` threads (0: data.workers). An interrupted prepare continues; one that finished is not redone.
    cfg.source may be an s3:// object, prefix or glob (streamed); with data.shards_url the shards are uploaded there
    too, index.json last, for every site to fetch."""
    if num_shards < 1:
        raise ConfigError(f"site.num_sites: data prepare needs at least one shard, got {num_shards}")
    tok = tok or load_tokenizer(cfg.tokenizer)
    files = source_files(cfg.source)
    out_dir = Path(out_dir).expanduser()
    recipe = hashlib.sha256(f"{stream_key(cfg, tok, files)}|{num_shards}|{cfg.val_fraction}".encode()).hexdigest()
    if is_shard_dir(str(out_dir)):
        try:
            index = read_index(out_dir)
        except ConfigError:
            index = None
        if index is not None and index.recipe == recipe:
            logger.info("data prepare: %s already holds these shards; nothing to do", out_dir)
            if cfg.shards_url:
                publish_shards(out_dir, cfg.shards_url)
            return index
    created = out_dir  # the first folder this call creates (removed again when the input is bad)
    while not created.parent.exists():
        created = created.parent
    created_any = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / INDEX).unlink(missing_ok=True)  # a half-rewritten folder must not pass for a prepared one
    staging = out_dir / STAGING
    workers = encode.default_workers(workers or cfg.workers)
    try:
        state = _stage(cfg, tok, files, staging, workers)
        index = _split(cfg, tok, staging / "tokens.bin", state, out_dir, num_shards)
    except ConfigError:
        shutil.rmtree(staging, ignore_errors=True)
        if created_any and not any(p.is_file() for p in created.rglob("*")):
            shutil.rmtree(created, ignore_errors=True)
        raise
    index.recipe = recipe
    write_index(out_dir, index)
    shutil.rmtree(staging, ignore_errors=True)
    if cfg.shards_url:
        publish_shards(out_dir, cfg.shards_url)
    logger.info(
        "data prepare: %d tokens (%s) in %d train shards + val under %s", state.tokens, index.dtype, num_shards, out_dir
    )
    return index


def _split(
    cfg: DataConfig, tok: Tokenizer, stream: Path, state: Progress, out_dir: Path, num_shards: int
) -> ShardIndex:
    count = state.tokens
    if count == 0:
        raise ConfigError(f"data.source: {cfg.source} holds no text (zero tokens); nothing to prepare")
    n_val = max(1, round(count * cfg.val_fraction))
    if count - n_val < num_shards:
        raise ConfigError(
            f"data.source: {cfg.source} holds {count} tokens, too few for {num_shards} shards and a validation "
            "split; use more text, or fewer sites (site.num_sites)"
        )
    index = ShardIndex(
        tok.name, tok.vocab_size, tok.eot_id, tok.dtype.name, state.max_id, cfg.source, tokenizer_sha256=tok.identity
    )
    n_train = count - n_val
    for i in range(num_shards):
        lo, hi = i * n_train // num_shards, (i + 1) * n_train // num_shards
        index.train.append(write_part(stream, lo, hi, out_dir / f"train-{i:05d}.bin", tok.dtype))
    index.val = write_part(stream, n_train, count, out_dir / "val.bin", tok.dtype)
    return index
