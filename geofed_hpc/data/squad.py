"""Question answering in SQuAD v1.1 JSON: prompts, answer-only loss batches, greedy answers, exact match and F1."""

from __future__ import annotations

import collections
import json
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from geofed_hpc.config import DataConfig
from geofed_hpc.data.corpus import get_tokenizer
from geofed_hpc.errors import ConfigError

MAX_ANSWER_TOKENS = 16


@dataclass(frozen=True)
class QAExample:
    id: str
    context: str
    question: str
    answers: tuple[str, ...]

    def prompt(self) -> str:
        return f"Context: {self.context}\nQuestion: {self.question}\nAnswer:"


def is_squad(source: str) -> bool:
    """data.source names a SQuAD-format .json file."""
    return source.lower().endswith(".json") and Path(source).expanduser().is_file()


def read_squad(path: Path) -> list[QAExample]:
    """Every question of a SQuAD v1.1 file ({"data": [{"paragraphs": [{"context", "qas": [...]}]}]})."""
    try:
        raw: Any = json.loads(Path(path).read_text(encoding="utf-8"))
        out = []
        for article in raw["data"]:
            for para in article["paragraphs"]:
                for qa in para["qas"]:
                    answers = tuple(str(a["text"]) for a in qa["answers"])
                    if not answers:
                        raise KeyError(f"question {qa.get('id', '?')!r} has no answers")
                    out.append(QAExample(str(qa["id"]), str(para["context"]), str(qa["question"]), answers))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"data.source: {path} is not SQuAD v1.1 JSON (data[].paragraphs[].context, "
            f"qas[].id/question/answers[].text): {type(exc).__name__}: {exc}"
        ) from None
    if len(out) < 2:
        raise ConfigError(
            f"data.source: {path} holds {len(out)} questions; at least 2 are needed (train and validation)"
        )
    return out


def split_examples(cfg: DataConfig, site: int, sites: int) -> tuple[list[QAExample], list[QAExample]]:
    """(this site's train questions, the shared validation questions: the last data.val_fraction, at least 1)."""
    if cfg.tokenizer not in ("", "gpt2"):
        raise ConfigError(f"data.tokenizer: SQuAD-format data is tokenized with gpt2 only; got {cfg.tokenizer}")
    examples = read_squad(Path(cfg.source).expanduser())
    n_val = max(1, round(len(examples) * cfg.val_fraction))
    train, val = examples[:-n_val], examples[-n_val:]
    if len(train) < sites:
        raise ConfigError(f"data.source: {len(train)} training questions cannot be split over {sites} sites")
    n = len(train)
    return train[site * n // sites : (site + 1) * n // sites], val


def encode_example(ex: QAExample, context: int, eot: int) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids + end of text), the prompt cut from the left so that both fit context + 1."""
    tok = get_tokenizer("gpt2")
    answer = tok.encode(" " + ex.answers[0])[:MAX_ANSWER_TOKENS] + [eot]
    prompt = tok.encode(ex.prompt())
    keep = max(1, context + 1 - len(answer))
    return prompt[-keep:], answer[:context]


def qa_batch(pairs: list[tuple[list[int], list[int]]], context: int, eot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, context] (padded with end of text), y with -1 everywhere but the answer tokens."""
    x = torch.full((len(pairs), context), eot, dtype=torch.int64)
    y = torch.full((len(pairs), context), -1, dtype=torch.int64)
    for row, (prompt, answer) in enumerate(pairs):
        seq = (prompt + answer)[: context + 1]
        n = len(seq) - 1
        x[row, :n] = torch.tensor(seq[:-1])
        target = torch.tensor(seq[1:])
        target[: len(prompt) - 1] = -1  # the loss counts the answer only
        y[row, :n] = target
    return x, y


class QASampler:
    """Random training questions; batch k depends only on (seed, k), so resuming is exact (as BatchSampler)."""

    def __init__(self, examples: list[QAExample], batch_size: int, context: int, seed: int) -> None:
        self.eot = get_tokenizer("gpt2").eot_id
        self.pairs = [encode_example(ex, context, self.eot) for ex in examples]
        self.batch_size, self.context, self.seed, self.draws = batch_size, context, int(seed), 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.draws, self.seed & 0xFFFFFFFFFFFFFFFF])
        self.draws += 1
        rows = rng.integers(0, len(self.pairs), size=self.batch_size)
        return qa_batch([self.pairs[i] for i in rows], self.context, self.eot)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "draws": self.draws}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.draws = int(state["seed"]), int(state["draws"])


def qa_eval_batches(
    examples: list[QAExample], batch_size: int, context: int, n: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Up to `n` batches of the validation questions, answer-only loss."""
    eot = get_tokenizer("gpt2").eot_id
    pairs = [encode_example(ex, context, eot) for ex in examples[: n * batch_size]]
    return [qa_batch(pairs[i : i + batch_size], context, eot) for i in range(0, len(pairs), batch_size)]


# ---------------------------------------------------------------- the official SQuAD v1.1 evaluation rules
def normalize_answer(s: str) -> str:
    """Lower case, drop punctuation and the articles a/an/the, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def f1_score(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = collections.Counter(pred) & collections.Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def score(predictions: list[str], examples: list[QAExample]) -> dict[str, float]:
    """val/exact_match and val/f1 in percent: each prediction's best over its example's answers."""
    em = [max(exact_match(p, a) for a in ex.answers) for p, ex in zip(predictions, examples, strict=True)]
    f1 = [max(f1_score(p, a) for a in ex.answers) for p, ex in zip(predictions, examples, strict=True)]
    return {"val/exact_match": 100 * sum(em) / len(em), "val/f1": 100 * sum(f1) / len(f1)}


@torch.no_grad()
def greedy_answers(model: torch.nn.Module, examples: list[QAExample], context: int, device: torch.device) -> list[str]:
    """Each question's greedy continuation of its prompt, up to end of text or MAX_ANSWER_TOKENS (every rank of
    a sharded model runs the same forwards)."""
    tok = get_tokenizer("gpt2")
    was = model.training
    model.eval()
    out = []
    try:
        for ex in examples:
            ids = tok.encode(ex.prompt())[-(context - 1) :]
            answer: list[int] = []
            for _ in range(MAX_ANSWER_TOKENS):
                x = torch.tensor([(ids + answer)[-context:]], device=device)
                logits, _ = model(x)
                nxt = int(logits[0, -1].argmax())
                if nxt == tok.eot_id:
                    break
                answer.append(nxt)
            out.append(tok.decode(answer).strip())
    finally:
        model.train(was)
    return out
