"""The `geofed-hpc` command as users run it: help, errors, ps up + status, and the installed wheel."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "geofed_hpc.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str], cwd: Path | None = None, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        CLI + args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env}
    )


def test_help_lists_commands_groups_and_options(tmp_path: Path) -> None:
    out = run(["--help"], cwd=tmp_path).stdout
    for text in (
        "launch",
        "ps up",
        "status",
        "report",
        "site ",
        "local",
        "osc",
        "model ",
        "tiny",
        "llama3_1b",
        "cloud",
        "--cfg",
        "+key=value",
    ):
        assert text in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["launch", "model=tinyy"], "unknown model option 'tinyy'; valid choices: gpt2_medium"),
        (["lunch"], "unknown command 'lunch'"),
        (["status", "ps.port=x"], "ps.port: expected an integer"),
        (["status", "ps.aggregation=fast"], "ps.aggregation: must be one of sync, async, buffered; got 'fast'"),
        (["launch", "ps.prot=1"], "unknown key ps.prot; valid keys in ps: address, aggregation,"),
        (["report", "/nonexistent/run"], "no metrics in /nonexistent/run/metrics"),
        (["wandb", "sync", "/nonexistent/run"], "no offline W&B runs under /nonexistent/run"),
    ],
)
def test_errors_are_one_line_and_nonzero(args: list[str], message: str, tmp_path: Path) -> None:
    result = run(args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_launch_without_reachable_ps_fails_clearly(tmp_path: Path) -> None:
    port = free_port()
    result = run(
        [
            "launch",
            "site.embedded_ps=false",
            f"ps.address=127.0.0.1:{port}",
            "ps.connect_timeout=1s",
            f"run_dir={tmp_path}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert f"cannot reach the parameter server at 127.0.0.1:{port}" in last and "ps up" in last
    assert "Traceback" not in result.stderr


def test_ps_up_status_and_port_in_use(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        CLI + ["ps", "up", f"ps.port={port}", f"ps.state_dir={tmp_path / 'state'}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and "parameter server on" not in line:
            line = proc.stdout.readline()
        assert f":{port}" in line
        status = run(["status", f"ps.address=127.0.0.1:{port}"], cwd=tmp_path)
        assert status.returncode == 0, status.stderr
        assert "version 0" in status.stdout and "initialized False" in status.stdout
        clash = run(["ps", "up", f"ps.port={port}"], cwd=tmp_path)
        assert clash.returncode == 2 and f"127.0.0.1:{port}" in clash.stderr and "in use" in clash.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_installed_wheel_finds_its_config_from_any_directory(tmp_path: Path) -> None:
    """Build a real wheel, install it (non-editable) into a folder, and run its console script elsewhere."""
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("geofed_hpc-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run(
        [sys.executable, "-c", "import geofed_hpc.cli as c; print(c.__file__, c.conf_dir())"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(target)) and str(REPO) not in where
    script = target / "bin" / "geofed-hpc"
    result = subprocess.run(
        [str(script), "launch", "ps=cloud", "--cfg"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "port: 50051" in result.stdout and "name: tiny" in result.stdout
    help_text = subprocess.run([str(script), "--help"], cwd=elsewhere, env=env, capture_output=True, text=True).stdout
    assert "cloud, local" in help_text


def test_site_configs_launched_together_get_disjoint_data_shards(tmp_path: Path) -> None:
    out = run(["launch", "site=osc,tacc", "site.num_sites=2", "--cfg"], cwd=tmp_path).stdout
    firsts = [line.split()[-1] for line in out.splitlines() if line.strip().startswith("first_shard:")]
    counts = {line.split()[-1] for line in out.splitlines() if line.strip().startswith("shard_count:")}
    assert firsts == ["0", "2"] and counts == {"4"}
