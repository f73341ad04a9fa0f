"""An emulated WAN for tests and benchmarks: a namespace for the PS, one per site, user-space netem links."""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from geofed_hpc.errors import ConfigError, GeofedError
from geofed_hpc.log import logger

READY_WAIT = timedelta(seconds=10)
STOP_WAIT = timedelta(seconds=10)
CC_LOCK = "/run/lock/geofed-wan-cc.lock"
_ids = itertools.count()


@dataclass(frozen=True)
class Link:
    """One site's path to the PS; every impairment applies in each direction (RTT = 2 x delay)."""

    delay: timedelta = timedelta(milliseconds=50)
    jitter: timedelta = timedelta(milliseconds=10)
    loss_pct: float = 1.0
    rate_mbit: float = 50.0
    queue_packets: int = 1000

    def __post_init__(self) -> None:
        if self.jitter > self.delay:
            raise ConfigError(f"wan link jitter {self.jitter} exceeds its delay {self.delay}")
        if not 0.0 <= self.loss_pct < 100.0:
            raise ConfigError(f"wan link loss_pct must be in [0, 100), got {self.loss_pct}")
        if self.rate_mbit <= 0 or self.queue_packets < 1:
            raise ConfigError(f"wan link rate_mbit and queue_packets must be positive: {self}")

    def describe(self) -> str:
        ms = lambda t: f"{t.total_seconds() * 1e3:g}"  # noqa: E731
        return f"{ms(self.delay)} ms +-{ms(self.jitter)} ms, {self.loss_pct:g}% loss, {self.rate_mbit:g} Mbit/s"


# The two links of issue 8: a nearby cluster and a far one (one-way figures; RTT is twice the delay).
NEAR = Link(timedelta(milliseconds=50), timedelta(milliseconds=10), 1.0, 50.0)
FAR = Link(timedelta(milliseconds=100), timedelta(milliseconds=20), 1.0, 20.0)


