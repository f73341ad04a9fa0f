"""Model presets carry run settings, `launch --dry-run` says what the run will do and hold, a Slurm site refuses the
demo corpus without --demo, and the preflight weighs the checkpoints against the disk."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from geofed_hpc.cli import compose_config, main
from geofed_hpc.commands import footprint as fp_mod
from geofed_hpc.commands.options import OPTIONS
from geofed_hpc.config.run import Footprint, footprint, run_plan

CLI = [sys.executable, "-m", "geofed_hpc.cli"]
LOGIN_ENV = {"HOME": "/home/alice", "USER": "alice", "SCRATCH": "/scratch/alice"}


@pytest.fixture(autouse=True)
def _options() -> Any:
    saved = dict(vars(OPTIONS))
    yield
    vars(OPTIONS).update(saved)


def test_presets_set_run_settings_that_command_line_overrides_beat() -> None:
    big, _ = compose_config(["model=llama3_1b"])
    assert big.train.sync_interval == timedelta(minutes=30) and big.train.max_syncs == 48
    assert big.train.lr == 3e-4 and big.train.warmup_steps == 200 and big.train.keep_best == 3
    given, _ = compose_config(["model=llama3_1b", "train.sync_interval=5m", "train.max_syncs=3", "train.lr=0.01"])
    assert given.train.sync_interval == timedelta(minutes=5) and given.train.max_syncs == 3 and given.train.lr == 0.01
    assert given.train.warmup_steps == 200  # what the command line leaves alone stays the preset's
    demo, _ = compose_config(["site=local", "model=tiny"])  # `make demo`: the demo's cadence, as before
    assert demo.train.sync_interval == timedelta(seconds=20) and demo.train.max_syncs == 6 and demo.train.lr == 3e-3
    assert compose_config(["model=gpt2_medium"])[0].train.sync_interval == timedelta(minutes=15)
    assert compose_config(["model=llama3_8b", "model.train.max_syncs=10"])[0].train.max_syncs == 10


def test_parameter_counts_without_torch_match_the_built_models() -> None:
    from geofed_hpc.models.registry import build_meta, num_params

    for option in ("tiny", "tiny_llama", "gpt2_medium", "llama3_1b", "llama3_8b"):
        model = compose_config([f"model={option}"])[0].model
        assert model.param_count() == num_params(build_meta(model)), option
    assert compose_config(["model=llama3_1b"])[0].model.param_count() == 1_235_814_400


def test_footprint_and_plan_of_a_1b_model_on_osc() -> None:
    cfg, _ = compose_config(["site=osc", "model=llama3_1b"])
    fp = footprint(cfg)
    assert fp.full == 1_235_814_400 * 16 and fp.weights == 1_235_814_400 * 4
    assert fp.per_site == 2 * fp.full + 3 * fp.weights  # 2 latest in full, 3 best of the weights alone
    assert run_plan(cfg).startswith("this run: 48 syncs every 30m ≈ 24 h per site (3 jobs of 12h); 16,384 tokens")
    fp32 = footprint(compose_config(["site=osc", "model=llama3_1b", "codec=fp32"])[0])
    assert fp32.full_per_param == 12  # nothing lost on the wire: no error-feedback residual
    steps, _ = compose_config(["model=tiny", "train.max_local_steps=10", "train.max_syncs=5"])
    assert "at most 5,120 tokens per site a sync, 25,600 in all" in run_plan(steps)


def test_dry_run_prints_the_plan_and_footprint_per_site(tmp_path: Path) -> None:
    args = ["launch", "site=osc", "model=llama3_1b", "data.tokenizer=gpt2", "ps.address=127.0.0.1:9", "--dry-run"]
    result = subprocess.run(
        CLI + args, cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, **LOGIN_ENV}
    )
    head = result.stdout.split("#!/bin/bash", 1)[0]
    assert "# this run: 48 syncs every 30m ≈ 24 h per site (3 jobs of 12h); 16,384 tokens a step per site" in head
    assert "# checkpoints per site 50.6 GiB: 2 latest x 18.4 GiB (16 bytes x 1,235,814,400 parameters" in head
    assert "+ 3 best x 4.6 GiB (weights only, train.keep_best)" in head
    warning = next(line for line in head.splitlines() if "warning  data" in line)
    assert "which launch refuses on a Slurm site" in warning and "data.source=PATH" in warning and "--demo" in warning
    demo = subprocess.run(
        CLI + [*args, "--demo"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **LOGIN_ENV},
    )
    assert "ok       data         bible: the demo corpus, as --demo asks" in demo.stdout


def _no_cluster(monkeypatch: pytest.MonkeyPatch, submitted: list[str]) -> None:
    """Launch without sbatch, Slurm's queries or a PS: what is submitted is recorded, nothing is queued."""
    from geofed_hpc.commands import preflight
    from geofed_hpc.launch import slurm

    monkeypatch.setattr(slurm, "require_slurm", lambda cfg: None)
    monkeypatch.setattr(slurm, "submit_site", lambda cfg, address: submitted.append(cfg.site.name) or [])
    monkeypatch.setattr(preflight, "check_ps", lambda cfg, address, probe=True: [])
    monkeypatch.setattr(preflight, "check_slurm", lambda cfg, run=None: [])


