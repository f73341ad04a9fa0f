"""site.tunnel against a real sshd on loopback: the forward carries bytes and its ssh ends by PID with the tunnel; a
host key that does not match, one not known, or a key the server refuses is one line saying what to do; and the
pure parts (the ssh command line, the site.* fields, the order of site.egress)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from geofed_hpc.config import RunConfig, SiteConfig
from geofed_hpc.egress.paths import choose, try_path
from geofed_hpc.egress.tunnel import SshTunnel, ssh_command
from geofed_hpc.errors import ConfigError, UnavailableError
from geofed_hpc.testing.sshd import Sshd, keygen, sshd_unavailable
from tests.dist_util import free_port

needs_sshd = pytest.mark.skipif(bool(sshd_unavailable()), reason=sshd_unavailable() or "sshd is here")


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    if sshd_unavailable():
        pytest.skip(sshd_unavailable())
    with Sshd(tmp_path_factory.mktemp("sshd"), free_port()) as server:
        yield server


@pytest.fixture
def echo() -> Iterator[int]:
    """A TCP echo server on 127.0.0.1 standing in for the PS; its port."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    conn.sendall(conn.recv(100))
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    done.set()
    thread.join(timeout=5)
    server.close()


def test_ssh_command_asks_for_keys_only_and_strict_host_keys() -> None:
    argv = ssh_command("alice@login1:2222", 40000, "vm.example.org", 50051, "~/k", "/x/known")
    assert argv[:2] == ["ssh", "-N"] and argv[-1] == "alice@login1"
    assert (
        "127.0.0.1:40000:vm.example.org:50051" in argv
        and ["-p", "2222"] == argv[argv.index("-p") : argv.index("-p") + 2]
    )
    for option in (
        "BatchMode=yes",
        "ExitOnForwardFailure=yes",
        "StrictHostKeyChecking=yes",
        "UserKnownHostsFile=/x/known",
    ):
        assert option in argv
    assert str(Path("~/k").expanduser()) in argv


def test_site_tunnel_and_egress_are_checked_where_they_are_given() -> None:
    with pytest.raises(ConfigError, match="site.tunnel: expected USER@LOGIN_HOST"):
        SiteConfig(tunnel="login1")
    with pytest.raises(ConfigError, match="site.egress: names a path twice"):
        SiteConfig(egress=["direct", "direct"])
    with pytest.raises(ConfigError, match="site.relay_partition"):
        SiteConfig(relay="job")
    assert SiteConfig().egress == ["direct", "proxy"]


def test_a_path_that_is_not_set_up_is_skipped_and_the_reasons_are_named() -> None:
    cfg = RunConfig(site=SiteConfig(egress=["tunnel", "relay"]))
    with pytest.raises(UnavailableError) as info:
        choose(cfg, "127.0.0.1:1")
    assert "tunnel: site.tunnel is empty" in str(info.value) and "relay: site.relay is empty" in str(info.value)


def test_a_group_whose_first_ps_is_down_is_reached_directly_and_none_up_names_each(tls_ps: Any) -> None:
    closed, also_closed = free_port(), free_port()
    live = f"127.0.0.1:{closed},127.0.0.1:{tls_ps.port}"  # ps.address of a group: its first peer is down
    cfg = RunConfig(ps=tls_ps.config(address=live, connect_timeout="20s"), site=SiteConfig(egress=["direct", "proxy"]))
    route, seconds = try_path("direct", cfg, live, timedelta(seconds=20))
    route.close()
    assert seconds >= 0
    down = f"127.0.0.1:{closed},127.0.0.1:{also_closed}"
    with pytest.raises(UnavailableError) as info:
        try_path("direct", cfg, down, timedelta(seconds=5))
    assert f"nothing answers at 127.0.0.1:{closed}" in str(info.value)
    assert f"nothing answers at 127.0.0.1:{also_closed}" in str(info.value)


