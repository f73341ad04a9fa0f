"""A PS group on loopback: its store and gloo listen where the PS does, and each peer says who is in the group."""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from geofed_hpc.config import RunConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.ps.app import ParameterServer
from geofed_hpc.ps.group.membership import form
from geofed_hpc.ps.group.rendezvous import identity, serve
from tests.conftest import ps_config
from tests.dist_util import free_pair
from tests.site_procs import wait_for

REPO = Path(__file__).resolve().parents[1]
READY = re.compile(r"^parameter server on ", re.M)  # what `ps up` prints once it serves
PEER_TIMEOUT = "5s"  # a stopped in-process peer is noticed when a collective with it times out
GROUP = ["ps.peer_secret=edge-test", "ps.peer_timeout=20s", "ps.peer_tick=100ms", "ps.round_timeout=30s"]


def _address(text: str) -> str:
    """An address of /proc/net/tcp{,6} (hex, in host order per 32-bit word) as text (an IPv4-mapped one as IPv4)."""
    raw = bytes.fromhex(text)
    address = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return str(mapped or address)


def listening(pid: int | str = "self") -> dict[int, set[str]]:
    """The TCP ports process `pid` listens on, each with the addresses it is bound to."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out: dict[int, set[str]] = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # LISTEN
                host, port = local.split(":")
                out.setdefault(int(port, 16), set()).add(_address(host))
    return out


def group_cfg(addresses: list[str], rank: int, host: str = "127.0.0.1", **ps: Any) -> RunConfig:
    """Peer `rank` of `addresses` (no ps.peer_rendezvous: peer 0 serves the store on its port + 1)."""
    _, port = addresses[rank].rsplit(":", 1)
    settings = {"peer_timeout": "20s", "peer_tick": "50ms", "peer_secret": "edge", "round_timeout": "30s", **ps}
    return replace(RunConfig(), ps=ps_config(host=host, port=int(port), peers=addresses, peer_rank=rank, **settings))


@contextmanager
def two_peers(addresses: list[str]) -> Iterator[list[ParameterServer]]:
    servers: list[Any] = [None, None]

    def start(i: int) -> None:
        servers[i] = ParameterServer(group_cfg(addresses, i, peer_timeout=PEER_TIMEOUT))

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert all(isinstance(s, ParameterServer) for s in servers), servers
        yield servers
    finally:
        for s in servers:
            if isinstance(s, ParameterServer):
                s.stop(timedelta(seconds=1))


def messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def test_two_peers_on_loopback_listen_there_only_and_say_who_is_in_the_group(
    warnings_log: pytest.LogCaptureFixture,
) -> None:
    warnings_log.set_level(logging.INFO, logger="geofed_hpc")
    ports = [free_pair(), free_pair()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    before = set(listening())
    with two_peers(addresses) as servers:
        ours = {port: hosts for port, hosts in listening().items() if port not in before}
        store = ports[0] + 1
        assert ours.get(store) == {"127.0.0.1"}, ours  # the store: not 0.0.0.0, not ::
        assert ports[1] + 1 not in ours  # peer 1 serves no store while peer 0 does
        # the PSes' gRPC ports, the store and both peers' gloo listeners: every one on 127.0.0.1 only
        assert len(ours) >= 5 and all(hosts == {"127.0.0.1"} for hosts in ours.values()), ours
        shown = messages(warnings_log)
        for rank in (0, 1):
            line = (
                f"PS group formed (generation 0): peers [0, 1]; addresses {addresses[0]}, {addresses[1]}; "
                f"store served by peer 0 at 127.0.0.1:{store}; this PS is peer {rank}"
            )
            assert line in shown, shown
        assert f"this PS (peer 0) serves the group's store, listening on 127.0.0.1:{store}" in shown, shown

        servers[1].stop(timedelta(seconds=1))  # leaves: peer 0 goes on alone and says so
        group = servers[0].group
        assert group is not None
        wait_for(lambda: group.stats.members == [0], 30, "the group to re-form without peer 1")
        shown = messages(warnings_log)
        assert f"PS group: peer 1 ({addresses[1]}) left (generation 1)" in shown, shown
        assert (
            f"PS group re-formed (generation 1): peers [0]; gone: [1]; addresses {addresses[0]}; "
            f"store served by peer 0 at 127.0.0.1:{store}; this PS is peer 0"
        ) in shown, shown

        # started again: taken back at the next sync point
        servers[1] = ParameterServer(group_cfg(addresses, 1, peer_timeout=PEER_TIMEOUT))
        wait_for(lambda: group.stats.members == [0, 1], 30, "peer 1 taken back")
        shown = messages(warnings_log)
        assert f"PS group: peer 1 ({addresses[1]}) taken back (generation 2)" in shown, shown
        assert "PS group re-formed (generation 2): peers [0, 1]; back: [1]; " in shown, shown
        assert (
            f"PS group took this PS back (generation 2): peers [0, 1]; addresses {addresses[0]}, {addresses[1]}; "
            f"store served by peer 0 at 127.0.0.1:{store}; this PS is peer 1"
        ) in shown, shown


@pytest.mark.parametrize(("host", "bound"), [("0.0.0.0", {"0.0.0.0"}), ("127.0.0.1", {"127.0.0.1"})])
def test_the_store_listens_on_ps_host_a_wildcard_there_on_every_interface(host: str, bound: set[str]) -> None:
    port = free_pair()
    cfg = ps_config(host=host, port=port, peers=[f"127.0.0.1:{port}", "127.0.0.1:1"], peer_rank=0)
    store, where = serve(cfg, port + 1)
    try:
        assert listening().get(port + 1) == bound and where == f"{next(iter(bound))}:{port + 1}"
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store


def test_a_loopback_ps_host_that_its_peers_cannot_dial_is_refused_naming_both() -> None:
    cfg = group_cfg(["10.0.0.5:50051", "10.0.0.6:50051"], 0, peer_timeout="1s")
    with pytest.raises(ConfigError, match=r"ps.host: .* on 127.0.0.1 only, but ps.peers .* at 10.0.0.5: set ps.host"):
        form(cfg.ps, identity(cfg))
    with pytest.raises(ConfigError, match=r"ps.peer_rendezvous has its peers dial it at 10.0.0.9"):
        cfg = group_cfg(["127.0.0.1:50051", "127.0.0.1:50053"], 0, peer_rendezvous="10.0.0.9:29500")
        form(cfg.ps, identity(cfg))


def test_two_ps_up_peers_listen_on_loopback_and_print_the_group(tmp_path: Path) -> None:
    ports = [free_pair(), free_pair()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    logs = [tmp_path / f"ps-{i}.log" for i in range(2)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, port in enumerate(ports):
            args = ["ps", "up", "ps.host=127.0.0.1", f"ps.port={port}", f"ps.peers=[{','.join(addresses)}]"]
            with open(logs[i], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "geofed_hpc.cli", *args, f"ps.peer_rank={i}", *GROUP],
                        cwd=REPO,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, "OMP_NUM_THREADS": "1"},
                    )
                )

        def ready() -> bool:
            for i, p in enumerate(procs):
                assert p.poll() is None, f"peer {i} exited:\n{logs[i].read_text(errors='replace')[-3000:]}"
            return all(READY.search(log.read_text(errors="replace")) for log in logs)

        wait_for(ready, 60, "two peers serving")
        store = listening(procs[0].pid).get(ports[0] + 1)
        assert store == {"127.0.0.1"}, listening(procs[0].pid)
        for i, p in enumerate(procs):
            assert all(hosts == {"127.0.0.1"} for hosts in listening(p.pid).values()), listening(p.pid)
            out = logs[i].read_text(errors="replace")
            assert (  # `ps up` shows it without -v
                f"PS group generation 0: peers [0, 1]; addresses {addresses[0]}, {addresses[1]}; "
                f"store served by peer 0 at 127.0.0.1:{ports[0] + 1}; this PS is peer {i}"
            ) in out, out
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
