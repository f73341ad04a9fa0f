"""slurm/'s scripts when one test cluster already runs: a second start reuses it (or refuses in one line), a port
held by another program is refused before anything starts, and a start that fails midway stops what it began."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "slurm"
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd")
TIMEOUT_S = 300


def _state(pid: int) -> str | None:
    """The process's state letter (Z: a zombie), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z")


def _daemons() -> set[tuple[int, str]]:
    """Every live Slurm, munge or MariaDB daemon on this host, whoever started it."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                name = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if name in DAEMONS and _alive(int(entry.name)):
                found.add((int(entry.name), name))
    return found


def _run(script: str, slurm_dir: Path | None, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("GEOFED_SLURM_REUSE", "GEOFED_SLURM_FORCE")}
    if slurm_dir is not None:
        full["GEOFED_SLURM_DIR"] = str(slurm_dir)
    full.update(env)
    return subprocess.run([str(SCRIPTS / script)], env=full, capture_output=True, text=True, timeout=TIMEOUT_S)


def _free_ports(n: int) -> list[int]:
    """n TCP ports that are free now (held together while chosen, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _recorded(slurm_dir: Path) -> list[tuple[str, int]]:
    pids = slurm_dir / "run" / "pids" / "started.pids"
    if not pids.exists():
        return []
    return [(n, int(p)) for n, p in (line.split() for line in pids.read_text().splitlines() if line.strip())]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Path]:
    """The dir of the running test cluster (CI's `make test` has it up), else one started here and stopped after."""
    if os.geteuid() != 0 or shutil.which("slurmctld") is None:
        pytest.skip("needs root and slurm/'s single-node Slurm (`make test` as root starts it)")
    slurm_dir = Path(os.environ.get("GEOFED_SLURM_DIR", REPO / ".slurm")).resolve()
    running = _run("status.sh", slurm_dir).returncode == 0
    if not running:
        started = _run("start.sh", slurm_dir)
        assert started.returncode == 0, started.stdout + started.stderr
    try:
        yield slurm_dir
    finally:
        if not running:
            _run("stop.sh", slurm_dir)


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A world-executable scratch folder (munged refuses a socket below a 0700 one); what started there is stopped."""
    bases = [Path(tempfile.gettempdir()), Path("/tmp"), Path("/var/tmp")]
    base = next(b for b in bases if all(d.stat().st_mode & 0o001 for d in [b.resolve(), *b.resolve().parents]))
    path = Path(tempfile.mkdtemp(prefix="geofed-slurm-test-", dir=base))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for slurm_dir in [path, *path.glob("*/.slurm"), *path.glob("dir*")]:
            if (slurm_dir / "run").exists():
                _run("stop.sh", slurm_dir, GEOFED_SLURM_FORCE="1")
        shutil.rmtree(path, ignore_errors=True)


def _ctld_port(cluster: Path) -> int:
    conf = (cluster / "run" / "etc" / "slurm.conf").read_text()
    match = re.search(r"^SlurmctldPort=(\d+)$", conf, re.M)
    assert match, conf
    return int(match.group(1))


@pytest.mark.slurm
def test_second_start_reuses_the_running_cluster_and_its_stop_only_releases_it(cluster: Path, scratch: Path) -> None:
    before = _daemons()
    second = scratch / "dir2"
    started = _run("start.sh", second, SKIP_INSTALL="1")
    assert started.returncode == 0, started.stdout + started.stderr
    assert f"the test cluster under {cluster} is running" in started.stdout
    assert f"source {second}/run/env.sh" in started.stdout
    assert _daemons() == before, "a reusing start started daemons"
    conf = cluster / "run" / "etc" / "slurm.conf"
    assert (second / "run" / "env.sh").read_text().strip() == f"export SLURM_CONF={conf}"
    ping = subprocess.run(
        ["scontrol", "ping"], env={**os.environ, "SLURM_CONF": str(second / "run" / "etc" / "slurm.conf")}
    )
    assert ping.returncode == 0
    leases = [f.read_text().split(maxsplit=1)[1].strip() for f in (cluster / "run" / "users").iterdir()]
    assert str(second) in leases
    status = _run("status.sh", second)
    assert status.returncode == 1 and f"reuses the test cluster under {cluster}" in status.stdout

    # Asked not to reuse: one line naming the running cluster, its pids and ports, and how to stop it.
    third = scratch / "dir3"
    refused = _run("start.sh", third, SKIP_INSTALL="1", GEOFED_SLURM_REUSE="0")
    assert refused.returncode == 1
    line = refused.stderr.strip()
    assert "\n" not in line and not refused.stdout, refused.stdout + refused.stderr
    ctld = dict(_recorded(cluster))["slurmctld"]
    for part in (str(cluster), f"slurmctld pid {ctld}", f"{_ctld_port(cluster)} (slurmctld)"):
        assert part in line, line
    assert f"GEOFED_SLURM_DIR={cluster} slurm/stop.sh" in line
    assert not (third / "run").exists()
    assert _daemons() == before

    stopped = _run("stop.sh", second)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "keeps running" in stopped.stdout
    assert not (second / "run").exists()
    assert _run("status.sh", cluster).returncode == 0
    assert _daemons() == before
    assert not any(str(second) in f.read_text() for f in (cluster / "run" / "users").iterdir())


@pytest.mark.slurm
def test_make_test_in_a_second_checkout_reuses_the_cluster_and_leaves_it_running(cluster: Path, scratch: Path) -> None:
    """The Makefile's `test` recipe as it is, in this checkout and in a copy: pytest replaced by a probe."""
    assert _run("status.sh", cluster).returncode == 0
    before = _daemons()
    checkout = scratch / "checkout2"
    checkout.mkdir()
    shutil.copy(REPO / "Makefile", checkout / "Makefile")
    shutil.copytree(SCRIPTS, checkout / "slurm")
    probe = scratch / "probe.sh"
    seen = scratch / "seen"
    probe.write_text(f'#!/bin/sh\n{{ echo "$SLURM_CONF"; scontrol ping >/dev/null; echo $?; }} >{seen}\n')
    probe.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_CONF", "GEOFED_SLURM_REUSE")}
    second_env = {k: v for k, v in env.items() if k != "GEOFED_SLURM_DIR"}
    conf = str(cluster / "run" / "etc" / "slurm.conf")
    for where, run_env in ((checkout, second_env), (REPO, env)):
        seen.unlink(missing_ok=True)
        make = subprocess.run(
            ["make", "-s", "-C", str(where), "-o", "install", "-o", "lint", "test", f"PY={probe}"],
            env=run_env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert make.returncode == 0, make.stdout + make.stderr
        assert seen.read_text().split() == [conf, "0"], (where, make.stdout)
        assert _daemons() == before, (where, make.stdout)
        assert _run("status.sh", cluster).returncode == 0, (where, make.stdout)
    assert not (checkout / ".slurm" / "run").exists()
    assert not list((cluster / "run" / "users").iterdir())


@pytest.mark.slurm
def test_a_port_held_by_another_program_is_refused_before_anything_starts(cluster: Path, scratch: Path) -> None:
    before = _daemons()
    ports = _free_ports(4)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", ports[1]))
        listener.listen()
        refused = _run(
            "start.sh", scratch, SKIP_INSTALL="1", WITH_SLURMDBD="1", GEOFED_SLURM_PORTS=" ".join(map(str, ports))
        )
    assert refused.returncode == 1
    line = refused.stderr.strip()
    assert "\n" not in line and not refused.stdout, refused.stdout + refused.stderr
    assert f"port {ports[1]} (slurmd) is in use by " in line and f"(pid {os.getpid()})" in line, line
    assert "GEOFED_SLURM_PORTS" in line
    assert _recorded(scratch) == [] and _daemons() == before

    private = Path(tempfile.mkdtemp(prefix="geofed-slurm-0700-", dir=scratch))  # mktemp -d: mode 0700
    refused = _run("start.sh", private, SKIP_INSTALL="1", GEOFED_SLURM_PORTS=" ".join(map(str, ports)))
    assert refused.returncode == 1 and f"chmod o+x {private}" in refused.stderr, refused.stderr
    assert _recorded(private) == [] and _daemons() == before


@pytest.mark.slurm
def test_a_start_that_fails_midway_stops_every_daemon_it_started(cluster: Path, scratch: Path) -> None:
    """MariaDB's port is bound by another socket that does not listen yet: the check before the start cannot see
    it, mariadbd fails to bind it, and the start stops munged and mariadbd, not the running cluster's daemons."""
    before = _daemons()
    ports = _free_ports(4)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", ports[3]))
        failed = _run(
            "start.sh", scratch, SKIP_INSTALL="1", WITH_SLURMDBD="1", GEOFED_SLURM_PORTS=" ".join(map(str, ports))
        )
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "mariadb did not come up" in failed.stderr
    assert "Address already in use" in failed.stdout
    began = [(n, int(p)) for n, p in re.findall(r"started (\w+) \(pid (\d+)\)", failed.stdout)]
    assert [n for n, _ in began] == ["munged", "mariadbd"], failed.stdout
    assert "stopped every daemon it had started" in failed.stderr
    assert not any(_alive(pid) for _, pid in began)
    assert _daemons() == before
    assert _run("status.sh", cluster).returncode == 0


def test_the_owners_stop_waits_for_the_last_dir_that_reuses_its_cluster(tmp_path: Path) -> None:
    """No Slurm needed: two sleeps stand for the owner's daemons; this process holds the other dir's lease."""
    owner, user = tmp_path / "owner", tmp_path / "user"
    sleeps = [subprocess.Popen(["sleep", "300"]) for _ in range(2)]
    try:
        (owner / "run" / "pids").mkdir(parents=True)
        (owner / "run" / "pids" / "started.pids").write_text(f"munged {sleeps[0].pid}\nmariadbd {sleeps[1].pid}\n")
        (owner / "run" / "users").mkdir()
        lease = owner / "run" / "users" / f"{str(user).replace('/', '_')}@{os.getpid()}"
        lease.write_text(f"{os.getpid()} {user}\n")
        (user / "run").mkdir(parents=True)
        (user / "run" / "reuses").write_text(f"{owner}\n")

        deferred = _run("stop.sh", owner)
        assert deferred.returncode == 0, deferred.stdout + deferred.stderr
        assert f"reused by {user} (pid {os.getpid()})" in deferred.stdout
        assert all(s.poll() is None for s in sleeps)
        assert (owner / "run" / "stop.requested").exists()

        released = _run("stop.sh", user)  # this process ran it: its lease goes, and it was the last one
        assert released.returncode == 0, released.stdout + released.stderr
        assert "nobody reuses it any more: stopping it" in released.stdout
        assert [s.wait(timeout=30) for s in sleeps] == [-15, -15]
        assert not lease.exists() and not (user / "run").exists()
        assert not (owner / "run" / "stop.requested").exists()
    finally:
        for s in sleeps:
            if s.poll() is None:
                s.kill()
                s.wait()
