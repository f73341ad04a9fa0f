"""Real site processes killed and restarted: a two-rank site resumes bit-identical from its DCP shards (and with
its cosine lr at the right step), a wsd schedule goes on at its step, another world size reshards; cuda asked for
on this CPU-only machine stops at start (site and `launch`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from geofed_hpc.client.schedule import LRSchedule
from geofed_hpc.client.sharded import read_shards
from tests.site_procs import Site, events
from tests.test_site_client import latest, make_ps, metrics, shards, site_cfg

__all__ = ["shards"]  # the module-scoped token shards fixture, shared with test_site_client
pytestmark = pytest.mark.slow

LR = 3e-3
KILL = "site.step@5=kill"  # rank 0 dies after its fifth step: mid-interval 2, after sync 1's checkpoint


def _launch(cfg: dict[str, Any], folder: Path, address: str, world: int, faults: str = "") -> Site:
    os.environ.pop("GEOFED_FAULTS", None)
    if faults:
        os.environ["GEOFED_FAULTS"] = faults
    try:
        site = Site(cfg, folder, address, world=world)
    finally:
        os.environ.pop("GEOFED_FAULTS", None)
    try:
        site.wait(timeout=600)
    finally:
        site.close()
    return site


def _lrs(folder: Path) -> list[float]:
    return [r["train/lr"] for r in metrics(folder) if "train/loss" in r]


def test_a_two_rank_site_killed_mid_interval_resumes_bit_identical_from_its_shards(
    tmp_path: Path, shards: Path
) -> None:
    schedule = {"schedule": "cosine", "warmup_steps": 2, "total_steps": 9, "lr": LR}
    runs = {}
    for name, faults in (("straight", ""), ("killed", KILL)):
        folder = tmp_path / name
        ps = make_ps(folder)
        try:
            cfg = site_cfg(folder, shards, max_syncs=3, **schedule)
            if faults:
                first = _launch(cfg, folder, ps.address, world=2, faults=faults)
                codes = [p.returncode for p in first.procs]
                assert codes[0] == -9 and codes[1] != 0, first.output()  # SIGKILL; the follower left with it
                _, meta, _ = latest(folder)
                assert meta["syncs"] == 1 and meta["shards"]["world_size"] == 2
            again = _launch(cfg, folder, ps.address, world=2)
            assert [p.returncode for p in again.procs] == [0, 0], again.output()
        finally:
            ps.stop()
        tensors, meta, path = latest(folder)
        assert meta["syncs"] == 3 and meta["version"] == 3 and meta["sampler"]["draws"] == 9
        runs[name] = (read_shards(path.parent / meta["shards"]["dir"]), tensors, _lrs(folder))
    ready = [e["source"] for e in events(tmp_path / "killed" / "run" / "sites" / "local-0") if e["event"] == "ready"]
    assert ready == ["fresh", "local"]  # the second job went on from its own shards
    (a, a_tensors, a_lrs), (b, b_tensors, b_lrs) = runs["straight"], runs["killed"]
    assert a["model"].keys() == b["model"].keys() and len(a["model"]) > 0
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name  # bit for bit
    for name, entries in a["optim"]["state"].items():
        for key, value in entries.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["optim"]["state"][name][key])), (name, key)
    assert all((a_tensors[k] == b_tensors[k]).all() for k in a_tensors if k.startswith("residual/"))
    cosine = LRSchedule("cosine", warmup=2, total=9)
    assert a_lrs == b_lrs == pytest.approx([LR * cosine.factor(n) for n in (3, 6, 9)])

    # The same shards read by a one-process site: resharded (said in its log), and it trains on.
    folder = tmp_path / "killed"
    ps = make_ps(folder)
    try:
        one = _launch(site_cfg(folder, shards, max_syncs=4, **schedule), folder, ps.address, world=1)
    finally:
        ps.stop()
    assert [p.returncode for p in one.procs] == [0], one.output()
    assert "written by 2 ranks, this job has 1: resharding its model and optimizer" in one.output()
    tensors, meta, _ = latest(folder)
    assert meta["syncs"] == 4 and "shards" not in meta and "model/wte.weight" in tensors


def test_a_wsd_schedule_goes_on_at_its_step_after_a_kill_and_a_restart(tmp_path: Path, shards: Path) -> None:
    wsd = {"schedule": "wsd", "warmup_steps": 2, "total_steps": 9, "decay_fraction": 0.5, "min_lr_ratio": 0.1}
    ps = make_ps(tmp_path, aggregation="async")
    try:
        cfg = site_cfg(tmp_path, shards, max_syncs=3, lr=LR, **wsd)
        killed = _launch(cfg, tmp_path, ps.address, world=1, faults=KILL)
        assert [p.returncode for p in killed.procs] == [-9], killed.output()
        again = _launch(cfg, tmp_path, ps.address, world=1)
        assert [p.returncode for p in again.procs] == [0], again.output()
    finally:
        ps.stop()
    schedule = LRSchedule("wsd", warmup=2, total=9, min_ratio=0.1, decay_fraction=0.5)
    assert [schedule.factor(n) for n in (3, 6, 9)] == pytest.approx([1.0, 0.775, 0.1])  # stable, decaying, floor
    assert _lrs(tmp_path) == pytest.approx([LR * schedule.factor(n) for n in (3, 6, 9)])
    _, meta, _ = latest(tmp_path)
    assert meta["sampler"]["draws"] == 9  # steps 4 and 5 of the killed job were trained again, none skipped


def test_cuda_asked_for_on_this_cpu_only_machine_stops_at_start(tmp_path: Path, shards: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    ps = make_ps(tmp_path)
    try:
        site = _launch(site_cfg(tmp_path, shards, max_syncs=1, device="cuda"), tmp_path, ps.address, world=1)
    finally:
        ps.stop()
    assert [p.returncode for p in site.procs] != [0]
    assert "ConfigError: train.device=cuda: this torch (" in site.output() and "CPU-only build" in site.output()
    assert not (tmp_path / "run" / "sites" / "local-0" / "ckpt").exists()  # nothing was built or trained

    result = subprocess.run(
        [sys.executable, "-m", "geofed_hpc.cli", "launch", "train.device=cuda", f"run_dir={tmp_path / 'cli'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and "train.device=cuda: this torch (" in result.stderr
    assert not (tmp_path / "cli").exists()  # refused before anything was submitted
