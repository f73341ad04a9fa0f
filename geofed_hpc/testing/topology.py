"""A cluster whose compute nodes cannot dial out, as network namespaces: `cloud` (the PS's VM), `login` (a node on
both networks) and `compute` (reaches `login` only). Veth pairs, no forwarding in `login`: a connection from
`compute` to `cloud` has no route, as on a cluster without egress; only a proxy, a relay or a tunnel on `login`
carries it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from geofed_hpc.testing.wan import _ip, _netns_pids, _stop, unavailable_reason

__all__ = ["ClusterNet", "unavailable_reason"]


class ClusterNet:
    """Namespaces `<tag>-cloud`, `<tag>-login`, `<tag>-compute`; processes started in them end with `close()`."""

    CLOUD_IP = "10.252.0.1"  # the PS's VM
    LOGIN_UP_IP = "10.252.0.2"  # the login node, on the VM's side
    LOGIN_IP = "10.252.1.1"  # the login node, as compute nodes reach it
    COMPUTE_IP = "10.252.1.2"

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.tag = f"gfe{os.getpid() % 100000}"
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def ns(self, role: str) -> str:
        """The namespace of `role`: cloud, login or compute."""
        if role not in ("cloud", "login", "compute"):
            raise ValueError(f"no namespace {role!r}: cloud, login or compute")
        return f"{self.tag}-{role}"

    def __enter__(self) -> ClusterNet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            for role in ("cloud", "login", "compute"):
                _ip("netns", "add", self.ns(role))
                self.namespaces.append(self.ns(role))
                _ip("-n", self.ns(role), "link", "set", "lo", "up")
            self._pair("cloud", self.CLOUD_IP, "login", self.LOGIN_UP_IP, "up")
            self._pair("login", self.LOGIN_IP, "compute", self.COMPUTE_IP, "down")
        except BaseException:
            self.close()
            raise

    def _pair(self, a: str, a_ip: str, b: str, b_ip: str, name: str) -> None:
        left, right = f"{self.tag}{name}a", f"{self.tag}{name}b"
        _ip("link", "add", left, "type", "veth", "peer", "name", right)
        for role, dev, ip in ((a, left, a_ip), (b, right, b_ip)):
            _ip("link", "set", dev, "netns", self.ns(role))
            _ip("-n", self.ns(role), "addr", "add", f"{ip}/30", "dev", dev)
            _ip("-n", self.ns(role), "link", "set", dev, "up")

    def close(self) -> None:
        for proc in reversed(self.procs):
            _stop(proc, signal.SIGTERM)
        for ns in self.namespaces:  # anything left inside: by PID
            for pid in _netns_pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in self.namespaces:  # deleting a namespace deletes its end of each veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self.namespaces.clear()
        self.procs.clear()

    def popen(
        self, role: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.Popen:
        """Start argv inside `role`'s namespace (its own process group), output to `log`; ended by close()."""
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns(role), *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                cwd=cwd,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def python(
        self, role: str, code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120.0
    ) -> subprocess.CompletedProcess:
        """Run a Python snippet inside `role`'s namespace; its output comes back."""
        argv = ["ip", "netns", "exec", self.ns(role), sys.executable, "-c", code, *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
