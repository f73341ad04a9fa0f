"""Offline text data: tokenizers, corpus sources, `data prepare` token shards, batch samplers (imported lazily, so
that `data prepare` never loads torch)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from geofed_hpc.data.batches import BatchSampler, eval_batches, site_shard, split_tokens
    from geofed_hpc.data.corpus import cache_path, get_tokenizer, load_tokens, read_documents
    from geofed_hpc.data.sources import bible_path
    from geofed_hpc.data.tokenizer import Tokenizer, load_tokenizer

_HOME = {
    "BatchSampler": "batches",
    "eval_batches": "batches",
    "site_shard": "batches",
    "split_tokens": "batches",
    "cache_path": "corpus",
    "get_tokenizer": "corpus",
    "load_tokens": "corpus",
    "read_documents": "corpus",
    "bible_path": "sources",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
}
__all__ = [
    "BatchSampler",
    "Tokenizer",
    "bible_path",
    "cache_path",
    "eval_batches",
    "get_tokenizer",
    "load_tokenizer",
    "load_tokens",
    "read_documents",
    "site_shard",
    "split_tokens",
]


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"geofed_hpc.data.{_HOME[name]}"), name)
    raise AttributeError(f"module 'geofed_hpc.data' has no attribute {name!r}")
