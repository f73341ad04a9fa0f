"""Token shard folders: the JSON index `data prepare` writes, and each site's shards, checked when opened."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from geofed_hpc.config import DataConfig
from geofed_hpc.data.corpus import default_cache_dir, load_tokens
from geofed_hpc.data.remote import SETTING, fetch_shards, is_remote_shard_dir
from geofed_hpc.data.sources import source_files
from geofed_hpc.data.tokenizer import GPT2, Tokenizer, check_vocab, load_tokenizer
from geofed_hpc.errors import ConfigError, StoreError
from geofed_hpc.log import logger

INDEX = "index.json"
FORMAT = "geofed-shards"
VERSION = 2  # version 1 (no tokenizer hash, GPT-2 only) still reads
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
    tokenizer_sha256: str = ""
    """SHA-256 of the tokenizer's files ("" in version-1 folders, which are GPT-2's)."""
    recipe: str = ""
    """A hash of what made the folder (source files, tokenizer, settings): a prepare that matches is not redone."""

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """uint16 when every id fits (vocab <= 65536), else uint32; always little-endian."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def is_shard_dir(source: str) -> bool:
    """True when data.source names a folder written by `data prepare`."""
    return (Path(source).expanduser() / INDEX).is_file()


def atomic_write(path: Path, chunks: Iterator[bytes]) -> None:
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


def write_index(out_dir: Path, index: ShardIndex) -> None:
    """Write the folder's index.json atomically (the folder counts as prepared once it is there)."""
    atomic_write(Path(out_dir) / INDEX, iter([json.dumps(index.to_json(), indent=1).encode()]))


def read_index(folder: Path) -> ShardIndex:
    """Parse and check index.json; errors name the file and the bad entry."""
    path = Path(folder).expanduser() / INDEX
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data.source: cannot read the shard index {path} ({exc}); run data prepare") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("version") not in (1, VERSION):
        raise ConfigError(f"data.source: {path} is not a version-{VERSION} {FORMAT} index; prepare the data again")
    try:
        files = [ShardFile(**s) for s in raw["train"]]
        val = ShardFile(**raw["val"])
        return ShardIndex(
            str(raw["tokenizer"]), int(raw["vocab_size"]), int(raw["eot_id"]), str(raw["dtype"]),
            int(raw["max_id"]), str(raw["source"]), files, val, str(raw.get("tokenizer_sha256", "")),
            str(raw.get("recipe", "")),
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


def check_tokenizer(index: ShardIndex, folder: Path, tok: Tokenizer) -> None:
    """Refuse shards another tokenizer made than the run's, naming both."""
    same = index.tokenizer_sha256 == tok.identity if index.tokenizer_sha256 else index.tokenizer == tok.name == GPT2
    if not same:
        theirs = f"{index.tokenizer} (sha256 {index.tokenizer_sha256[:12] or 'not recorded'})"
        raise ConfigError(
            f"data.tokenizer: is {tok.name} (sha256 {tok.identity[:12]}) but {folder} was tokenized with {theirs}; "
            f"train with data.tokenizer={index.tokenizer}, or prepare the data again with this run's tokenizer"
        )


def open_site_shards(
    folder: Path, site: int, sites: int, tokenizer: str | Tokenizer, vocab_size: int, verify: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) tokens of site `site` of `sites`: train shards site, site+sites, ...; checked against
    the tokenizer (data.tokenizer or a loaded one) and the model's vocabulary."""
    folder = Path(folder).expanduser()
    index = read_index(folder)
    check_tokenizer(index, folder, tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer))
    dtype = np.dtype(index.dtype).newbyteorder("<")
    if dtype not in (np.dtype("<u2"), np.dtype("<u4")) or dtype.itemsize < token_dtype(index.vocab_size).itemsize:
        raise ConfigError(
            f"data.source: {folder} stores {index.dtype} tokens, which cannot hold a vocabulary of "
            f"{index.vocab_size}; prepare the data again"
        )
    if index.vocab_size > vocab_size or index.max_id >= vocab_size:
        raise ConfigError(
            f"model.vocab_size: is {vocab_size} but {folder} was tokenized with a vocabulary of {index.vocab_size} "
            f"(largest id {index.max_id}); model.vocab_size={max(index.vocab_size, index.max_id + 1)} would fit it"
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
    slice of the cached corpus (validation: the shared tail). The tokenizer must fit the model's vocabulary."""
    from geofed_hpc.data.batches import site_shard, split_tokens

    tok = load_tokenizer(cfg.tokenizer)
    check_vocab(tok, vocab_size)
    cfg = local_source(cfg, Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir(), site, sites)
    if is_shard_dir(cfg.source):
        return open_site_shards(Path(cfg.source), site, sites, tok, vocab_size, verify=True)
    tokens = load_tokens(cfg, tok)
    train, val = split_tokens(tokens, cfg.val_fraction)
    return site_shard(train, site, sites), val


def local_source(cfg: DataConfig, cache: Path, site: int, sites: int) -> DataConfig:
    """`cfg` with an s3:// data.source made local for one site's training: a prepared shard folder's index and this
    site's shards fetched (`fetch_shards`), or a raw corpus's objects downloaded into `cache` (then tokenized and
    cached as any local corpus is)."""
    if not cfg.source.startswith("s3://"):
        return cfg
    if is_remote_shard_dir(cfg.source):
        return replace(cfg, source=str(fetch_shards(cfg.source, cache, site, sites)))
    files = source_files(cfg.source)
    digest = hashlib.sha256(json.dumps([f.identity() for f in files]).encode()).hexdigest()[:16]
    folder = cache / "corpus" / digest
    folder.mkdir(parents=True, exist_ok=True)
    for i, file in enumerate(files):
        assert file.remote is not None
        target = folder / f"{i:05d}-{file.path.name}"  # key order kept, names unique
        if not (target.is_file() and target.stat().st_size == file.size):
            try:
                file.remote.download(target)
            except StoreError as exc:
                raise ConfigError(f"{SETTING}: {exc}") from None
    logger.info("%d object(s) of %s downloaded into %s", len(files), cfg.source, folder)
    return replace(cfg, source=str(folder))
