"""Real HTTP CONNECT proxies (tinyproxy and squid, from Debian's packages) for tests and benchmarks: each admits
CONNECT only to the hosts and ports it is given, so nothing can leave the machine through it, and logs every request
it gets."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from geofed_hpc.errors import GeofedError

START_WAIT = timedelta(seconds=10)
_REQUEST = re.compile(r"Request \(file descriptor \d+\): (\w+) (\S+) HTTP")


def tinyproxy_binary() -> str:
    """The tinyproxy executable, or '' when it is not installed (`make install` installs it as root with apt)."""
    return shutil.which("tinyproxy") or next((p for p in ("/usr/bin/tinyproxy", "/usr/sbin/tinyproxy")
                                               if Path(p).is_file()), "")  # fmt: skip


@dataclass
class _Proxy:
    """What both proxies share: they listen on `listen`:`port` (in `netns`; "": this namespace), serve `clients` (an
    address or a subnet), and admit CONNECT only to the hosts `allow` and the ports `ports` (empty: any)."""

    folder: Path
    port: int
    allow: tuple[str, ...] = ("127.0.0.1",)
    ports: tuple[int, ...] = ()
    listen: str = "127.0.0.1"
    clients: str = "127.0.0.1"
    netns: str = ""
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.listen}:{self.port}"

    def _run(self, argv: list[str], wait: timedelta, problem: Callable[[], str]) -> None:
        """Start `argv` (inside `netns`) and wait until it listens on `port`; GeofedError with `problem()` if not."""
        with (self.folder / "stderr").open("w") as out:
            self.proc = serve(argv, self.netns, out)
        await_listening(self.proc, self.port, wait, lambda: f"{Path(argv[0]).name} did not start: {problem()}")

    def stop(self) -> None:
        terminate(self.proc)


def serve(argv: list[str], netns: str, out: IO[Any]) -> subprocess.Popen:
    """A server process for a test: `argv` in network namespace `netns` ("": this one), its output to `out`."""
    inside = ["ip", "netns", "exec", netns] if netns else []
    return subprocess.Popen([*inside, *argv], stdout=out, stderr=subprocess.STDOUT)


def await_listening(proc: subprocess.Popen, port: int, wait: timedelta, why: Callable[[], str]) -> None:
    """Wait until `proc` listens on `port`; when it exits or `wait` passes first: end it, GeofedError(why())."""
    deadline = time.monotonic() + wait.total_seconds()
    while not _listening(proc.pid, port):
        if proc.poll() is not None or time.monotonic() > deadline:
            terminate(proc)
            raise GeofedError(why())
        time.sleep(0.05)


def terminate(proc: subprocess.Popen | None) -> None:
    """End a server by its PID: SIGTERM (it writes its logs and leaves), then SIGKILL after 10 s."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@dataclass
class TinyProxy(_Proxy):
    """tinyproxy; `credentials`: "user:pass" it demands (Basic), or none."""

    credentials: str = ""

    @property
    def log_path(self) -> Path:
        return self.folder / "tinyproxy.log"

    def start(self) -> TinyProxy:
        binary = tinyproxy_binary()
        if not binary:
            raise GeofedError("tinyproxy is not installed: `apt-get install tinyproxy` (as root, `make install` does)")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o777)  # tinyproxy started by root writes its log as nobody
        hosts = self.folder / "allowed"
        hosts.write_text("".join(f"^{re.escape(h)}$\n" for h in self.allow))
        lines = [
            f"Port {self.port}",
            f"Listen {self.listen}",
            "Timeout 120",
            f'LogFile "{self.log_path}"',
            "LogLevel Connect",
            "MaxClients 64",
            f"Allow {self.clients}",
            f'Filter "{hosts}"',
            "FilterDefaultDeny Yes",  # the filter lists what is admitted: everything else is refused (403)
            "FilterType ere",
            *(f"ConnectPort {p}" for p in self.ports),
            *([f"BasicAuth {self.credentials.replace(':', ' ', 1)}"] if self.credentials else []),
        ]
        conf = self.folder / "tinyproxy.conf"
        conf.write_text("\n".join(lines) + "\n")
        self.log_path.touch(mode=0o666)
        self.log_path.chmod(0o666)
        self._run([binary, "-d", "-c", str(conf)], START_WAIT, lambda: _read(self.folder / "stderr")[-500:])
        return self

    def requests(self) -> list[tuple[str, str]]:
        """(method, target) of every request the proxy got, in order: ("CONNECT", "127.0.0.1:50051")."""
        return [(m.group(1), m.group(2)) for m in _REQUEST.finditer(_read(self.log_path))]


def squid_binary() -> str:
    """The squid executable, or '' when it is not installed (`make install` installs it as root with apt)."""
    return shutil.which("squid") or ("/usr/sbin/squid" if Path("/usr/sbin/squid").is_file() else "")


@dataclass
class Squid(_Proxy):
    """squid, the proxy most clusters' login nodes run, caching nothing: the same contract as TinyProxy."""

    @property
    def log_path(self) -> Path:
        return self.folder / "access.log"

    def start(self) -> Squid:
        binary = squid_binary()
        if not binary:
            raise GeofedError("squid is not installed: `apt-get install squid` (as root)")
        self.folder.mkdir(parents=True, exist_ok=True)
        # squid started by root drops to its own user, which writes the logs: it must reach the folder, so our
        # private folders above it (a temporary folder) get search permission for others, never read or write
        self.folder.chmod(0o777)
        for parent in self.folder.parents:
            if parent.stat().st_uid == os.getuid() and not parent.stat().st_mode & 0o001:
                parent.chmod(parent.stat().st_mode | 0o001)
        lines = [
            f"http_port {self.listen}:{self.port}",
            f"pid_filename {self.folder}/squid.pid",
            f"access_log stdio:{self.log_path}",
            f"cache_log {self.folder}/cache.log",
            "cache_store_log none",
            "cache deny all",
            "cache_mem 8 MB",
            f"coredump_dir {self.folder}",
            "shutdown_lifetime 1 seconds",
            f"acl clients src {self.clients}",
            f"acl targets dst {' '.join(self.allow)}",
            *([f"acl target_ports port {' '.join(map(str, self.ports))}"] if self.ports else []),
            "http_access deny !clients",
            "http_access deny CONNECT !targets",
            *(["http_access deny CONNECT !target_ports"] if self.ports else []),
            "http_access allow CONNECT",
            "http_access deny all",  # plain requests too: it is a tunnel to the PS, never an open proxy
        ]
        conf = self.folder / "squid.conf"
        conf.write_text("\n".join(lines) + "\n")

        def logs() -> str:
            return (_read(self.folder / "stderr") + _read(self.folder / "cache.log"))[-800:]

        self._run([binary, "-N", "-f", str(conf)], 3 * START_WAIT, logs)  # squid takes longer to start
        return self

    def requests(self) -> list[tuple[str, str]]:
        """(method, target) of every request the proxy answered, in order: ("CONNECT", "127.0.0.1:50051"); squid
        logs a tunnel when it closes, and all of them by the time stop() returns."""
        rows = [line.split() for line in _read(self.log_path).splitlines()]
        return [(r[5], r[6]) for r in rows if len(r) > 6]


def _read(path: Path) -> str:
    return path.read_bytes().decode("latin-1") if path.exists() else ""


def _listening(pid: int, port: int) -> bool:
    """Process `pid` has a TCP socket listening on `port` in its network namespace (/proc/PID/net/tcp)."""
    try:
        rows = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(r.split()[1].endswith(f":{port:04X}") and r.split()[3] == "0A" for r in rows)
