"""A real HTTP CONNECT proxy (tinyproxy, from Debian's packages) for tests and benchmarks: it admits CONNECT only to
the hosts it is given, so nothing can leave the machine through it, and logs every request it gets."""

from __future__ import annotations

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
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _listening(pid: int, port: int) -> bool:
    """Process `pid` has a TCP socket listening on `port` in its network namespace (/proc/PID/net/tcp)."""
    try:
        rows = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(r.split()[1].endswith(f":{port:04X}") and r.split()[3] == "0A" for r in rows)
