"""geofed_hpc.Site, the API for one's own loop: the plain-torch and the Hugging Face Trainer examples each federate two
real site processes against a real `ps up` and their loss falls; a site killed mid-interval, one killed after its push
went in, and a `launch script=` job stopped by SIGTERM each resume with nothing lost or applied twice; `launch
script=` names a script that fails, with its exit code; a loop that changes its parameters is one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import geofed_hpc
from geofed_hpc.cli import main, split_script
from geofed_hpc.config import to_dict
from geofed_hpc.config.plain import plain_config
from geofed_hpc.errors import CheckpointError, ConfigError
from geofed_hpc.rpc.client import PSClient
from tests.conftest import ps_config
from tests.dist_util import free_port
from tests.site_procs import Site as SiteProcs
from tests.site_procs import events, wait_for
from tests.test_faults import ps_process
from tests.test_site_client import make_ps

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "torch_loop.py"
HF_EXAMPLE = REPO / "examples" / "hf_trainer.py"
TOKENS_PER_STEP = 32 * 4  # the example's batch x context
EVERY = 1000  # the script job's steps per sync: the syncs after its second take seconds, so the SIGTERM lands mid-run


def run_example(script: Path, folder: Path, address: str, *args: str, faults: str = "") -> tuple[int, str, dict]:
    """One site process of an example; its exit code, its output and its RESULT line (parsed, {} without one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "GEOFED_"))}
    env.update(OMP_NUM_THREADS="1", WANDB_SILENT="true", GEOFED_FAULTS=faults)
    cmd = [sys.executable, str(script), f"ps.address={address}", f"run_dir={folder}", "wandb_mode=disabled", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return proc.returncode, out, json.loads(lines[-1][7:]) if lines else {}


def run_sites(script: Path, folder: Path, address: str, *args: str) -> list[tuple[int, str, dict]]:
    """Two site processes of `script` side by side (site index 0 and 1)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "GEOFED_"))}
    env.update(OMP_NUM_THREADS="1", WANDB_SILENT="true")
    procs = []
    for index in range(2):
        cmd = [sys.executable, str(script), f"ps.address={address}", f"run_dir={folder}", "wandb_mode=disabled"]
        cmd += [*args, f"--site-index={index}"]
        procs.append(
            subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=300)
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            results.append((proc.returncode, out, json.loads(lines[-1][7:]) if lines else {}))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return results


def ps_view(address: str) -> tuple[int, dict[str, int]]:
    """The PS's version and the tokens of the pushes it applied, per site name (every session of it)."""
    with PSClient(ps_config(address=address)) as client:
        status = client.status()
    tokens: dict[str, int] = {}
    for s in status.sites:
        tokens[s.site] = tokens.get(s.site, 0) + s.tokens
    return status.version, tokens


def test_two_plain_torch_loop_sites_federate_over_a_real_ps_and_their_loss_falls(tmp_path: Path) -> None:
    port = free_port()
    # sync rounds of both sites (ps.min_sites=2: the first round waits for the site that starts later)
    with ps_process(tmp_path / "ps", port, "", "sync", "train.max_local_steps=20", "codec=int8", "ps.min_sites=2"):
        address = f"127.0.0.1:{port}"
        results = run_sites(EXAMPLE, tmp_path / "run", address, "--steps=80")
        for code, out, _ in results:
            assert code == 0, out[-3000:]
        version, tokens = ps_view(address)
    (_, _, a), (_, _, b) = results
    assert a["site"] == "local-0" and b["site"] == "local-1"
    assert a["steps"] == b["steps"] == 80 and a["syncs"] == b["syncs"] == 4  # a push every 20 steps
    assert version == a["version"] == b["version"] == 4  # one round per 20 steps, both sites in each
    assert tokens == {"local-0": 80 * TOKENS_PER_STEP, "local-1": 80 * TOKENS_PER_STEP}  # each push applied once
    assert a["start_loss"] == b["start_loss"] and a["final_loss"] == b["final_loss"]  # both joined, left the same
    assert a["final_loss"] < 0.6 * a["start_loss"], (a, b)  # the global model learned
    ckpts = sorted((tmp_path / "run" / "sites" / "local-0" / "ckpt").glob("loop-*.gft"))
    assert [p.name for p in ckpts] == ["loop-000000060.gft", "loop-000000080.gft"]  # the two latest kept


def test_a_site_process_killed_mid_interval_and_after_a_push_resumes_with_nothing_lost_or_applied_twice(
    tmp_path: Path,
) -> None:
    port = free_port()
    address, folder = f"127.0.0.1:{port}", tmp_path / "run"
    site_dir = folder / "sites" / "local-0"
    with ps_process(tmp_path / "ps", port, "", "async", "train.max_local_steps=10"):
        # SIGKILL after step 25, mid-interval 3: steps 21-25 were never pushed; the restart trains them again
        code, out, _ = run_example(EXAMPLE, folder, address, "--steps=60", faults="site.step@25=kill")
        assert code == -9, out[-3000:]
        assert ps_view(address) == (2, {"local-0": 20 * TOKENS_PER_STEP})
        # SIGKILL while the checkpoint after sync 4 is written: push 4 is in, the latest checkpoint is of step 30
        code, out, _ = run_example(EXAMPLE, folder, address, "--steps=60", faults="atomic.write[loop-000000040]=kill")
        assert code == -9, out[-3000:]
        assert ps_view(address) == (4, {"local-0": 40 * TOKENS_PER_STEP})
        code, out, result = run_example(EXAMPLE, folder, address, "--steps=60")
        assert code == 0, out[-3000:]
        # every step pushed once: 6 versions, 60 steps' tokens (a push applied twice, or steps 31-40 trained and
        # pushed again, would show in both)
        assert ps_view(address) == (6, {"local-0": 60 * TOKENS_PER_STEP})
    assert result["steps"] == 60 and result["version"] == 6 and result["final_loss"] < result["start_loss"]
    seen = events(site_dir)
    ready = [e for e in seen if e["event"] == "ready"]
    assert [(e["source"], e["steps"]) for e in ready] == [("fresh", 0), ("local", 20), ("global", 40)]
    asked = [e for e in seen if e["event"] == "push_after_checkpoint"]
    assert [e["state"] for e in asked] == ["applied"]  # found in, its 10 steps skipped


class _Grows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def test_a_loop_that_changes_the_models_parameters_between_syncs_is_one_line(tmp_path: Path) -> None:
    ps = make_ps(tmp_path, interval="60s", steps=2)
    try:
        overrides = [f"ps.address={ps.address}", f"run_dir={tmp_path / 'run'}", "wandb_mode=disabled"]
        model = _Grows()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ConfigError, match=r"parameter 'b.weight' was added; build the model and its optimizer"):
            with geofed_hpc.Site(model, optimizer, overrides=overrides) as site:
                for _ in range(4):
                    model(torch.ones(1, 4)).sum().backward()
                    optimizer.step()
                    site.step(tokens=4, loss=1.0)
                    model.b = nn.Linear(4, 4)  # a new layer after the first step
        replaced = _Grows()
        with pytest.raises(ConfigError, match=r"'a.weight' is a new Parameter object"):
            with geofed_hpc.Site(replaced, overrides=[*overrides, "site.name=other"]) as site:
                site.step()
                replaced.a.weight = nn.Parameter(torch.zeros(4, 4))
                site.step()
        with pytest.raises(ConfigError, match=r"the optimizer trains a tensor of shape \(3,\) that is not"):
            geofed_hpc.Site(_Grows(), torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1))
        with pytest.raises(CheckpointError, match=r"is of another model \(parameter 'b.bias' differs\)"):
            bigger = _Grows()
            bigger.b = nn.Linear(2, 2)
            geofed_hpc.Site(bigger, overrides=overrides).__enter__()  # the checkpoint of the first loop
        with pytest.raises(ConfigError, match=r"unknown key ps.adress; did you mean ps.address"):
            geofed_hpc.Site(_Grows(), overrides=["ps.adress=127.0.0.1:1"])
    finally:
        ps.stop()


