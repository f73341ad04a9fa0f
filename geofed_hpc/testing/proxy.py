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
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from geofed_hpc.errors import GeofedError

START_WAIT = timedelta(seconds=10)
_REQUEST = re.compile(r"Request \(file descriptor \d+\): (\w+) (\S+) HTTP")


def tinyproxy_binary() -> str:
    """The tinyproxy executable, or '' when it is not installed (`make install` installs it as root with apt)."""
    return shutil.which("tinyproxy") or next((p for p in ("/usr/bin/tinyproxy", "/usr/sbin/tinyproxy")
                                               if Path(p).is_file()), "")  # fmt: skip


@dataclass
class TinyProxy:
    """tinyproxy on 127.0.0.1:`port`, in its own folder. `allow`: the only hosts CONNECT may reach; `ports`: the
    only ports CONNECT may reach (empty: any); `credentials`: "user:pass" it demands (Basic), or none."""

    folder: Path
    port: int
    allow: tuple[str, ...] = ("127.0.0.1",)
    ports: tuple[int, ...] = ()
    credentials: str = ""
    listen: str = "127.0.0.1"
    clients: str = "127.0.0.1"  # the addresses it serves (tinyproxy's Allow: an address or a subnet)
    netns: str = ""  # the network namespace it runs in ("": this one)
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.listen}:{self.port}"

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
        out = (self.folder / "stderr").open("w")
        inside = ["ip", "netns", "exec", self.netns] if self.netns else []
        self.proc = subprocess.Popen([*inside, binary, "-d", "-c", str(conf)], stdout=out, stderr=subprocess.STDOUT)
        out.close()
        deadline = time.monotonic() + START_WAIT.total_seconds()
        while not _listening(self.proc.pid, self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise GeofedError(f"tinyproxy did not start: {(self.folder / 'stderr').read_text()[-500:]}")
            time.sleep(0.05)
        return self

    def _log(self) -> str:
        return self.log_path.read_bytes().decode("latin-1") if self.log_path.exists() else ""

    def requests(self) -> list[tuple[str, str]]:
        """(method, target) of every request the proxy got, in order: ("CONNECT", "127.0.0.1:50051")."""
        return [(m.group(1), m.group(2)) for m in _REQUEST.finditer(self._log())]

    def stop(self) -> None:
        _terminate(self.proc)


def squid_binary() -> str:
    """The squid executable, or '' when it is not installed (`make install` installs it as root with apt)."""
    return shutil.which("squid") or ("/usr/sbin/squid" if Path("/usr/sbin/squid").is_file() else "")


@dataclass
class Squid:
    """squid, the proxy most clusters' login nodes run, on `listen`:`port` in its own folder, caching nothing: the
    same contract as TinyProxy (CONNECT only to `allow` and `ports`, from `clients`, in `netns`)."""

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

    @property
    def log_path(self) -> Path:
        return self.folder / "access.log"

    def start(self) -> Squid:
        binary = squid_binary()
        if not binary:
            raise GeofedError("squid is not installed: `apt-get install squid` (as root)")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o777)  # squid started by root drops to its own user, which writes the logs: it must
        for parent in self.folder.parents:  # reach the folder, so private folders above it (a temporary
            if parent.stat().st_uid == os.getuid() and not parent.stat().st_mode & 0o001:  # folder) get search
                parent.chmod(parent.stat().st_mode | 0o001)  # permission, never read or write
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
        out = (self.folder / "stderr").open("w")
        inside = ["ip", "netns", "exec", self.netns] if self.netns else []
        self.proc = subprocess.Popen([*inside, binary, "-N", "-f", str(conf)], stdout=out, stderr=subprocess.STDOUT)
        out.close()
        deadline = time.monotonic() + 3 * START_WAIT.total_seconds()
        while not _listening(self.proc.pid, self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                logs = (self.folder / "stderr").read_text() + _read(self.folder / "cache.log")
                raise GeofedError(f"squid did not start: {logs[-800:]}")
            time.sleep(0.05)
        return self

    def requests(self) -> list[tuple[str, str]]:
        """(method, target) of every request the proxy answered, in order: ("CONNECT", "127.0.0.1:50051"); squid
        logs a tunnel when it closes, and all of them by the time stop() returns."""
        rows = [line.split() for line in _read(self.log_path).splitlines()]
        return [(r[5], r[6]) for r in rows if len(r) > 6]

    def stop(self) -> None:
        _terminate(self.proc)


def _terminate(proc: subprocess.Popen | None) -> None:
    """SIGTERM (both proxies write their logs and leave), then SIGKILL after 10 s."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _read(path: Path) -> str:
    return path.read_bytes().decode("latin-1") if path.exists() else ""


def _listening(pid: int, port: int) -> bool:
    """Process `pid` has a TCP socket listening on `port` in its network namespace (/proc/PID/net/tcp)."""
    try:
        rows = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(r.split()[1].endswith(f":{port:04X}") and r.split()[3] == "0A" for r in rows)
