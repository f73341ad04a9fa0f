"""`site.tunnel`: the job's own `ssh -N -L` to a login node, with the user's keys, ended with the job (PID, kernel)."""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from geofed_hpc.errors import ConfigError, UnavailableError
from geofed_hpc.log import logger

START_TIMEOUT = timedelta(seconds=20)
STOP_TIMEOUT = timedelta(seconds=5)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
SAID_MAX = 200  # characters of ssh's last line repeated in an error


def parse_target(value: str) -> tuple[str, str, int]:
    """USER@HOST[:PORT] -> (user, host, port)."""
    match = re.fullmatch(r"(?P<user>[^@\s]+)@(?P<host>[^:@\s]+)(?::(?P<port>\d{1,5}))?", value)
    if not match:
        raise ConfigError(f"site.tunnel: expected USER@LOGIN_HOST[:SSH_PORT], got {value!r}")
    return match.group("user"), match.group("host"), int(match.group("port") or 22)


def ssh_command(
    target: str, local_port: int, ps_host: str, ps_port: int, identity: str = "", known_hosts: str = ""
) -> list[str]:
    """The ssh command line of a tunnel from 127.0.0.1:local_port to ps_host:ps_port through `target` (pure)."""
    user, host, port = parse_target(target)
    forward = f"127.0.0.1:{local_port}:{f'[{ps_host}]' if ':' in ps_host else ps_host}:{ps_port}"
    argv = ["ssh", "-N", "-T", "-p", str(port), "-L", forward]
    options = ["BatchMode=yes", "ExitOnForwardFailure=yes", "StrictHostKeyChecking=yes", "ServerAliveInterval=30",
               "ServerAliveCountMax=3", "ConnectTimeout=15"]  # fmt: skip
    if known_hosts:
        options.append(f"UserKnownHostsFile={Path(known_hosts).expanduser()}")
    for option in options:
        argv += ["-o", option]
    if identity:
        argv += ["-i", str(Path(identity).expanduser()), "-o", "IdentitiesOnly=yes"]
    return [*argv, f"{user}@{host}"]


def explain(said: str, target: str) -> str:
    """ssh's error output as one line that says what to do."""
    lines = [ln.strip() for ln in said.splitlines() if ln.strip() and not ln.startswith("@@@")]
    last = "".join(c if c.isprintable() else "?" for c in (lines[-1] if lines else "ssh ended"))[:SAID_MAX]
    user, host, port = parse_target(target)
    once = f"ssh -p {port} {user}@{host}" if port != 22 else f"ssh {user}@{host}"
    key = host if port == 22 else f"'[{host}]:{port}'"
    if "IDENTIFICATION HAS CHANGED" in said or "Host key for" in said and "has changed" in said:
        return (
            f"site.tunnel: the host key of {host} does not match the one in known_hosts (ssh refused it: someone may "
            f"be in between, or the login node was reinstalled); check it with the cluster's admins, then "
            f"`ssh-keygen -R {key}` and `{once}` once to accept the new one"
        )
    if "Host key verification failed" in said or "No " in said and "host key is known" in said:
        return (
            f"site.tunnel: the host key of {host} is not in known_hosts (site.tunnel_known_hosts or "
            f"~/.ssh/known_hosts): run `{once}` once where the job runs and accept it ({last})"
        )
    if "Permission denied" in said:
        return (
            f"site.tunnel: {target} refused the key (BatchMode: no password prompts): give a key without passphrase "
            f"in site.tunnel_identity or an ssh-agent, and its public key in {host}'s ~/.ssh/authorized_keys ({last})"
        )
    if "forwarding" in said.lower():
        why = f"site.tunnel: {host} refused the port forward to the parameter server ({last}): "
        return why + "ask its admins to allow TCP forwarding"
    return f"site.tunnel: ssh to {target} failed: {last}"


def dies_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that has the kernel send the child SIGTERM when this process dies, however it dies (a job
    SIGKILLed by Slurm or the OOM killer leaves no ssh behind): Linux's prctl(PR_SET_PDEATHSIG). None elsewhere, and
    off the main thread (the signal follows the thread that started the child, and a worker thread may end first):
    then `stop`, at exit too, ends ssh."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above: nobody would be told
            os._exit(1)

    return preexec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@dataclass
class SshTunnel:
    """`ssh -N -L 127.0.0.1:PORT:ps_host:ps_port target`; `start()` returns once the local port answers; `stop()`
    ends ssh by its PID (also at exit of this process)."""

    target: str
    ps_host: str
    ps_port: int
    identity: str = ""
    known_hosts: str = ""
    local_port: int = 0
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.local_port}"

    def start(self, timeout: timedelta = START_TIMEOUT) -> SshTunnel:
        if not shutil.which("ssh"):
            raise UnavailableError("site.tunnel: no ssh client on this node (install openssh-client, or drop tunnel)")
        self.local_port = self.local_port or _free_port()
        argv = ssh_command(self.target, self.local_port, self.ps_host, self.ps_port, self.identity, self.known_hosts)
        with tempfile.TemporaryFile() as err:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=dies_with_parent()
            )
            atexit.register(self.stop)
            deadline = time.monotonic() + timeout.total_seconds()
            while not _answers(self.local_port):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    err.seek(0)
                    said = err.read().decode(errors="replace")
                    if not said.strip():
                        said = f"no tunnel after {timeout.total_seconds():g}s"
                    raise UnavailableError(explain(said, self.target))
                time.sleep(0.1)
        logger.info("tunnel: ssh (pid %d) forwards %s to %s:%d via %s", self.proc.pid, self.address,
                    self.ps_host, self.ps_port, self.target)  # fmt: skip
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """End ssh by its PID: SIGTERM, then SIGKILL."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT.total_seconds())
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            logger.info("tunnel: ssh (pid %d) to %s ended", proc.pid, self.target)

    def __enter__(self) -> SshTunnel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
