"""Training text read straight from a source (the shipped Bible, or any corpus `data prepare` reads), tokenized once
and cached."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from geofed_hpc.config import DataConfig
from geofed_hpc.data.encode import batches, encoded
from geofed_hpc.data.sources import bible_documents, bible_path, jsonl_record, pieces, source_files
from geofed_hpc.data.tokenizer import Tokenizer, load_tokenizer
from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger

# Bump when the way text is assembled from a source changes, so that old caches are not reused.
_ASSEMBLY_VERSION = 2

__all__ = ["bible_path", "cache_path", "get_tokenizer", "load_tokens", "read_documents", "tokenize_source"]


def get_tokenizer(name: str = "gpt2") -> Tokenizer:
    """The (process-wide, memoized) tokenizer that data.tokenizer names."""
    return load_tokenizer(name)


def read_documents(path: Path, raw: bytes, bible: bool = False) -> list[str]:
    """Documents of a source file's bytes: the whole .txt, one per .jsonl line, one per bible book."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); convert it to UTF-8") from exc
    if bible:
        return bible_documents(path, text)
    if path.name.lower().endswith(".jsonl"):
        lines = enumerate(text.splitlines(), start=1)
        return [jsonl_record(path, n, line, "text")["text"] for n, line in lines if line.strip()]
    return [text]


def tokenize_source(cfg: DataConfig, tok: Tokenizer, max_tokens: int = 0) -> np.ndarray:
    """Token ids of every document of cfg.source (end-of-text between documents), in this process; stops once
    `max_tokens` (> 0) are there."""
    chunks: list[np.ndarray] = []
    count, start = 0, time.monotonic()
    for ids in encoded(tok, batches(pieces(source_files(cfg.source), cfg.text_field))):
        chunks.append(ids)
        count += len(ids)
        if max_tokens and count >= max_tokens:
            break
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=tok.dtype)
    logger.info("tokenized %s: %d tokens in %.1fs", cfg.source, len(tokens), time.monotonic() - start)
    return tokens[:max_tokens] if max_tokens else tokens


def default_cache_dir() -> Path:
    """$GEOFED_CACHE, else ~/.cache/geofed_hpc."""
    return Path(os.environ.get("GEOFED_CACHE") or Path.home() / ".cache" / "geofed_hpc")


def cache_path(cfg: DataConfig, tok: Tokenizer | None = None) -> Path:
    """Where the full token array of cfg.source is cached: keyed by the bytes of its files and the tokenizer."""
    tok = tok or load_tokenizer(cfg.tokenizer)
    files = source_files(cfg.source)
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.path.name}|".encode())
        with file.path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    digest.update(f"|{tok.identity}|{cfg.text_field}|{cfg.source == 'bible'}|v{_ASSEMBLY_VERSION}".encode())
    folder = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    stem = files[0].path.name.split(".")[0] if len(files) == 1 else Path(cfg.source).name.split(".")[0] or "corpus"
    label = tok.name if tok.name == "gpt2" else Path(tok.name).parent.name or "tokenizer"
    return folder / f"{stem}.{label}.{digest.hexdigest()[:20]}.npy"


def _read_cache(path: Path, dtype: np.dtype[Any]) -> np.ndarray | None:
    try:
        tokens = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable token cache %s (%s); tokenizing again", path, exc)
        return None
    if tokens.dtype != dtype or tokens.ndim != 1:
        logger.warning(
            "ignoring token cache %s (dtype %s, shape %s); tokenizing again", path, tokens.dtype, tokens.shape
        )
        return None
    return tokens


def _write_cache(path: Path, tokens: np.ndarray) -> None:
    """Write atomically (temporary file + rename), so concurrent readers never see half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        logger.warning("cannot write the token cache in %s (%s); set data.cache_dir", path.parent, exc)
        return
    try:
        os.fchmod(fd, 0o644)  # readable by other users of a shared cache, like a normal file
        with os.fdopen(fd, "wb") as f:
            np.save(f, tokens)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        logger.info("cached %d tokens in %s", len(tokens), path)
    except OSError as exc:
        logger.warning("cannot write the token cache %s (%s); set data.cache_dir", path, exc)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_tokens(cfg: DataConfig, tok: Tokenizer | None = None) -> np.ndarray:
    """1-D token array (uint16, or uint32 for vocabularies above 65,536) of cfg.source, read from the cache or
    tokenized (and then cached)."""
    tok = tok or load_tokenizer(cfg.tokenizer)
    cached = cache_path(cfg, tok)
    tokens = _read_cache(cached, tok.dtype)
    if tokens is not None:
        logger.info("loaded %d tokens of %s from %s", len(tokens), cfg.source, cached)
    elif cfg.max_tokens:
        # Only a prefix is needed: tokenize just that much and leave the full-corpus cache alone.
        tokens = tokenize_source(cfg, tok, cfg.max_tokens)
    else:
        tokens = tokenize_source(cfg, tok)
        _write_cache(cached, tokens)
    if cfg.max_tokens:
        tokens = tokens[: cfg.max_tokens]
    if len(tokens) == 0:
        raise ConfigError(f"data.source: {cfg.source} holds no text to train on")
    return tokens