def exit_on_sigterm() -> None:
    """Make SIGTERM (`timeout`, `kill`) leave like Ctrl-C does, through every `with Wan(...)`: a benchmark stopped
    from outside removes its namespaces and ends its processes instead of leaving them behind."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def unavailable_reason() -> str:
    """Why this machine cannot build the emulated WAN ('' when it can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and TUN devices need root (CAP_NET_ADMIN); run the wan tests as root, as CI does"
    if not shutil.which("ip"):
        return "the `ip` command (iproute2) is not installed"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (no TUN support in this kernel or container)"
    return ""


class Wan:
    """Namespaces `<tag>-ps` and `<tag>-<site>`, one forwarder process per link, processes started inside them.

    `close()` (or leaving the `with` block) always ends every process this object started, by PID, then any
    process still inside its namespaces, then deletes the namespaces -- also after a failed start.
    """

    def __init__(self, links: dict[str, Link], workdir: Path, congestion_control: str = "cubic", seed: int = 0) -> None:
        if not links or len(links) > 200:
            raise ConfigError(f"wan: give 1..200 site links, got {len(links)}")
        self.links = dict(links)
        self.workdir = Path(workdir)
        self.cc = congestion_control
        self.seed = seed
        self.tag = f"gf{os.getpid()}n{next(_ids)}"
        self.ps_ns = f"{self.tag}-ps"
        self.namespaces: list[str] = []
        self.forwarders: dict[str, subprocess.Popen] = {}
        self.procs: list[subprocess.Popen] = []

    # ------------------------------------------------------------------ addresses
    def _index(self, site: str) -> int:
        if site not in self.links:
            raise ConfigError(f"wan: unknown site {site!r}; sites: {', '.join(self.links)}")
        return list(self.links).index(site)

    def site_ns(self, site: str) -> str:
        return f"{self.tag}-{self._index(site)}"

    def ps_ip(self, site: str) -> str:
        """The PS's address as `site` dials it (each link is its own point-to-point subnet)."""
        return f"10.251.{self._index(site)}.1"

    def site_ip(self, site: str) -> str:
        return f"10.251.{self._index(site)}.2"

    def ps_ips(self) -> list[str]:
        return [self.ps_ip(s) for s in self.links]

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Wan:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            for ns in [self.ps_ns, *(self.site_ns(s) for s in self.links)]:
                _ip("netns", "add", ns)
                self.namespaces.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                self._pin_congestion_control(ns)
            for i, (site, link) in enumerate(self.links.items()):
                self._start_link(i, site, link)
        except BaseException:
            self.close()
            raise
        logger.info(
            "wan up: %s (TCP congestion control %s)",
            "; ".join(f"{s}: {link.describe()}" for s, link in self.links.items()),
            self.cc,
        )

    def _pin_congestion_control(self, ns: str) -> None:
        """Make `self.cc` the default of every TCP socket in `ns`, gRPC's included (the sysctl is per namespace).

        Outside the initial namespace the kernel accepts only algorithms in the host-wide
        net.ipv4.tcp_allowed_congestion_control (here "reno bbr"): add ours for the instant of the sysctl, under a
        lock, then restore the list. Sockets created later take the namespace default without that check.
        """
        allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
        with open(CC_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            before = allowed.read_text().split()
            try:
                if self.cc not in before:
                    allowed.write_text(" ".join([*before, self.cc]))
                self.run(ns, ["sysctl", "-q", "-w", f"net.ipv4.tcp_congestion_control={self.cc}"], check=True)
            finally:
                if self.cc not in before:
                    allowed.write_text(" ".join(before))
        got = self.congestion_control(ns)
        if got != self.cc:
            raise GeofedError(f"wan: TCP congestion control in {ns} is {got}, not {self.cc}")

    def _start_link(self, i: int, site: str, link: Link) -> None:
        ready = self.workdir / f"link-{i}.ready"
        ready.unlink(missing_ok=True)
        ps_dev, site_ns = f"wan{i}", self.site_ns(site)
        argv = [
            sys.executable, "-m", "geofed_hpc.testing.netem",
            "--a-netns", site_ns, "--a-dev", "wan", "--b-netns", self.ps_ns, "--b-dev", ps_dev,
            "--delay", f"{link.delay.total_seconds() * 1e3}", "--jitter", f"{link.jitter.total_seconds() * 1e3}",
            "--loss", f"{link.loss_pct}", "--rate", f"{link.rate_mbit}", "--queue", f"{link.queue_packets}",
            "--seed", f"{self.seed + i}", "--ready", str(ready), "--stats", str(self._stats_path(site)),
        ]  # fmt: skip
        log = open(self.workdir / f"link-{i}.log", "wb")  # noqa: SIM115 - the child owns it from here
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.forwarders[site] = proc
        deadline = time.monotonic() + READY_WAIT.total_seconds()
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.workdir / f"link-{i}.log").read_text(errors="replace")[-2000:]
                raise GeofedError(f"wan: the forwarder for {site} did not start: {tail}")
            time.sleep(0.05)
        for ns, dev, me, peer in ((self.ps_ns, ps_dev, self.ps_ip(site), self.site_ip(site)),
                                  (site_ns, "wan", self.site_ip(site), self.ps_ip(site))):  # fmt: skip
            _ip("-n", ns, "addr", "add", me, "peer", peer, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")

    def close(self) -> None:
        for proc in reversed(self.procs):
            _stop(proc, signal.SIGINT)  # `launch` cancels its site jobs on SIGINT
        for ns in self.namespaces:  # anything left inside (e.g. a job a killed launcher spawned): by PID
            for pid in _netns_pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.forwarders.values():
            _stop(proc, signal.SIGTERM)
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self.namespaces.clear()
        self.procs.clear()

    # ------------------------------------------------------------------ processes inside namespaces
    def popen(
        self, ns: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.Popen:
        """Start argv inside namespace `ns` (its own process group), output to `log`; ended by close()."""
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                cwd=cwd,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def run(
        self, ns: str, argv: Sequence[str], timeout: float = 60.0, check: bool = False
    ) -> subprocess.CompletedProcess:
        done = subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise GeofedError(f"wan: `{' '.join(argv)}` in {ns} failed: {done.stderr.strip() or done.stdout.strip()}")
        return done

    def congestion_control(self, ns: str) -> str:
        """The default TCP congestion control inside `ns` (net.ipv4.tcp_congestion_control is per namespace)."""
        return self.run(ns, ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"], check=True).stdout.strip()

    def socket_congestion_controls(self, ns: str, port: int) -> list[str]:
        """The congestion control of each established TCP connection on `port` inside `ns` (from `ss -ti`)."""
        out = self.run(ns, ["ss", "-tinH", "state", "established", f"( sport = :{port} or dport = :{port} )"]).stdout
        known = ("cubic", "bbr", "reno", "bic", "htcp", "vegas", "westwood", "dctcp")
        return [word for line in out.splitlines() for word in line.split() if word in known]

    # ------------------------------------------------------------------ the links
    def link_down(self, site: str) -> None:
        self._signal(site, signal.SIGUSR1)
        logger.info("wan: link %s down", site)

    def link_up(self, site: str) -> None:
        self._signal(site, signal.SIGUSR2)
        logger.info("wan: link %s up", site)

    def counters(self, site: str) -> dict[str, Any]:
        """Packets/bytes forwarded and dropped per direction ('up' = site->PS, 'down' = PS->site)."""
        path = self._stats_path(site)
        before = json.loads(path.read_text())["seq"]
        self._signal(site, signal.SIGHUP)
        deadline = time.monotonic() + READY_WAIT.total_seconds()
        while time.monotonic() < deadline:
            now = json.loads(path.read_text())
            if now["seq"] > before:
                return {"up": now["a_to_b"], "down": now["b_to_a"], "link_up": now["up"]}
            time.sleep(0.02)
        raise GeofedError(f"wan: the forwarder for {site} did not report its counters")

    def _signal(self, site: str, sig: signal.Signals) -> None:
        proc = self.forwarders[site]
        if proc.poll() is not None:
            raise GeofedError(f"wan: the forwarder for {site} exited with {proc.returncode}")
        proc.send_signal(sig)

    def _stats_path(self, site: str) -> Path:
        return self.workdir / f"link-{self._index(site)}.json"


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise GeofedError(f"wan: `ip {' '.join(args)}` failed: {done.stderr.strip()}")


def _netns_pids(ns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def _stop(proc: subprocess.Popen, first: signal.Signals) -> None:
    """Signal the process group we created for `proc`, then SIGKILL it if it outlives STOP_WAIT."""
    if proc.poll() is not None:
        return
    for sig in (first, signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(STOP_WAIT.total_seconds() / 2)
            return
        except subprocess.TimeoutExpired:
            continue
