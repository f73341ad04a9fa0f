"""`data prepare`: text to memory-mapped token shards with a JSON index; per-site shards checked on load."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from geofed_hpc.config import DataConfig
from geofed_hpc.data.batches import site_shard, split_tokens
from geofed_hpc.data.corpus import bible_documents, bible_path, get_tokenizer, jsonl_text, load_tokens
from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger

INDEX = "index.json"
FORMAT = "geofed-shards"
VERSION = 1
_COPY = 1 << 24  # tokens per copy step when splitting the staged stream into shards


@dataclass
class ShardFile:
    """One raw little-endian token file and what the index promises about it."""

    file: str
    tokens: int
    sha256: str


@dataclass
class ShardIndex:
    """index.json: how the shards were made and how to read them."""

    tokenizer: str
    vocab_size: int
    eot_id: int
    dtype: str
    max_id: int
    source: str
    train: list[ShardFile] = field(default_factory=list)
    val: ShardFile | None = None

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """uint16 when every id fits (vocab <= 65536), else uint32; always little-endian."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def is_shard_dir(source: str) -> bool:
    """True when data.source names a folder written by `data prepare`."""
    return (Path(source).expanduser() / INDEX).is_file()


def iter_documents(source: str) -> Iterator[str]:
    """Documents of a source: 'bible', a .txt (one document), a .jsonl ("text" per line), or hf:NAME[:SPLIT]."""
    if source.startswith("hf:"):
        yield from _hf_documents(source)
        return
    path = bible_path() if source == "bible" else Path(source).expanduser()
    if source != "bible" and (not path.is_file() or path.suffix.lower() not in (".txt", ".jsonl")):
        raise ConfigError(f"data.source: {path} is not a .txt or .jsonl file (nor 'bible' or hf:NAME)")
    if source == "bible":
        yield from bible_documents(path, path.read_text(encoding="utf-8"))
    elif path.suffix.lower() == ".txt":
        try:
            yield path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); convert it to UTF-8") from exc
    else:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    yield jsonl_text(path, number, line)


def _hf_documents(source: str) -> Iterator[str]:
    name, _, split = source[3:].partition(":")
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        raise ConfigError(
            f"data.source={source}: reading a Hugging Face dataset needs the `datasets` package and network access "
            "(pip install datasets); otherwise download it elsewhere and pass a .jsonl file"
        ) from None
    try:
        stream = datasets.load_dataset(name, split=split or "train", streaming=True)
        for record in stream:
            yield str(record["text"])
    except Exception as exc:  # network, auth, unknown dataset: all the user's to fix
        raise ConfigError(f"data.source={source}: cannot stream the dataset ({type(exc).__name__}: {exc})") from exc


def _stage(docs: Iterator[str], out: Path, tokenizer_name: str, max_tokens: int) -> tuple[int, int, np.dtype[Any]]:
    """Tokenize documents (end-of-text between them) into one raw file; return (tokens, max id, dtype)."""
    tok = get_tokenizer(tokenizer_name)
    dtype = token_dtype(tok.vocab_size)
    count, max_id, start, last = 0, 0, time.monotonic(), time.monotonic()
    with out.open("wb") as f:
        for number, doc in enumerate(docs):
            pieces = [[tok.eot_id]] if number else []
            pieces += [ids for _, ids in tok.encode_chunks(doc)]
            for ids in pieces:
                if max_tokens:
                    ids = ids[: max_tokens - count]
                if ids:
                    f.write(np.asarray(ids, dtype=dtype).tobytes())
                    count, max_id = count + len(ids), max(max_id, max(ids))
            if max_tokens and count >= max_tokens:
                break
            if time.monotonic() - last >= 5.0:
                last = time.monotonic()
                logger.info("data prepare: %d documents, %d tokens, %.0fs", number + 1, count, last - start)
    return count, max_id, dtype


def _atomic_write(path: Path, chunks: Iterator[bytes]) -> None:
    """Temp file next to `path`, fsync, rename: readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_part(staged: np.ndarray, lo: int, hi: int, path: Path) -> ShardFile:
    """Write tokens staged[lo:hi] to `path` atomically; its index entry (name, count, SHA-256)."""
    digest = hashlib.sha256()

    def chunks() -> Iterator[bytes]:
        for at in range(lo, hi, _COPY):
            data = staged[at : min(hi, at + _COPY)].tobytes()
            digest.update(data)
            yield data

    _atomic_write(path, chunks())
    return ShardFile(path.name, hi - lo, digest.hexdigest())


def prepare_shards(cfg: DataConfig, out_dir: Path, num_shards: int) -> ShardIndex:
    """Tokenize cfg.source into `num_shards` disjoint train shards and one val shard (the tail) under out_dir."""
    if num_shards < 1:
        raise ConfigError(f"site.num_sites: data prepare needs at least one shard, got {num_shards}")
    out_dir = Path(out_dir).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = get_tokenizer(cfg.tokenizer)
    staging = out_dir / ".staging.bin"
    (out_dir / INDEX).unlink(missing_ok=True)  # a half-rewritten folder must not pass for a prepared one
    try:
        count, max_id, dtype = _stage(iter_documents(cfg.source), staging, cfg.tokenizer, cfg.max_tokens)
        if count == 0:
            raise ConfigError(f"data.source: {cfg.source} holds no text (zero tokens); nothing to prepare")
        staged = np.memmap(staging, dtype=dtype, mode="r")
        n_val = max(1, round(count * cfg.val_fraction))
        if count - n_val < num_shards:
            raise ConfigError(f"data.source: {count} tokens are too few for {num_shards} shards and a validation split")
        index = ShardIndex(cfg.tokenizer, tok.vocab_size, tok.eot_id, dtype.name, int(max_id), cfg.source)
        n_train = count - n_val
        for i in range(num_shards):
            lo, hi = i * n_train // num_shards, (i + 1) * n_train // num_shards
            index.train.append(write_part(staged, lo, hi, out_dir / f"train-{i:05d}.bin"))
        index.val = write_part(staged, n_train, count, out_dir / "val.bin")
        del staged
    finally:
        staging.unlink(missing_ok=True)
    write_index(out_dir, index)
    logger.info(
        "data prepare: %d tokens (%s) in %d train shards + val under %s", count, dtype.name, num_shards, out_dir
    )
    return index


def write_index(out_dir: Path, index: ShardIndex) -> None:
    """Write the folder's index.json atomically (the folder counts as prepared once it is there)."""
    _atomic_write(Path(out_dir) / INDEX, iter([json.dumps(index.to_json(), indent=1).encode()]))


