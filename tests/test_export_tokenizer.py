"""`export hf` and `generate` use the tokenizer a run trained with; an export runs in `generate` and `transformers`."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from geofed_hpc.cli import main
from geofed_hpc.config import DataConfig, ModelConfig, RunConfig
from geofed_hpc.data.sources import bible_path
from geofed_hpc.data.tokenizer import load_tokenizer, run_tokenizer
from geofed_hpc.errors import ConfigError

pytestmark = pytest.mark.usefixtures("restore_logging")
PROMPT = "In the beginning God"


def small_tokenizer(file: Path, vocab: int = 1000) -> Path:
    """A byte-level BPE of `vocab` ids learned on the shipped Bible's start, ending documents with <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([bible_path().read_text(encoding="utf-8")[:400_000]], trainer)
    file.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(file))
    return file


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(run directory, tokenizer.json) of a run as the README makes one: `data prepare run_dir=run` with a
    1,000-id tokenizer, then `launch site=local` on those shards (relative paths, from the run's parent folder)."""
    home = tmp_path_factory.mktemp("trained")
    tok = small_tokenizer(home / "tok" / "tokenizer.json")
    common = ["model=tiny", "model.vocab_size=1024", f"data.tokenizer={tok}", "site.num_sites=1", "run_dir=run"]
    prepare = ["data", "prepare", "data.source=bible", "data.max_tokens=20000", *common]
    train = ["launch", "site=local", "data.source=run/data", "data.val_batches=1", "wandb_mode=disabled", *common]
    train += ["train.max_syncs=2", "train.max_local_steps=10", "train.lr=0.01", "train.sync_interval=10m"]
    for args in (prepare, train):
        done = subprocess.run(
            [sys.executable, "-m", "geofed_hpc.cli", *args],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=home,
            env={**os.environ, "WANDB_SILENT": "true"},
        )
        assert done.returncode == 0, done.stdout + done.stderr
    assert (home / "run" / "launch.json").is_file() and (home / "run" / "data" / "index.json").is_file()
    return home / "run", tok


def generated(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """(stdout, stderr) of a `generate` that succeeds."""
    capsys.readouterr()
    assert main(["generate", *args]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(args) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("geofed-hpc: error:")]
    assert len(errors) == 1
    return errors[0]


@pytest.mark.slow
def test_export_and_generate_find_the_runs_tokenizer_and_the_export_generates_alike(
    trained: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, tok = trained
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["export", "hf", str(run), str(out)]) == 0  # no data.tokenizer: the run's, not model=tiny's gpt2
    printed = capsys.readouterr().out
    assert f"tokenizer: {tok} (the run's, recorded in {run / 'data' / 'index.json'}, sha256 checked)" in printed
    assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 1024

    greedy = ["--prompt", PROMPT, "--max-new-tokens", "20"]
    from_run, log = generated([str(run), *greedy], capsys)
    assert f"tokenizer: {tok} (the run's" in log and from_run.startswith(PROMPT)
    from_export, log = generated([str(out), *greedy], capsys)
    assert f"tokenizer: {out / 'tokenizer.json'} (the folder's)" in log
    assert from_export == from_run  # the same greedy continuation
    sampled = [*greedy, "--temperature", "1.0", "--seed", "3"]
    assert generated([str(out), *sampled], capsys)[0] == generated([str(run), *sampled], capsys)[0]

    site = run / "sites" / "local-0" / "ckpt"  # a checkpoint inside the run finds the run's tokenizer too
    newest = sorted(site.glob("site-*.gft"))[-1]
    from_site, log = generated([str(newest), *greedy], capsys)
    assert f"tokenizer: {tok} (the run's" in log and from_site.startswith(PROMPT)
    assert main(["export", "hf", str(site), str(tmp_path / "site")]) == 0
    assert (tmp_path / "site" / "tokenizer.json").read_bytes() == tok.read_bytes()

    # a tokenizer given on the command line still wins (here the wrong one, refused against the model's vocabulary)
    message = refused(["generate", str(run), "--prompt", "x", "data.tokenizer=gpt2"], capsys)
    assert "gpt2 has 50,257 ids but the model has 1,024" in message


@pytest.mark.slow
def test_a_tokenizer_that_is_gone_or_changed_is_named_with_the_setting_to_give(
    trained: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, tok = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("submitit", "metrics", "launch.json"))
    index_file = copy / "data" / "index.json"
    index = json.loads(index_file.read_text())
    gone = tmp_path / "gone" / "tokenizer.json"
    index_file.write_text(json.dumps({**index, "tokenizer": str(gone)}))
    message = refused(["export", "hf", str(copy), str(tmp_path / "out")], capsys)
    assert f"the run was trained with {gone} (recorded in {index_file}), which is gone" in message
    assert "data.tokenizer=PATH" in message
    assert "gone" in refused(["generate", str(copy), "--prompt", "x"], capsys)

    changed = tmp_path / "changed" / "tokenizer.json"
    changed.parent.mkdir()
    changed.write_text(json.dumps(json.loads(tok.read_text()), indent=1))  # the same ids, other bytes
    index_file.write_text(json.dumps({**index, "tokenizer": str(changed)}))
    message = refused(["export", "hf", str(copy), str(tmp_path / "out")], capsys)
    assert f"{changed} has changed since the run was trained with it" in message
    assert f"{index_file} records {index['tokenizer_sha256'][:12]}" in message and "data.tokenizer=PATH" in message
    assert not (tmp_path / "out").exists()
    given = ["export", "hf", str(copy), str(tmp_path / "out"), f"data.tokenizer={changed}"]
    assert main(given) == 0  # given, it is used as it is


@pytest.mark.slow
def test_transformers_pipeline_generates_within_the_context_and_files_share_one_mode(
    trained: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import pipeline

    run, tok = trained
    out = tmp_path / "out"
    assert main(["export", "hf", str(run), str(out), f"data.tokenizer={tok}"]) == 0
    mask = os.umask(0o022)
    os.umask(mask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert set(modes) >= {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"}
    assert set(modes.values()) == {0o666 & ~mask}, modes  # safetensors' own 0600 is not kept

    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["max_length"] == 64  # model=tiny's context: the pipeline's 256 new tokens would run past it
    text = pipeline("text-generation", str(out))("In the")[0]["generated_text"]
    room = 64 - len(load_tokenizer(str(tok)).encode("In the"))
    ours, _ = generated([str(out), "--prompt", "In the", "--max-new-tokens", str(room)], capsys)
    assert text == ours.rstrip("\n").removesuffix("<|endoftext|>")  # greedy to the end of the context, as ours


def test_a_tokenizer_larger_than_the_model_names_the_vocab_size_that_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tok = small_tokenizer(tmp_path / "tok" / "tokenizer.json")
    fits = r"has 1,000 ids but model.vocab_size is 512; model.vocab_size=1000 would fit"
    with pytest.raises(ConfigError, match=fits):
        run_tokenizer(RunConfig(model=ModelConfig(vocab_size=512), data=DataConfig(tokenizer=str(tok))))
    prepare = ["data", "prepare", "data.source=bible", f"data.tokenizer={tok}", "model.vocab_size=512"]
    message = refused([*prepare, f"run_dir={tmp_path / 'run'}"], capsys)
    assert f"{tok} has 1,000 ids but model.vocab_size is 512; model.vocab_size=1000 would fit it" in message
    assert not (tmp_path / "run").exists()
