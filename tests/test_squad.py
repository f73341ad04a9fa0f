"""Question answering from a local SQuAD v1.1 file: parsing, answer-only batches, EM/F1, a federated run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from geofed_hpc.config import DataConfig, ParadigmConfig
from geofed_hpc.data.corpus import get_tokenizer
from geofed_hpc.data.squad import QASampler, exact_match, f1_score, normalize_answer, read_squad, score
from geofed_hpc.errors import ConfigError
from geofed_hpc.ps.app import ParameterServer
from tests.test_paradigms import run_config, run_sites, val_losses

NAMES = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi"]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Delhi", "Tokyo", "Quito"]


def write_squad(path: Path, n: int = 40) -> Path:
    paragraphs = []
    for i in range(n):
        who, where = NAMES[i % len(NAMES)], CITIES[(i * 3) % len(CITIES)]
        context = f"{who} was born in {where} and later moved away."
        qas = [{"id": f"q{i}", "question": f"Where was {who} born?", "answers": [{"text": where, "answer_start": 0}]}]
        paragraphs.append({"context": context, "qas": qas})
    path.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": paragraphs}]}))
    return path


def test_squad_normalisation_exact_match_and_f1_follow_the_official_rules(tmp_path: Path) -> None:
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert exact_match("the Paris.", "Paris") == 1.0 and exact_match("in Paris", "Paris") == 0.0
    assert f1_score("in Paris France", "Paris") == pytest.approx(0.5)
    assert f1_score("Rome", "Paris") == 0.0
    examples = read_squad(write_squad(tmp_path / "s.json", 2))
    assert score(["Paris", "nowhere"], examples) == {"val/exact_match": 50.0, "val/f1": 50.0}


def test_a_malformed_squad_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"data": [{"paragraphs": [{"context": "c"}]}]}))
    with pytest.raises(ConfigError, match=r"bad\.json is not SQuAD v1\.1 JSON.*qas"):
        read_squad(bad)


def test_qa_batches_put_the_loss_on_the_answer_only(tmp_path: Path) -> None:
    examples = read_squad(write_squad(tmp_path / "s.json", 4))
    x, y = QASampler(examples, 2, 32, seed=0).next_batch()
    tok = get_tokenizer("gpt2")
    for row in range(2):
        targets = [int(t) for t in y[row] if t >= 0]
        assert targets[-1] == tok.eot_id and tok.decode(targets[:-1]).strip() in CITIES
        assert x.shape == y.shape == (2, 32)


@pytest.mark.slow
def test_two_sites_fine_tune_on_squad_and_log_exact_match_and_f1(tmp_path: Path) -> None:
    source = write_squad(tmp_path / "squad.json")
    cfg = run_config(tmp_path, tmp_path, "lora")
    cfg = replace(cfg, data=DataConfig(source=str(source), val_fraction=0.1, val_batches=2))
    cfg.train.lr, cfg.paradigm = 3e-2, ParadigmConfig(name="lora", targets=["attn.qkv", "mlp.fc"], rank=4)
    ps = ParameterServer(cfg)
    try:
        run_sites(cfg, tmp_path, ps)
    finally:
        ps.stop()
    for site in ("local-0", "local-1"):
        losses = val_losses(tmp_path, site)
        assert losses[-1] < losses[0], losses
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics" / f"{site}.metrics.jsonl").open()]
        qa = [r for r in rows if "val/f1" in r]
        assert len(qa) == 4 and all(0 <= r["val/exact_match"] <= r["val/f1"] + 1e-9 <= 100 + 1e-9 for r in qa)