def test_import_geofed_hpc_stays_light() -> None:
    code = "import sys, geofed_hpc; assert 'torch' not in sys.modules; print(*geofed_hpc.__all__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["FederatedCallback", "Site", "__version__"], out.stderr


def test_two_hugging_face_trainer_sites_federate_over_a_real_ps_and_their_loss_falls(tmp_path: Path) -> None:
    port = free_port()
    with ps_process(tmp_path / "ps", port, "", "async", "train.max_local_steps=10", "codec=int8"):
        address = f"127.0.0.1:{port}"
        results = run_sites(HF_EXAMPLE, tmp_path / "run", address, "--steps=40")
        for code, out, _ in results:
            assert code == 0, out[-3000:]
        version, tokens = ps_view(address)
    (_, _, a), (_, _, b) = results
    assert a["steps"] == b["steps"] == 40 and a["syncs"] == b["syncs"] == 4  # a push every 10 optimizer steps
    assert version == 8  # async: every push applied on arrival, once
    assert tokens == {"local-0": 40 * 16 * 32, "local-1": 40 * 16 * 32}  # the tokens the Trainer counted
    for r in (a, b):
        assert r["final_loss"] < 0.75 * r["start_loss"], (a, b)


def test_a_script_job_stopped_by_slurms_requeue_signal_resumes_with_nothing_lost_or_applied_twice(
    tmp_path: Path,
) -> None:
    """The job `launch script=` submits (ClientJob running the script as its child): SIGTERM, as `scontrol requeue`
    sends it, reaches the script, whose Site checkpoints the unpushed steps and exits; the job started again (the
    requeue) pushes them once."""
    port = free_port()
    address, run = f"127.0.0.1:{port}", tmp_path / "run"
    overrides = [f"run_dir={run}", "wandb_mode=disabled"]
    cfg = to_dict(replace(plain_config(None, overrides), script=[str(EXAMPLE), f"--steps={10 * EVERY}"]))
    site_dir = run / "sites" / "local-0"
    with ps_process(tmp_path / "ps", port, "", "async", f"train.max_local_steps={EVERY}", "train.sync_interval=10m"):
        first = SiteProcs(cfg, tmp_path / "job", address)
        try:
            wait_for(lambda: any(e["event"] == "pulled" and e["version"] >= 2 for e in events(site_dir)), 120, "syncs")
            first.signal(signal.SIGTERM)
            assert first.wait(timeout=120) == [128 + signal.SIGTERM], first.output()
        finally:
            first.close()
        stopped = [e for e in events(site_dir) if e["event"] == "stop"]
        assert len(stopped) == 1 and stopped[0]["signal"] == "SIGTERM", first.output()
        version, tokens = ps_view(address)
        assert version < 10 and tokens == {"local-0": version * EVERY * TOKENS_PER_STEP}  # cut short
        again = SiteProcs(cfg, tmp_path / "job", address)
        try:
            assert again.wait(timeout=180) == [0], again.output()
        finally:
            again.close()
        assert ps_view(address) == (10, {"local-0": 10 * EVERY * TOKENS_PER_STEP})  # every step pushed once
    assert again.results() == [{"site": "local-0", "script": str(EXAMPLE)}]
    ready = [e for e in events(site_dir) if e["event"] == "ready"]
    assert [e["source"] for e in ready] == ["fresh", "local"] and ready[1]["steps"] == stopped[0]["steps"]


