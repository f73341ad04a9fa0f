"""`data prepare` sources (parquet, JSONL zstd/gzip, save_to_disk, folders, globs), workers, resuming, progress."""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard

from geofed_hpc.cli import main
from geofed_hpc.config import DataConfig
from geofed_hpc.data import encode, prepare
from geofed_hpc.data.prepare import prepare_shards
from geofed_hpc.data.shards import open_site_shards
from geofed_hpc.data.sources import cut, pieces, source_files
from geofed_hpc.data.tokenizer import load_tokenizer
from geofed_hpc.errors import ConfigError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu naïve café 42 don't".split()

pytestmark = pytest.mark.usefixtures("restore_logging")


def documents(n: int = 30, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 200)))) + f". Doc {i}!" for i in range(n)]


def ids_of(folder: Path, shards: int) -> list[int]:
    parts = [open_site_shards(folder, i, shards, "gpt2", 50257) for i in range(shards)]
    return [*np.concatenate([p[0] for p in parts]).tolist(), *parts[0][1].tolist()]


def expected_ids(docs: list[str]) -> list[int]:
    tok = load_tokenizer("gpt2")
    return [i for n, d in enumerate(docs) for i in ([tok.eot_id] if n else []) + tok.encode(d)]


def prepared(source: Path | str, out: Path, shards: int = 2, **data: Any) -> list[int]:
    prepare_shards(DataConfig(tokenizer="gpt2", source=str(source), val_fraction=0.1, **data), out, shards)
    return ids_of(out, shards)


def test_parquet_jsonl_zst_gz_and_save_to_disk_give_the_documents_tokens(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = documents()
    lines = "".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(docs))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    pq.write_table(pa.table({"id": list(range(len(docs))), "body": docs}), tmp_path / "c.parquet", row_group_size=7)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "saved"))
    split = datasets.Dataset.from_dict({"text": docs[:5]})
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs}), "test": split}).save_to_disk(
        str(tmp_path / "saved_dict")
    )
    want = expected_ids(docs)
    assert prepared(tmp_path / "c.jsonl.zst", tmp_path / "zst") == want
    assert prepared(tmp_path / "c.jsonl.gz", tmp_path / "gz") == want
    assert prepared(tmp_path / "c.parquet", tmp_path / "pq", text_field="body") == want
    assert prepared(tmp_path / "saved", tmp_path / "sd") == want
    assert prepared(tmp_path / "saved_dict", tmp_path / "sdd") == want  # a DatasetDict: its train split


def test_folders_and_globs_read_every_text_file_in_name_order(tmp_path: Path) -> None:
    docs = documents(6)
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text(docs[0])
    (corpus / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[1:4]))
    (corpus / "sub" / "c.txt").write_text(docs[4])
    (corpus / "notes.md").write_text("not read")
    (corpus / "z.jsonl.gz").write_bytes(gzip.compress((json.dumps({"text": docs[5]}) + "\n").encode()))
    assert [f.path.name for f in source_files(str(corpus))] == ["a.txt", "b.jsonl", "c.txt", "z.jsonl.gz"]
    assert prepared(corpus, tmp_path / "dir", shards=1) == expected_ids(docs)  # sub/c.txt sorts before z.jsonl.gz
    assert prepared(f"{corpus}/*.jsonl*", tmp_path / "glob", shards=1) == expected_ids(docs[1:4] + docs[5:])


def test_long_lines_are_cut_where_the_tokenizer_cuts(tmp_path: Path, llama3_tokenizer: str) -> None:
    text = " ".join(documents(200, seed=1)) + "\n" + "x" * 3_000_000 + " tail"  # one very long line
    runs = [text[i : i + 100_003] for i in range(0, len(text), 100_003)]
    cut_pieces = list(cut(runs))
    assert "".join(cut_pieces) == text and max(map(len, cut_pieces)) <= (1 << 20)
    head = text[: text.index("\n")]
    head_pieces = list(cut([head[i : i + 7919] for i in range(0, len(head), 7919)]))
    assert len(head_pieces) > 10
    for spec in ("gpt2", llama3_tokenizer):
        tok = load_tokenizer(spec)
        assert [i for p in head_pieces for i in tok.encode(p)] == tok.encode(head)
    long_file = tmp_path / "long.txt"
    long_file.write_text(text)
    assert "".join(p for p, _ in pieces(source_files(str(long_file)))) == text