def test_a_slurm_launch_on_the_demo_corpus_asks_for_data_or_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    submitted: list[str] = []
    _no_cluster(monkeypatch, submitted)
    args = ["launch", "site=slurm_local", "ps.address=127.0.0.1:9", f"run_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("geofed-hpc: error: data.source: bible is the demo corpus")
    assert "data.source=PATH" in errors[0] and "--demo" in errors[0] and submitted == []
    assert main([*args, "--demo"]) == 0 and submitted == ["slurm_local"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("In the beginning was a corpus of our own.\n" * 50)
    assert main([*args, f"data.source={corpus}"]) == 0 and submitted == ["slurm_local"] * 2
    assert fp_mod.check_corpus(compose_config(["site=local"])[0]) == []  # a local launch is the demo: nothing to ask


def test_the_disk_check_errors_when_the_checkpoints_exceed_the_free_space(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free  # the real filesystem of the run directory
    vocab = free // (2 * 16 * 4096) + 1  # a vocabulary whose embedding alone makes 2 full checkpoints exceed it
    cfg, _ = compose_config(["model=llama3_8b", f"model.vocab_size={vocab}", f"run_dir={tmp_path / 'run'}"])
    found = fp_mod.check_run(cfg, tmp_path / "run", run=lambda args: None)
    assert [v[:2] for v in found] == [("error", "disk")]
    assert f"{tmp_path}: " in found[0][2] and "even the 2 latest of each site cannot fit" in found[0][2]
    small, _ = compose_config(["model=tiny", f"run_dir={tmp_path / 'run'}"])
    weights = small.model.param_count() * 4
    many = replace(small, train=replace(small.train, keep_best=free // weights + 1))  # the best ones do not fit
    level, _, text = fp_mod.check_run(many, tmp_path / "run", run=lambda args: None)[0]
    assert level == "warning" and "they do not fit once the best ones are kept" in text
    assert fp_mod.check_run(small, tmp_path / "run", run=lambda args: None)[0][0] == "ok"
    tight = Footprint(params=free // 40, full_per_param=16, best_kept=0, sites=1)  # fits, not with a third written
    assert fp_mod.disk_finding(tight, free, str(tmp_path))[0] == "warning"
    assert fp_mod.disk_finding(tight, free, str(tmp_path), held=tight.peak_per_site)[0] == "ok"  # a resume


def test_quotas_are_read_where_a_quota_command_answers() -> None:
    mounts = "/dev/sdb1 /home ext4 rw 0 0\nscratch@o2ib:/fs /fs/scratch lustre rw 0 0\n"
    quota = (
        "Disk quotas for user alice (uid 1000):\n"
        "     Filesystem  blocks   quota   limit   grace   files   quota   limit   grace\n"
        "      /dev/sdb1  900000* 1000000 1048576 0 10 0 0 0\n"
    )
    calls: list[list[str]] = []

    def run(args: Any) -> str | None:
        calls.append(list(args))
        return quota if args[0] == "quota" else "/fs/scratch 10 0 2048 - 1 0 0 -\n"

    assert fp_mod.quota_room(Path("/home/alice/run"), run, mounts) == (1048576 - 900000) * 1024
    assert fp_mod.quota_room(Path("/fs/scratch/alice/run"), run, mounts) == (2048 - 10) * 1024
    assert calls[-1][:3] == ["lfs", "quota", "-q"] and calls[-1][-1] == "/fs/scratch"
    assert fp_mod.quota_room(Path("/home/alice"), lambda args: None, mounts) is None  # no quota command: skipped
    assert fp_mod.parse_quota("none here", "/dev/sdb1", "/home") is None
