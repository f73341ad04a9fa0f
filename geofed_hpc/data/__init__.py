"""Offline text data: GPT-2 tokenizer, cached corpus tokens, site shards and batch samplers."""

from geofed_hpc.data.batches import BatchSampler, eval_batches, site_shard, split_tokens
from geofed_hpc.data.corpus import bible_path, cache_path, get_tokenizer, load_tokens, read_documents
from geofed_hpc.data.tokenizer import GPT2Tokenizer

__all__ = [
    "BatchSampler",
    "GPT2Tokenizer",
    "bible_path",
    "cache_path",
    "eval_batches",
    "get_tokenizer",
    "load_tokens",
    "read_documents",
    "site_shard",
    "split_tokens",
]
