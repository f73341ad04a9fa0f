"""Tokenizers through the `tokenizers` library: GPT-2's ids unchanged, Llama 3 ids in uint32 shards, clear errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from geofed_hpc.cli import compose_config, main
from geofed_hpc.config import DataConfig, ModelConfig, RunConfig
from geofed_hpc.data import load_tokens
from geofed_hpc.data.prepare import prepare_shards
from geofed_hpc.data.shards import open_site_shards, read_index
from geofed_hpc.data.tokenizer import load_tokenizer, run_tokenizer
from geofed_hpc.errors import ConfigError

# The shipped Bible (one document per book, end-of-text between books) as the hand-written GPT-2 BPE that
# `tokenizers` replaced encoded it: uint16 little-endian ids, their count and SHA-256.
BIBLE_TOKENS = 994006
BIBLE_SHA256 = "3c57d88444576c28b33c3786dcb6369cc3a7b1c0dd3d1474d4bf47d35061bb2f"
MULTILINGUAL = [
    "In the beginning God created the heaven and the earth.",
    "Привет мир, как дела? Здравствуйте, друзья.",
    "नमस्ते दुनिया, यह एक परीक्षण है।",
    "Ελληνικά γράμματα και λέξεις.",
]

pytestmark = pytest.mark.usefixtures("restore_logging")


def test_gpt2_gives_the_same_ids_as_before_on_the_shipped_text(tmp_path: Path) -> None:
    tokens = load_tokens(DataConfig(tokenizer="gpt2", source="bible", cache_dir=str(tmp_path)))
    assert tokens.dtype == np.uint16 and len(tokens) == BIBLE_TOKENS
    assert hashlib.sha256(tokens.astype("<u2").tobytes()).hexdigest() == BIBLE_SHA256


def test_llama3_shards_are_uint32_hold_ids_above_65535_and_record_the_tokenizer(
    tmp_path: Path, llama3_tokenizer: str
) -> None:
    corpus = tmp_path / "multi.jsonl"
    corpus.write_text("".join(json.dumps({"text": t * 20}) + "\n" for t in MULTILINGUAL * 5))
    tok = load_tokenizer(llama3_tokenizer)
    assert tok.eot_token == "<|end_of_text|>" and tok.eot_id == 128001 and tok.vocab_size > 128000
    index = prepare_shards(DataConfig(tokenizer=llama3_tokenizer, source=str(corpus)), tmp_path / "out", 2, tok)
    assert read_index(tmp_path / "out") == index
    assert index.dtype == "uint32" and index.max_id > 65535
    assert (
        index.tokenizer == llama3_tokenizer
        and index.tokenizer_sha256 == hashlib.sha256(Path(llama3_tokenizer).read_bytes()).hexdigest()
    )
    train, val = open_site_shards(tmp_path / "out", 0, 2, llama3_tokenizer, tok.vocab_size)
    everything = np.concatenate([open_site_shards(tmp_path / "out", i, 2, tok, tok.vocab_size)[0] for i in (0, 1)])
    assert train.dtype == np.dtype("<u4") and int(everything.max()) > 65535
    docs = [tok.encode(t * 20) for t in MULTILINGUAL * 5]
    expected = [i for n, d in enumerate(docs) for i in ([tok.eot_id] if n else []) + d]
    assert [*everything.tolist(), *val.tolist()] == expected
    with pytest.raises(ConfigError, match=f"data.tokenizer: is gpt2 .* but .* was tokenized with {llama3_tokenizer}"):
        open_site_shards(tmp_path / "out", 0, 2, "gpt2", tok.vocab_size)
    with pytest.raises(ConfigError, match="model.vocab_size: is 50257 but .*largest id"):
        open_site_shards(tmp_path / "out", 0, 2, llama3_tokenizer, 50257)


def test_models_name_their_tokenizer(tmp_path: Path, llama3_tokenizer: str) -> None:
    assert compose_config(["model=tiny"])[0].data.tokenizer == "gpt2"
    llama, _ = compose_config(["model=llama3_1b"])
    assert llama.data.tokenizer == ""
    with pytest.raises(ConfigError, match=r"data.tokenizer: model=llama3_1b \(128,256 ids\) .* give its tokenizer"):
        run_tokenizer(llama)
    given, _ = compose_config(["model=llama3_1b", f"data.tokenizer={llama3_tokenizer}"])
    assert given.data.tokenizer == llama3_tokenizer
    folder = tmp_path / "Llama-3.2-1B"  # model.init_from: the download's own tokenizer.json is the default
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    cfg = RunConfig(model=ModelConfig(name="l", arch="llama", tokenizer="", init_from=str(folder)))
    assert cfg.data.tokenizer == str(folder / "tokenizer.json")


def test_bad_tokenizers_are_one_line_naming_the_file(
    tmp_path: Path, llama3_tokenizer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text " * 100)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    run = f"run_dir={tmp_path / 'run'}"
    assert main(["data", "prepare", f"data.source={corpus}", f"data.tokenizer={broken}", run]) == 2
    assert main(["data", "prepare", f"data.source={corpus}", f"data.tokenizer={llama3_tokenizer}", run]) == 2
    assert main(["data", "prepare", f"data.source={corpus}", "model=llama3_1b", run]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3
    assert f"{broken} is not a tokenizer.json" in errors[0]
    assert f"{llama3_tokenizer} has 128,257 ids but model.vocab_size is 50,257" in errors[1]
    assert "model=llama3_1b" in errors[2] and "tokenizer.json" in errors[2]
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_paradigm_targets_default_to_the_model_family() -> None:
    from geofed_hpc.models import build_model
    from geofed_hpc.paradigms.site import site_paradigm

    gpt, _ = compose_config(["paradigm=lora", "model=tiny"])
    llama, _ = compose_config(["paradigm=lora", "model=tiny_llama"])
    assert gpt.paradigm.targets == ["attn.qkv", "attn.proj"]
    assert llama.paradigm.targets == ["attn.q", "attn.k", "attn.v", "attn.o"]
    model = build_model(llama.model, seed=0)
    site_paradigm(llama.paradigm, 0).prepare(model)
    adapted = {n.rsplit(".", 1)[0] for n, _ in model.named_parameters() if n.endswith("lora_a")}
    assert adapted == {f"blocks.{i}.attn.{x}" for i in range(2) for x in "qkvo"}
