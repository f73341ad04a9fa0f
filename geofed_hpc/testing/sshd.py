"""A real sshd (openssh-server, from Debian's packages) for tests and benchmarks of site.tunnel: its own host key,
one authorized client key, public keys only, in a folder of its own and optionally a network namespace."""

from __future__ import annotations

import getpass
import subprocess
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from geofed_hpc.errors import GeofedError
from geofed_hpc.testing.proxy import await_listening, serve, terminate

SSHD = Path("/usr/sbin/sshd")
START_WAIT = timedelta(seconds=10)
PRIVSEP_DIR = Path("/run/sshd")  # sshd refuses to start without it (Debian's init script makes it)


def sshd_unavailable() -> str:
    """Why no test sshd can run here ('' when it can)."""
    import shutil

    if not SSHD.is_file():
        return "openssh-server is not installed (`make install` installs it as root with apt-get)"
    if not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        return "the ssh client is not installed (openssh-client)"
    return ""


def keygen(path: Path) -> str:
    """A new ed25519 key pair at `path` (no passphrase; one there before is replaced); its public key line."""
    path.unlink(missing_ok=True)
    Path(f"{path}.pub").unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(path)], check=True)
    return Path(f"{path}.pub").read_text().strip()


@dataclass
class Sshd:
    """sshd on `listen`:`port` in `netns` ("": this namespace). After start(): `client_key` (the authorized private
    key), `known_hosts` (its host key under [listen]:port), `target` (user@listen:port for site.tunnel)."""

    folder: Path
    port: int
    listen: str = "127.0.0.1"
    netns: str = ""
    forwarding: bool = True
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def client_key(self) -> Path:
        return self.folder / "client_key"

    @property
    def known_hosts(self) -> Path:
        return self.folder / "known_hosts"

    @property
    def target(self) -> str:
        return f"{getpass.getuser()}@{self.listen}:{self.port}"

    def start(self) -> Sshd:
        why = sshd_unavailable()
        if why:
            raise GeofedError(why)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o700)
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        host_public = keygen(self.folder / "host_key")
        (self.folder / "authorized_keys").write_text(keygen(self.client_key) + "\n")
        self.known_hosts.write_text(f"[{self.listen}]:{self.port} {host_public}\n")
        conf = self.folder / "sshd_config"
        conf.write_text(
            "\n".join([
                f"Port {self.port}", f"ListenAddress {self.listen}", f"HostKey {self.folder / 'host_key'}",
                f"AuthorizedKeysFile {self.folder / 'authorized_keys'}", f"PidFile {self.folder / 'sshd.pid'}",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PubkeyAuthentication yes",
                "PermitRootLogin prohibit-password", "StrictModes no", "UsePAM no", "PermitTTY no",
                f"AllowTcpForwarding {'local' if self.forwarding else 'no'}", "X11Forwarding no",
                "AllowAgentForwarding no", "LogLevel VERBOSE",
            ]) + "\n"
        )  # fmt: skip
        with open(self.folder / "sshd.log", "wb") as log:
            self.proc = serve([str(SSHD), "-D", "-e", "-f", str(conf)], self.netns, log)
        await_listening(self.proc, self.port, START_WAIT, lambda: f"sshd did not start: {self.log()[-500:]}")
        return self

    def log(self) -> str:
        path = self.folder / "sshd.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """End sshd by its PID (its per-connection children end with their connections)."""
        terminate(self.proc)

    def __enter__(self) -> Sshd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
