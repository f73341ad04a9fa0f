"""A federation across an emulated WAN, as users run it: `ps up` in the PS namespace, `launch` in each site's."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from geofed_hpc.errors import GeofedError
from geofed_hpc.metrics import read_jsonl
from geofed_hpc.testing.wan import Wan

PS_PORT = 50051
PS_START_WAIT = timedelta(seconds=60)
CLI = [sys.executable, "-m", "geofed_hpc.cli"]
# A model small enough that CUBIC at 1% loss (about 1 Mbit/s on these links) moves it in seconds: ~0.4M
# parameters, nearly all of them GPT-2's vocabulary embedding.
TINY = [
    "model=tiny", "model.d_model=8", "model.n_heads=2", "model.n_layers=1", "model.d_ff=32", "model.context=32",
]  # fmt: skip
STATUS = """
import dataclasses, json, sys
from geofed_hpc.config import PSConfig
from geofed_hpc.rpc.client import PSClient
with PSClient(PSConfig(insecure=False, ca_file=sys.argv[2]), sys.argv[1]) as client:
    print(json.dumps(dataclasses.asdict(client.status())))
"""
QUIET = {"WANDB_SILENT": "true", "WANDB_MODE": "disabled", "GRPC_VERBOSITY": "ERROR", "PYTHONUNBUFFERED": "1"}


@dataclass
class WanFederation:
    """The PS and its sites, all inside `wan`'s namespaces, over TLS with certificates from `ps init`."""

    wan: Wan
    workdir: Path
    codec: str = "int8"
    sync_interval: str = "2s"
    max_syncs: int = 3
    extra: list[str] = field(default_factory=list)
    ps: subprocess.Popen | None = None
    sites: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def pki(self) -> Path:
        return self.workdir / "pki"

    def common(self) -> list[str]:
        return [
            *TINY,
            f"codec={self.codec}",
            f"train.sync_interval={self.sync_interval}",
            f"train.max_syncs={self.max_syncs}",
            "train.batch_size=4",
            "data.max_tokens=20000",
            "data.val_batches=1",
            f"data.cache_dir={self.workdir / 'cache'}",
            "wandb_mode=disabled",
            "federation=wan",
            "ps.insecure=false",
            f"ps.ca_file={self.pki / 'ca.crt'}",
            *self.extra,
        ]

    def init_tls(self) -> None:
        names = ",".join(self.wan.ps_ips())
        argv = [*CLI, "ps", "init", f"ps.ca_file={self.pki / 'ca.crt'}", f"ps.cert_file={self.pki / 'server.crt'}"]
        argv += [f"ps.key_file={self.pki / 'server.key'}", f"ps.tls_names=[{names}]"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise GeofedError(f"ps init failed: {done.stderr.strip()}")

    def start_ps(self, *overrides: str) -> None:
        """`geofed-hpc ps up` inside the PS namespace, listening on every link's PS address."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not (self.pki / "server.crt").exists():
            self.init_tls()
        log = self.workdir / "ps.log"
        argv = [*CLI, "ps", "up", *self.common(), "ps.host=0.0.0.0", f"ps.port={PS_PORT}", "ps.aggregation=async"]
        argv += [f"ps.cert_file={self.pki / 'server.crt'}", f"ps.key_file={self.pki / 'server.key'}"]
        argv += [f"ps.state_dir={self.workdir / 'ps'}", *overrides]
        self.ps = self.wan.popen(self.wan.ps_ns, argv, log, env=QUIET, cwd=self.workdir)
        deadline = time.monotonic() + PS_START_WAIT.total_seconds()
        while "parameter server on" not in log.read_text(errors="replace"):
            if self.ps.poll() is not None or time.monotonic() > deadline:
                raise GeofedError(f"ps up did not start (exit {self.ps.poll()}): {tail(log)}")
            time.sleep(0.2)

    def launch(self, site: str, *overrides: str) -> subprocess.Popen:
        """`geofed-hpc launch` of one local site named `site`, inside its namespace, dialling the PS over its link."""
        argv = [*CLI, "launch", "site=local", f"site.name={site}", "site.num_sites=1", "site.embedded_ps=false"]
        argv += [*self.common(), f"ps.address={self.wan.ps_ip(site)}:{PS_PORT}", f"run_dir={self.run_dir(site)}"]
        argv += list(overrides)
        proc = self.wan.popen(self.wan.site_ns(site), argv, self.workdir / f"{site}.log", env=QUIET, cwd=self.workdir)
        self.sites[site] = proc
        return proc

    def run_dir(self, site: str) -> Path:
        return self.workdir / "sites" / site

    def records(self, site: str) -> list[dict[str, Any]]:
        """The site's metrics records (its one process is `<site>-0`)."""
        path = self.run_dir(site) / "metrics" / f"{site}-0.metrics.jsonl"
        return read_jsonl(path) if path.exists() else []

    def syncs(self, site: str) -> list[dict[str, Any]]:
        return [r for r in self.records(site) if "train/loss" in r]

    def wait(self, timeout: timedelta, poll: Any = None) -> dict[str, int]:
        """Wait for every launched site to exit (calling `poll()` meanwhile); their exit codes."""
        deadline = time.monotonic() + timeout.total_seconds()
        while any(p.poll() is None for p in self.sites.values()):
            if time.monotonic() > deadline:
                raise GeofedError(f"sites still running after {timeout}: {self.logs()}")
            if poll is not None:
                poll()
            time.sleep(0.5)
        return {s: int(p.returncode) for s, p in self.sites.items()}

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{tail(p)}" for p in sorted(self.workdir.glob("*.log")))

    def status(self) -> dict[str, Any]:
        """The PS's Status reply as a dict, asked from inside the PS namespace (it crosses no emulated link)."""
        site = next(iter(self.wan.links))
        argv = [sys.executable, "-c", STATUS, f"{self.wan.ps_ip(site)}:{PS_PORT}", str(self.pki / "ca.crt")]
        done = self.wan.run(self.wan.ps_ns, argv, timeout=120)
        if done.returncode != 0:
            raise GeofedError(f"status failed: {done.stderr.strip()[-2000:]}")
        reply: dict[str, Any] = json.loads(done.stdout)
        return reply


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"({exc})"