def read_index(folder: Path) -> ShardIndex:
    """Parse and check index.json; errors name the file and the bad entry."""
    path = Path(folder).expanduser() / INDEX
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data.source: cannot read the shard index {path} ({exc}); run data prepare") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("version") != VERSION:
        raise ConfigError(f"data.source: {path} is not a version-{VERSION} {FORMAT} index; prepare the data again")
    try:
        files = [ShardFile(**s) for s in raw["train"]]
        val = ShardFile(**raw["val"])
        return ShardIndex(
            str(raw["tokenizer"]), int(raw["vocab_size"]), int(raw["eot_id"]), str(raw["dtype"]),
            int(raw["max_id"]), str(raw["source"]), files, val,
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"data.source: {path} is malformed ({exc!r}); prepare the data again") from exc


def _open(folder: Path, info: ShardFile, dtype: np.dtype[Any], verify: bool) -> np.ndarray:
    path = folder / info.file
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ConfigError(f"data.source: shard {path} is missing ({exc}); prepare the data again") from exc
    if size != info.tokens * dtype.itemsize:
        raise ConfigError(
            f"data.source: shard {path} holds {size} bytes but the index promises {info.tokens} {dtype.name} tokens "
            f"({info.tokens * dtype.itemsize} bytes): wrong dtype or a damaged file; prepare the data again"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if verify:
        digest = hashlib.sha256()
        for at in range(0, len(tokens), _COPY):
            digest.update(tokens[at : at + _COPY].tobytes())
        if digest.hexdigest() != info.sha256:
            raise ConfigError(f"data.source: shard {path} fails its sha256 checksum; prepare the data again")
    return tokens


def open_site_shards(
    folder: Path, site: int, sites: int, tokenizer: str, vocab_size: int, verify: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) tokens of site `site` of `sites`: train shards site, site+sites, ...; checked against
    the tokenizer and the model's vocabulary."""
    folder = Path(folder).expanduser()
    index = read_index(folder)
    if index.tokenizer != tokenizer:
        raise ConfigError(f"data.tokenizer: is {tokenizer!r} but {folder} was tokenized with {index.tokenizer!r}")
    dtype = np.dtype(index.dtype).newbyteorder("<")
    if dtype not in (np.dtype("<u2"), np.dtype("<u4")) or dtype.itemsize < token_dtype(index.vocab_size).itemsize:
        raise ConfigError(
            f"data.source: {folder} stores {index.dtype} tokens, which cannot hold a vocabulary of "
            f"{index.vocab_size}; prepare the data again"
        )
    if index.vocab_size > vocab_size or index.max_id >= vocab_size:
        raise ConfigError(
            f"model.vocab_size: is {vocab_size} but {folder} was tokenized with a vocabulary of {index.vocab_size} "
            f"(largest id {index.max_id}); use a model whose vocabulary covers the data's tokenizer"
        )
    if len(index.train) < sites:
        raise ConfigError(
            f"site.num_sites: is {sites} but {folder} holds {len(index.train)} train shards; "
            f"run `geofed-hpc data prepare site.num_sites={sites}` again"
        )
    if len(index.train) % sites:
        logger.warning("%d shards over %d sites: sites get unequal amounts of data", len(index.train), sites)
    parts = [_open(folder, info, dtype, verify) for info in index.train[site::sites]]
    assert index.val is not None
    val = _open(folder, index.val, dtype, verify)
    train = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return train, val


def site_tokens(cfg: DataConfig, vocab_size: int, site: int, sites: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) for one site: its prepared shard when data.source is a shard folder, else a contiguous
    slice of the cached corpus (validation: the shared tail)."""
    if is_shard_dir(cfg.source):
        return open_site_shards(Path(cfg.source), site, sites, cfg.tokenizer, vocab_size, verify=True)
    tokens = load_tokens(cfg)
    train, val = split_tokens(tokens, cfg.val_fraction)
    return site_shard(train, site, sites), val
