"""A federation over emulated WAN links (delay, jitter, 1% loss, rate caps, CUBIC): syncs, and a 30 s outage."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from geofed_hpc.testing.federation import PS_PORT, WanFederation
from geofed_hpc.testing.wan import Wan, unavailable_reason
from tests.conftest_wan import CONGESTION_CONTROL, LINKS, wan  # noqa: F401 - the fixture

pytestmark = [pytest.mark.wan, pytest.mark.slow]

HOST_CC = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
HOST_ALLOWED = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().strip()
OUTAGE = timedelta(seconds=30)
SITE_TIMEOUT = timedelta(minutes=4)

ECHO_SERVER = """
import socket
srv = socket.create_server(("0.0.0.0", 7000))
while True:
    conn, _ = srv.accept()
    with conn:
        while data := conn.recv(64):
            conn.sendall(data)
"""
PROBE = """
import socket, sys, time
t = time.monotonic()
c = socket.create_connection((sys.argv[1], 7000), timeout=10)
connect = time.monotonic() - t
c.sendall(b"ping"); c.recv(4)
print(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\\0").decode(), connect)
"""
# What a benchmark does (bench/wan.py, egress.py, goodput.py): namespaces, a process inside, then a long run.
BENCHMARK = """
import sys, time
from pathlib import Path
from geofed_hpc.testing.wan import NEAR, Wan, exit_on_sigterm
if sys.argv[2] == "handled":
    exit_on_sigterm()
with Wan({"near": NEAR}, Path(sys.argv[1])) as lab:
    child = lab.popen(lab.site_ns("near"), ["sleep", "600"], Path(sys.argv[1]) / "sleep.log")
    print(lab.ps_ns, lab.site_ns("near"), child.pid, flush=True)
    time.sleep(600)
"""


def versions_and_pushes(status: dict[str, Any]) -> tuple[int, dict[str, int]]:
    return status["version"], {s["site"]: s["pushes"] for s in status["sites"]}


def test_every_namespace_runs_cubic_and_the_links_delay_packets(wan: Wan, tmp_path: Path) -> None:  # noqa: F811
    for ns in wan.namespaces:
        assert wan.congestion_control(ns) == CONGESTION_CONTROL, ns
    assert Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip() == HOST_CC  # host untouched
    assert Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().strip() == HOST_ALLOWED
    wan.popen(wan.ps_ns, [sys.executable, "-c", ECHO_SERVER], tmp_path / "echo.log")
    for site, link in LINKS.items():
        for _ in range(50):  # the server may still be starting
            probe = wan.run(wan.site_ns(site), [sys.executable, "-c", PROBE, wan.ps_ip(site)])
            if probe.returncode == 0:
                break
            time.sleep(0.2)
        assert probe.returncode == 0, probe.stderr
        cc, connect_s = probe.stdout.split()
        assert cc == CONGESTION_CONTROL  # a socket the application never configured gets the namespace's choice
        assert float(connect_s) >= 2 * (link.delay - link.jitter).total_seconds()  # SYN and SYN-ACK both crossed


def test_two_sites_over_lossy_wan_links_complete_several_syncs(wan: Wan, tmp_path: Path) -> None:  # noqa: F811
    fed = WanFederation(wan, tmp_path, codec="int8", max_syncs=3)
    fed.start_ps()
    for site in LINKS:
        fed.launch(site)
    seen_cc: set[str] = set()
    codes = fed.wait(SITE_TIMEOUT, lambda: seen_cc.update(wan.socket_congestion_controls(wan.ps_ns, PS_PORT)))
    assert codes == {site: 0 for site in LINKS}, fed.logs()
    assert seen_cc == {CONGESTION_CONTROL}, seen_cc  # gRPC's own connections, inspected with ss
    for site in LINKS:
        syncs = fed.syncs(site)
        assert [r["sync/index"] for r in syncs] == [1, 2, 3], fed.logs()
        versions = [r["sync/version"] for r in syncs]
        assert versions == sorted(set(versions)), versions
        initial = [r["val/loss"] for r in fed.records(site) if r.get("sync/index") == 0 and "val/loss" in r]
        assert syncs[-1]["val/loss"] < initial[0]
    version, pushes = versions_and_pushes(fed.status())
    assert pushes == {f"{site}-0": 3 for site in LINKS}
    assert version == 6  # async: every delta applied exactly once
    for site in LINKS:
        counters = wan.counters(site)
        assert counters["up"]["lost"] > 0 and counters["down"]["lost"] > 0  # TCP recovered real losses


def test_a_link_down_for_30s_mid_push_recovers_and_the_delta_lands_once(wan: Wan, tmp_path: Path) -> None:  # noqa: F811
    site = "near"
    fed = WanFederation(wan, tmp_path, codec="fp32", max_syncs=3)  # fp32: pushes of ~1.6 MB take seconds
    fed.start_ps()
    fed.launch(site)
    outage: dict[str, float] = {}
    last_up = [0]

    def watch() -> None:
        now = time.monotonic()
        if "down" not in outage:
            if len(fed.syncs(site)) != 1:  # drop the link during the second delta push
                return
            sent = wan.counters(site)["up"]["bytes"]
            if last_up[0] and sent - last_up[0] > 16_000:  # a push is streaming
                wan.link_down(site)
                outage["down"] = now
            last_up[0] = sent
        elif "up" not in outage and now - outage["down"] >= OUTAGE.total_seconds():
            outage["dropped"] = wan.counters(site)["up"]["down_dropped"]
            wan.link_up(site)
            outage["up"] = now

    codes = fed.wait(SITE_TIMEOUT, watch)
    assert "up" in outage, f"no push was seen streaming to take the link down: {fed.logs()}"
    assert outage["dropped"] > 0  # the site kept sending into the dead link
    assert codes == {site: 0}, fed.logs()
    syncs = fed.syncs(site)
    assert [r["sync/index"] for r in syncs] == [1, 2, 3], fed.logs()
    assert [r["sync/version"] for r in syncs] == [1, 2, 3]
    version, pushes = versions_and_pushes(fed.status())
    assert (version, pushes) == (3, {f"{site}-0": 3})  # nothing lost, nothing applied twice


def test_wan_is_skipped_with_a_reason_when_not_root() -> None:
    code = "from geofed_hpc.testing.wan import unavailable_reason as r; import os; os.setuid(65534); print(r())"
    if sys.platform != "linux":
        pytest.skip("Linux only")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        pytest.skip(f"cannot run a child process: {exc}")
    if out.returncode != 0:
        pytest.skip(f"cannot drop to an unprivileged user here: {out.stderr.strip()[-200:]}")
    assert "need root" in out.stdout


def test_a_benchmark_stopped_with_sigterm_leaves_no_namespace_and_no_process(tmp_path: Path) -> None:
    """`timeout` and `kill` send SIGTERM: with `exit_on_sigterm` the run leaves as on Ctrl-C, through `Wan.close`
    (its namespaces deleted, its link forwarders and the process it started inside ended)."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"emulated WAN unavailable: {reason}")
    run = subprocess.Popen(
        [sys.executable, "-c", BENCHMARK, str(tmp_path), "handled"], stdout=subprocess.PIPE, text=True
    )
    names: list[str] = []
    try:
        assert run.stdout is not None
        *names, pid = run.stdout.readline().split()  # the namespaces are up, the child runs
        assert set(names) <= set(netns_list()) and processes_naming(names[0])
        run.terminate()
        assert run.wait(timeout=60) == 128 + 15
        assert not set(names) & set(netns_list())
        assert not processes_naming(names[0]) and not Path(f"/proc/{pid}").exists()
    finally:  # what a broken run left behind, for the next tests
        run.kill()
        run.wait()
        for left in {p for ns in names for p in processes_naming(ns)}:
            os.kill(left, signal.SIGKILL)
        for ns in set(names) & set(netns_list()):
            subprocess.run(["ip", "netns", "del", ns], check=False)


def netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def processes_naming(namespace: str) -> list[int]:
    """Processes whose command line names `namespace` (the link forwarders), or that run inside it."""
    found = [int(pid) for pid in subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                                                 text=True, check=False).stdout.split()]  # fmt: skip
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and namespace.encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found