ENCODED = encode.encoded


def interrupted(after: int) -> Any:
    """encode.encoded, stopped by a KeyboardInterrupt before its unit number `after` (-1: never)."""

    def encoded(*args: Any, **kwargs: Any) -> Iterator[np.ndarray]:
        for n, ids in enumerate(ENCODED(*args, **kwargs)):
            if n == after:
                raise KeyboardInterrupt
            yield ids

    return encoded


def test_an_interrupted_prepare_continues_and_a_finished_one_is_not_redone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(encode, "BATCH_CHARS", 2000)
    monkeypatch.setattr(prepare, "PROGRESS_SECONDS", 0.0)
    source = tmp_path / "c.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(60)))
    clean = prepared(source, tmp_path / "clean")
    monkeypatch.setattr(encode, "encoded", interrupted(after=5))
    with pytest.raises(KeyboardInterrupt):
        prepared(source, tmp_path / "out")
    assert not (tmp_path / "out" / "index.json").exists()
    units: list[int] = []
    real = interrupted(after=-1)

    def counting(tok: Any, work: Any, workers: int) -> Iterator[np.ndarray]:
        for ids in real(tok, work, workers):
            units.append(len(ids))
            yield ids

    monkeypatch.setattr(encode, "encoded", counting)
    with caplog.at_level(logging.INFO, logger="geofed_hpc"):
        assert prepared(source, tmp_path / "out") == clean
    assert units and len(units) < 15  # the five units done before the interruption were not encoded again
    assert "resuming after" in caplog.text and "tokens/s" in caplog.text and "ETA" in caplog.text
    assert not (tmp_path / "out" / ".prepare").exists()
    monkeypatch.setattr(encode, "encoded", interrupted(after=0))  # would stop at once: nothing may be encoded
    assert prepared(source, tmp_path / "out") == clean
    source.write_text(source.read_text() + json.dumps({"text": "one more"}) + "\n")
    monkeypatch.setattr(encode, "encoded", interrupted(after=-1))
    assert prepared(source, tmp_path / "out") == expected_ids([*documents(60), "one more"])  # a changed corpus


def test_worker_threads_give_the_same_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encode, "BATCH_CHARS", 3000)
    source = tmp_path / "c.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(40)))
    one = prepared(source, tmp_path / "one", workers=1)
    assert prepared(source, tmp_path / "two", workers=2) == one == expected_ids(documents(40))


def test_bad_corpora_are_one_line_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["some text"]}), tmp_path / "no_text.parquet")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "small.txt").write_text("two words")
    (tmp_path / "bad.jsonl.zst").write_bytes(b"not zstd at all")
    for name in ("no_text.parquet", "empty.jsonl", "small.txt", "bad.jsonl.zst"):
        run = tmp_path / f"run-{name}"
        assert main(["data", "prepare", f"data.source={tmp_path / name}", f"run_dir={run}", "site.num_sites=4"]) == 2
        assert not run.exists()  # nothing half-written
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("geofed-hpc: error:")]
    assert len(errors) == 4
    assert "no_text.parquet: has no column 'text' (its columns: body); set data.text_field" in errors[0]
    assert "empty.jsonl holds no text (zero tokens)" in errors[1]
    assert "small.txt holds 2 tokens, too few for 4 shards" in errors[2]
    assert "bad.jsonl.zst: cannot be read" in errors[3]
    with pytest.raises(ConfigError, match="holds no text files"):
        source_files(str(tmp_path / "*.csv"))