def test_launch_names_a_script_that_fails_and_its_exit_code(tmp_path: Path) -> None:
    """(tests/test_readme_blocks.py::test_your_own_training_loop runs `launch script=` that succeeds.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "GEOFED_"))}
    env.update(OMP_NUM_THREADS="1", WANDB_SILENT="true")
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.exit(3)\n")
    launch = [sys.executable, "-m", "geofed_hpc.cli", "launch", "site=local", "wandb_mode=disabled"]
    args = [f"run_dir={tmp_path / 'run'}", f"script={bad}", "--anything"]
    failed = subprocess.run([*launch, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 2
    (line,) = failed.stderr.strip().splitlines()
    assert f"script {bad} exited with code 3" in line and line.startswith("geofed-hpc: error: site job"), line
    assert "--anything" not in line  # the script's own argument, not geofed-hpc's
    missing = subprocess.run([*launch, "script=nothere.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert missing.returncode == 2
    assert missing.stderr.strip() == (
        "geofed-hpc: error: script: 'nothere.py' is not a file (launch site=NAME script=train.py ARGS)"
    )


def test_the_words_after_script_are_the_scripts_own(capsys: pytest.CaptureFixture[str]) -> None:
    assert split_script(["launch", "site=osc", "script=t.py", "--lr", "3", "x=1", "--", "--dry-run"]) == (
        ["launch", "site=osc", "script=t.py"],
        ["--lr", "3", "x=1", "--dry-run"],
    )
    assert main(["launch", "site=osc", "script=t.py", "--lr", "3", "--dry-run"]) == 2  # never a real submission
    assert "--dry-run comes after script=, so it would go to the script" in capsys.readouterr().err
    assert main(["launch", "--cfg", "site=local,slurm_local", f"script={EXAMPLE}", "--steps", "5", "x=1"]) == 0
    assert capsys.readouterr().out.count("site:\n  name: ") == 2  # each site config composed, not the script words
    assert main(["launch", "site=local", "site.tasks_per_node=2", f"script={EXAMPLE}", "--steps", "5"]) == 2
    assert "site.tasks_per_node: script= runs one process per site job" in capsys.readouterr().err