@needs_sshd
def test_the_tunnel_carries_bytes_and_its_ssh_ends_with_it(sshd: Sshd, echo: int) -> None:
    with SshTunnel(sshd.target, "127.0.0.1", echo, str(sshd.client_key), str(sshd.known_hosts)) as tunnel:
        assert tunnel.proc is not None
        pid = tunnel.proc.pid
        with socket.create_connection(("127.0.0.1", tunnel.local_port), timeout=10) as conn:
            conn.sendall(b"hello")
            assert conn.recv(100) == b"hello"
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


# A site job's process that opens a tunnel and stays: prints the PID of its ssh.
OPENER = """
import sys, time
from geofed_hpc.egress.tunnel import SshTunnel
tunnel = SshTunnel(sys.argv[1], "127.0.0.1", int(sys.argv[2]), sys.argv[3], sys.argv[4]).start()
print(tunnel.proc.pid, flush=True)
time.sleep(120)
"""


def gone(pid: int) -> bool:
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return True


@needs_sshd
@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's prctl(PR_SET_PDEATHSIG)")
def test_a_killed_job_takes_its_ssh_along(sshd: Sshd, echo: int) -> None:
    argv = [sys.executable, "-c", OPENER, sshd.target, str(echo), str(sshd.client_key), str(sshd.known_hosts)]
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    ssh = 0
    try:
        assert job.stdout is not None
        ssh = int(job.stdout.readline())
        assert not gone(ssh)
        os.kill(job.pid, signal.SIGKILL)  # as Slurm or the OOM killer ends a job: no atexit, no stop()
        job.wait(timeout=30)
        deadline = time.monotonic() + 10
        while not gone(ssh) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(ssh), f"ssh (pid {ssh}) outlived the job that opened the tunnel"
    finally:
        if job.poll() is None:
            os.kill(job.pid, signal.SIGKILL)
            job.wait(timeout=30)
        if ssh and not gone(ssh):
            os.kill(ssh, signal.SIGKILL)


@needs_sshd
@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("other host key", "does not match the one in known_hosts"),
        ("no host key", "is not in known_hosts"),
        ("other client key", "refused the key"),
    ],
)
def test_a_tunnel_that_ssh_refuses_is_one_line_saying_what_to_do(
    sshd: Sshd, echo: int, tmp_path: Path, case: str, said: str
) -> None:
    known, key = sshd.known_hosts, sshd.client_key
    if case == "other host key":
        known = tmp_path / "known_hosts"
        known.write_text(f"[{sshd.listen}]:{sshd.port} {keygen(tmp_path / 'other_host')}\n")
    elif case == "no host key":
        known = tmp_path / "known_hosts"
        known.write_text("")
    else:
        keygen(tmp_path / "other_key")
        key = tmp_path / "other_key"
    tunnel = SshTunnel(sshd.target, "127.0.0.1", echo, str(key), str(known))
    with pytest.raises(UnavailableError) as info:
        tunnel.start()
    assert said in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert tunnel.proc is None  # ended by PID already


def test_the_path_taken_is_in_the_sites_metrics_and_its_wandb_run(tmp_path: Path) -> None:
    from geofed_hpc.config import PSConfig
    from geofed_hpc.egress.paths import Route, announce
    from geofed_hpc.metrics import Recorder

    with Recorder(tmp_path, "osc-0", job_type="site", group="g", wandb_mode="offline", config={}) as rec:
        announce(rec, Route("tunnel", "127.0.0.1:1", PSConfig(), detail="ssh -L 127.0.0.1:1 via alice@login1"))
    assert '"egress/path": "tunnel"' in (tmp_path / "osc-0.metrics.jsonl").read_text()
    (log,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")  # W&B's own record of the run: config and summary
    wanted = (b"egress_path", b"egress/path", b"alice@login1")
    for _ in range(300):  # W&B's service process may still be writing its records after finish() returned
        written = log.read_bytes()
        if all(w in written for w in wanted):
            break
        time.sleep(0.1)
    assert all(w in written for w in wanted), written[-500:]
