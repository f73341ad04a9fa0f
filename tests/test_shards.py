"""`data prepare` token shards: disjoint per-site shards, exact tokens, and clear errors on bad shards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from geofed_hpc.config import DataConfig
from geofed_hpc.data import BatchSampler, load_tokens
from geofed_hpc.data.prepare import prepare_shards
from geofed_hpc.data.shards import INDEX, is_shard_dir, open_site_shards, read_index, site_tokens
from geofed_hpc.data.tokenizer import load_tokenizer
from geofed_hpc.errors import ConfigError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def corpus(tmp_path: Path, docs: int = 40) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS, size=60)) + f" doc {i}."}) for i in range(docs)]
    path.write_text("\n".join(lines) + "\n")
    return path


def prepared(tmp_path: Path, shards: int = 3) -> tuple[Path, DataConfig]:
    cfg = DataConfig(
        tokenizer="gpt2", source=str(corpus(tmp_path)), cache_dir=str(tmp_path / "cache"), val_fraction=0.1
    )
    out = tmp_path / "shards"
    prepare_shards(cfg, out, shards)
    return out, cfg


def test_shards_are_disjoint_and_hold_exactly_the_corpus_tokens(tmp_path: Path) -> None:
    out, cfg = prepared(tmp_path, shards=3)
    everything = load_tokens(cfg)  # the corpus path's tokenization: documents joined by end-of-text
    index = read_index(out)
    assert index.dtype == "uint16" and index.vocab_size == 50257 and index.tokenizer == "gpt2"
    assert sum(s.tokens for s in index.train) + index.val.tokens == len(everything)
    assert index.max_id == int(everything.max())
    parts = [open_site_shards(out, i, 3, "gpt2", 50257)[0] for i in range(3)]
    val = open_site_shards(out, 0, 3, "gpt2", 50257)[1]
    assert all(isinstance(p, np.memmap) for p in parts)
    np.testing.assert_array_equal(np.concatenate([*parts, val]), everything)
    assert len(val) == round(len(everything) * 0.1)
    assert is_shard_dir(str(out)) and not is_shard_dir(str(tmp_path))


def test_more_shards_than_sites_are_dealt_round_robin(tmp_path: Path) -> None:
    out, _ = prepared(tmp_path, shards=4)
    whole = [open_site_shards(out, i, 4, "gpt2", 50257)[0] for i in range(4)]
    site1, _ = open_site_shards(out, 1, 2, "gpt2", 50257)
    np.testing.assert_array_equal(site1, np.concatenate([whole[1], whole[3]]))
    with pytest.raises(ConfigError, match="site.num_sites: is 5 but .* 4 train shards"):
        open_site_shards(out, 0, 5, "gpt2", 50257)


def test_site_tokens_reads_a_shard_folder_and_samples_from_it(tmp_path: Path) -> None:
    out, cfg = prepared(tmp_path, shards=2)
    train, val = site_tokens(DataConfig(tokenizer="gpt2", source=str(out)), 50257, 1, 2)
    np.testing.assert_array_equal(train, open_site_shards(out, 1, 2, "gpt2", 50257)[0])
    x, y = BatchSampler(train, 2, 8, seed=0).next_batch()
    assert x.shape == (2, 8) and int(x.max()) < 50257
    plain_train, plain_val = site_tokens(cfg, 50257, 1, 2)  # a text source: slices of the cached corpus
    assert len(plain_train) > 0 and len(plain_val) > 0


def test_wrong_dtype_vocabulary_tokenizer_or_bytes_are_clear_errors(tmp_path: Path) -> None:
    out, _ = prepared(tmp_path, shards=2)
    with pytest.raises(ConfigError, match="model.vocab_size: is 1000 .* vocabulary of 50257"):
        open_site_shards(out, 0, 2, "gpt2", 1000)
    other = tmp_path / "other" / "tokenizer.json"  # the same vocabulary, another file: another tokenizer
    other.parent.mkdir()
    other.write_text(load_tokenizer("gpt2").to_json())
    with pytest.raises(ConfigError, match=f"data.tokenizer: is {other} .* was tokenized with gpt2"):
        open_site_shards(out, 0, 2, str(other), 50257)
    index = json.loads((out / INDEX).read_text())
    (out / INDEX).write_text(json.dumps({**index, "dtype": "uint32"}))
    with pytest.raises(ConfigError, match="wrong dtype"):
        open_site_shards(out, 0, 2, "gpt2", 50257)
    (out / INDEX).write_text(json.dumps({**index, "dtype": "uint16", "vocab_size": 128256, "max_id": 100}))
    with pytest.raises(ConfigError, match="uint16 tokens, which cannot hold a vocabulary of 128256"):
        open_site_shards(out, 0, 2, "gpt2", 200000)
    (out / INDEX).write_text(json.dumps(index))
    shard = out / "train-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="train-00001.bin fails its sha256"):
        open_site_shards(out, 1, 2, "gpt2", 50257)
    (out / INDEX).write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read the shard index"):
        open_site_shards(out, 1, 2, "gpt2", 50257)


def test_zero_tokens_bad_lines_and_unavailable_hub_are_clear_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="zero tokens"):
        prepare_shards(DataConfig(tokenizer="gpt2", source=str(empty)), tmp_path / "a", 2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "no"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: .*\"text\" field"):
        prepare_shards(DataConfig(tokenizer="gpt2", source=str(bad)), tmp_path / "b", 1)
    with pytest.raises(ConfigError, match="data.source: 'hf:roneneldan/TinyStories' is neither 'bible' nor"):
        DataConfig(source="hf:roneneldan/TinyStories")


def test_data_prepare_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from geofed_hpc.cli import main

    source = corpus(tmp_path, docs=10)
    args = ["data", "prepare", f"data.source={source}", f"run_dir={tmp_path / 'run'}", "site.num_sites=3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "run" / "data"
    assert f"train with: data.source={folder}" in out and "in 3 site shards" in out
    assert len(read_index(folder).train) == 3
    assert main(["data", "prepare", f"data.source={tmp_path / 'missing.jsonl'}"]) == 2


def test_a_site_config_with_first_shard_trains_that_shard(tmp_path: Path) -> None:
    from geofed_hpc.client.runtime import build_runtime
    from geofed_hpc.config import ModelConfig, RunConfig, SiteConfig, TrainConfig

    out, _ = prepared(tmp_path, shards=3)
    cfg = RunConfig(
        site=SiteConfig(num_sites=1, first_shard=2, shard_count=3),
        model=ModelConfig(n_layers=1, d_model=16, n_heads=2, d_ff=32, context=8),
        data=DataConfig(tokenizer="gpt2", source=str(out)),
        train=TrainConfig(batch_size=2),
    )
    runtime = build_runtime(cfg, 0)
    np.testing.assert_array_equal(runtime.sampler.tokens, open_site_shards(out, 2, 3, "gpt2", 50257)[0])
    with pytest.raises(ConfigError, match="site.shard_count: is 2, but sites 2..2 need at least 3 shards"):
        SiteConfig(num_sites=1, first_shard=2, shard_count=2)


def test_data_val_batch_size_keeps_the_validation_set_when_the_training_batch_changes(tmp_path: Path) -> None:
    from geofed_hpc.client.runtime import build_runtime
    from geofed_hpc.config import ModelConfig, RunConfig, SiteConfig, TrainConfig

    out, _ = prepared(tmp_path, shards=1)
    model = ModelConfig(n_layers=1, d_model=16, n_heads=2, d_ff=32, context=8)

    def val(batch: int, val_batch_size: int) -> list[torch.Tensor]:
        data = DataConfig(tokenizer="gpt2", source=str(out), val_batches=3, val_batch_size=val_batch_size)
        cfg = RunConfig(site=SiteConfig(num_sites=1), model=model, data=data, train=TrainConfig(batch_size=batch))
        return [x for x, _ in build_runtime(cfg, 0).group.val]

    small = val(2, 0)  # 0: batches of train.batch_size
    assert [x.shape[0] for x in small] == [2, 2, 2]
    assert [x.shape[0] for x in val(6, 0)] == [6, 6, 6]  # the old coupling: a larger batch reads more windows
    same = val(6, 2)
    assert len(same) == 3 and all(torch.equal(a, b) for a, b in zip(small, same, strict=True))
    with pytest.raises(ConfigError, match="data.val_batch_size"):
        DataConfig(val_batch_size=-1)
