"""`geofed-hpc ps up` prints one aligned line per applied global version, not log lines (--quiet: none)."""

from __future__ import annotations

import io
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from geofed_hpc import codec
from geofed_hpc.config import CodecConfig
from geofed_hpc.launch.progress import PS_COLUMNS, PSProgress, ps_row
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from tests.conftest import ps_config, small_params
from tests.site_procs import wait_for

FP32 = CodecConfig(name="fp32")


def applied(version: int, sites: list[str], staleness: int = 0, tokens: int = 2048, nbytes: int = 5000) -> dict:
    return {"version": version, "sites": sites, "staleness": staleness, "tokens": tokens, "nbytes": nbytes,
            "active": 2, "time": 0.0, "why": "ready"}  # fmt: skip


def test_rows_are_aligned_and_wait_briefly_for_their_validation_loss() -> None:
    now = [0.0]
    out = io.StringIO()
    table = PSProgress(out, hold_s=30.0, clock=lambda: now[0])
    table.start(0)
    table.poll([applied(1, ["osc-0"])], (0, 5.0))
    assert out.getvalue().count("\n") == 1  # only the header: version 1 waits for its loss
    table.poll([], (1, 4.25))
    table.poll([applied(2, ["osc-0", "tacc-0"], staleness=1)], (1, 4.25))
    now[0] = 31.0
    table.poll([], (1, 4.25))  # version 2's loss never came: printed without one after hold_s
    many = [f"uw-madison-{i}" for i in range(6)]
    table.poll([applied(3, many, tokens=3_500_000, nbytes=3 << 20)], (-1, float("nan")))
    table.flush()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4
    assert lines[0].split() == ["version", "sites", "stale", "tokens", "received", "val", "loss", "active"]
    assert len({len(line) for line in lines}) == 1  # aligned columns
    assert lines[1].split() == ["1", "osc-0", "0", "2.0k", "4.9", "KiB", "4.2500", "2"]
    assert lines[2].split() == ["2", "osc-0,tacc-0", "1", "2.0k", "4.9", "KiB", "-", "2"]
    assert lines[3].split()[1:3] == ["uw-madison-0", "+5"] and "3.5M" in lines[3] and "3.0 MiB" in lines[3]
    assert len(ps_row(applied(9, ["x" * 40]))) == len(lines[0])
    assert PS_COLUMNS[0][0] == "version"


def ps_up(folder: Path, *flags: str) -> tuple[subprocess.Popen, Path, Path]:
    """A real `geofed-hpc ps up` process; its stdout and stderr go to files in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "geofed_hpc.cli", *flags, "ps", "up", "ps.port=0", "ps.aggregation=async"]
    cmd += [f"ps.state_dir={folder / 'state'}", "codec=fp32"]
    out, err = folder / "stdout.txt", folder / "stderr.txt"
    with open(out, "w") as o, open(err, "w") as e:
        return subprocess.Popen(cmd, cwd=folder, stdout=o, stderr=e, text=True), out, err


def drive(started: tuple[subprocess.Popen, Path, Path]) -> tuple[str, str]:
    """Two sites push three deltas to the real `ps up` process; one reports the loss of version 2."""
    proc, out, err = started
    try:
        wait_for(lambda: "parameter server on" in out.read_text(), 60, "ps up to listen")
        port = re.search(r"^parameter server on [^ ]+:(\d+) \(", out.read_text(), re.M)
        assert port, out.read_text() + err.read_text()
        with PSClient(ps_config(), f"127.0.0.1:{port[1]}") as client:
            a = client.join(m.JoinRequest("osc-0")).session_id
            b = client.join(m.JoinRequest("tacc-0")).session_id
            init = m.PushHeader(a, 0, 0, 0, "fp32", 0, b"", "", init=True)
            assert client.push_delta(init, codec.encode(small_params(), FP32)).accepted
            ones = codec.encode({k: np.ones_like(v) for k, v in small_params().items()}, FP32)
            for sid, base, tokens in ((a, 0, 1024), (b, 0, 2048)):
                assert client.push_delta(m.PushHeader(sid, base, 4, tokens, "fp32", 0, b"", ""), ones).accepted
            client.heartbeat(m.HeartbeatRequest(b, 2, val_loss=3.5))
            assert client.push_delta(m.PushHeader(a, 2, 4, 4096, "fp32", 0, b"", ""), ones).version == 3
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.read_text()
    return out.read_text(), err.read_text()


def test_ps_up_prints_a_line_per_applied_version(tmp_path: Path) -> None:
    out, err = drive(ps_up(tmp_path))
    lines = out.splitlines()
    assert lines[1].split() == ["version", "sites", "stale", "tokens", "received", "val", "loss", "active"]
    rows = [line.split() for line in lines if re.match(r"^\d+\s", line)]
    assert len({len(line) for line in lines[1:5]}) == 1  # header and rows aligned
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert [r[1] for r in rows] == ["osc-0", "tacc-0", "osc-0"]
    assert [r[2] for r in rows] == ["0", "1", "0"]  # tacc-0 pushed against version 0 when 1 was out
    assert [r[3] for r in rows] == ["1.0k", "2.0k", "4.1k"]
    assert rows[1][6] == "3.5000" and rows[0][6] == "-"  # the loss shows on the line of the version evaluated
    assert all(r[-1] == "2" for r in rows)
    assert "INFO" not in out and "INFO" not in err  # a table, not log lines
    assert "parameter server stopped at version 3" in out


def test_ps_up_quiet_prints_no_table_and_verbose_adds_log_lines(tmp_path: Path) -> None:
    out, _ = drive(ps_up(tmp_path / "q", "--quiet"))
    assert not [line for line in out.splitlines() if re.match(r"^\d+\s", line) or line.startswith("version")]
    assert "parameter server stopped at version 3" in out
    out, err = drive(ps_up(tmp_path / "v", "-v"))
    assert len([line for line in out.splitlines() if re.match(r"^\d+\s", line)]) == 3
    assert "INFO" in err and "push from tacc-0" in err
