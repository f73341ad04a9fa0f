"""A two-site federation with one site on a compute node that cannot dial out (namespaces cloud, login, compute): the
real site job `geofed-hpc launch` runs, started inside `compute`, reaches a real `ps up` over TLS in `cloud` through a
real tinyproxy, `geofed-hpc relay`, an ssh tunnel to a real sshd, or the spool (each on `login`), while the other site
dials directly from `cloud`; both train in the same sync rounds, every push applied once, and the compute site ends
on the PS's model, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from geofed_hpc.metrics import read_jsonl
from geofed_hpc.testing.proxy import TinyProxy, tinyproxy_binary
from geofed_hpc.testing.sshd import Sshd, sshd_unavailable
from geofed_hpc.testing.topology import ClusterNet, unavailable_reason
from tests.test_tls import ps_init

pytestmark = [pytest.mark.wan, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "geofed_hpc.cli"]
PS_PORT, PROXY_PORT, RELAY_PORT, SSH_PORT = 50061, 3131, 50063, 2223
PS = f"{ClusterNet.CLOUD_IP}:{PS_PORT}"
QUIET = {"WANDB_MODE": "disabled", "GRPC_VERBOSITY": "ERROR", "PYTHONUNBUFFERED": "1"}
SYNCS = 2
TINY = [
    "model=tiny", "model.d_model=8", "model.n_heads=2", "model.n_layers=1", "model.d_ff=32", "model.context=32",
]  # fmt: skip
# The PS's model as a site would pull it (a session of its own, left at once): its version and digest.
PS_MODEL = """
import json, sys
from datetime import timedelta
from geofed_hpc import codec
from geofed_hpc.config import PSConfig
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
with PSClient(PSConfig(insecure=False, ca_file=sys.argv[2]), sys.argv[1]) as client:
    client.connect(timedelta(seconds=30))
    status = client.status()
    version, digest = status.version, ""
    if status.initialized:
        session = client.join(m.JoinRequest(sys.argv[3], "")).session_id
        head, model = client.pull_model(session, min_version=status.version)
        client.heartbeat(m.HeartbeatRequest(session, head.version, leaving=True))
        version, digest = head.version, (head.model_digest or codec.model_digest(codec.decode(model))).hex()
    pushes = {s.site: s.pushes for s in status.sites}
    print(json.dumps({"version": version, "digest": digest, "pushes": pushes, "status_version": status.version}))
"""


def wait_for_line(log: Path, text: str, proc: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while text not in (log.read_text(errors="replace") if log.exists() else ""):
        said = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        assert proc.poll() is None, f"{log.name} ended ({proc.returncode}) before {text!r}: {said}"
        assert time.monotonic() < deadline, f"no {text!r} in {log}: {said}"
        time.sleep(0.2)


class Federation:
    """The namespaces, the PS in `cloud`, and the paths on `login` (each started once, when a test first needs it)."""

    def __init__(self, net: ClusterNet, where: Path) -> None:
        self.net, self.where = net, where
        self.pki = where / "pki"
        assert ps_init(self.pki, f"ps.tls_names=[{net.CLOUD_IP}]") == 0
        self.tls = ["ps.insecure=false", f"ps.ca_file={self.pki / 'ca.crt'}"]
        self.proxy: TinyProxy | None = None
        self.sshd: Sshd | None = None
        self.started: set[str] = set()
        argv = [*CLI, "ps", "up", *self.common(), f"ps.host={net.CLOUD_IP}", f"ps.port={PS_PORT}"]
        argv += [f"ps.cert_file={self.pki / 'server.crt'}", f"ps.key_file={self.pki / 'server.key'}"]
        argv += [f"ps.state_dir={where / 'ps'}", "ps.aggregation=sync", "ps.min_sites=2", "ps.round_timeout=90s"]
        log = where / "ps.log"
        wait_for_line(log, "parameter server on", net.popen("cloud", argv, log, env=QUIET, cwd=where))

    def common(self) -> list[str]:
        return [*TINY, "codec=int8", "wandb_mode=disabled", "train.sync_interval=2s", *self.tls]  # the PS sets the pace

    def start(self, path: str) -> list[str]:
        """What runs on `login` for `path`, started once; the site.* settings of a site in `compute` using it."""
        net, login = self.net, self.net.LOGIN_IP
        if path == "proxy":
            if self.proxy is None:
                folder, clients, inside = self.where / "proxy", f"{net.COMPUTE_IP}/32", net.ns("login")
                self.proxy = TinyProxy(folder, PROXY_PORT, (net.CLOUD_IP,), (PS_PORT,), login, clients, inside)
                self.proxy.start()
            return [f"site.proxy=http://{login}:{PROXY_PORT}"]
        if path == "tunnel":
            if self.sshd is None:
                self.sshd = Sshd(self.where / "sshd", SSH_PORT, listen=login, netns=net.ns("login")).start()
            sshd = self.sshd
            return [f"site.tunnel={sshd.target}", f"site.tunnel_identity={sshd.client_key}",
                    f"site.tunnel_known_hosts={sshd.known_hosts}"]  # fmt: skip
        spool = self.where / "spool"
        if path not in self.started:
            self.started.add(path)
            log = self.where / f"{path}-relay.log"
            if path == "relay":
                argv = [*CLI, "relay", "-v", "--to", PS, "--listen", f"{login}:{RELAY_PORT}"]
            else:
                spool.mkdir(mode=0o700)
                argv = [*CLI, "relay", "-v", "--spool", str(spool), "--poll", "50ms", "--to", PS, *self.tls]
            wait_for_line(log, "relay on", net.popen("login", argv, log, env=QUIET, cwd=self.where))
        if path == "relay":
            return [f"site.relay={login}:{RELAY_PORT}"]
        return [f"site.spool={spool}", "site.spool_poll=100ms"]

    def launch(self, role: str, name: str, shard: int, *site: str, dry_run: bool = False) -> subprocess.Popen:
        """`geofed-hpc launch` of one local site inside `role`'s namespace: the site job the command runs (with
        `dry_run`: what it would run, the PS probed)."""
        train = [f"train.max_syncs={SYNCS}", "train.batch_size=4", "data.max_tokens=20000"]
        train += ["data.val_batches=1", f"data.cache_dir={self.where / 'cache'}", "federation=egress"]
        argv = [*CLI, "launch", "site=local", f"site.name={name}", "site.num_sites=1", "site.embedded_ps=false"]
        argv += [f"site.first_shard={shard}", "site.shard_count=2", f"ps.address={PS}", *self.common(), *train]
        argv += [*site, f"run_dir={self.where / name}", *(["--dry-run"] if dry_run else [])]
        return self.net.popen(role, argv, self.where / f"{name}.log", env=QUIET, cwd=self.where)

    def ps_model(self, checker: str) -> dict[str, Any]:
        done = self.net.python("cloud", PS_MODEL, PS, str(self.pki / "ca.crt"), checker, env={"PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stdout + done.stderr
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self.sshd is not None:
            self.sshd.stop()


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    where = tmp_path_factory.mktemp("egress-sites")
    with ClusterNet(where / "net") as net:  # its close() ends the PS, the relays and the sites by PID
        made = Federation(net, where)
        try:
            yield made
        finally:
            made.stop()


def events(run_dir: Path, site: str, kind: str) -> list[dict[str, Any]]:
    path = run_dir / "sites" / site / "events.jsonl"
    found = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [e for e in found if e.get("event") == kind]


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("proxy", marks=pytest.mark.skipif(not tinyproxy_binary(), reason="tinyproxy is not installed")),
        "relay",
        pytest.param("tunnel", marks=pytest.mark.skipif(bool(sshd_unavailable()), reason=sshd_unavailable() or "-")),
        "spool",
    ],
)
def test_a_site_in_compute_trains_to_the_same_versions_as_one_in_cloud(federation: Federation, path: str) -> None:
    before = federation.ps_model(f"before{path}")
    site = federation.start(path)
    names = {"cloud": f"cloud{path}", "compute": f"compute{path}"}
    procs = {
        "cloud": federation.launch("cloud", names["cloud"], 0, "site.egress=[direct]"),
        "compute": federation.launch("compute", names["compute"], 1, f"site.egress=[{path}]", *site),
    }
    deadline = time.monotonic() + 240
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    logs = "".join(f"--- {n}\n{(federation.where / f'{n}.log').read_text()[-3000:]}" for n in names.values())
    assert {role: p.poll() for role, p in procs.items()} == {"cloud": 0, "compute": 0}, logs
    after = federation.ps_model(f"after{path}")
    jobs = {role: f"{name}-0" for role, name in names.items()}
    pulled = {}
    for role, job in jobs.items():
        run_dir = federation.where / names[role]
        syncs = [r for r in read_jsonl(run_dir / "metrics" / f"{job}.metrics.jsonl") if "train/loss" in r]
        assert len(syncs) == SYNCS, (role, syncs)  # it trained, and synced SYNCS times
        took = json.loads((run_dir / "sites" / job / "egress.json").read_text())
        assert took["path"] == ("direct" if role == "cloud" else path), took
        said = "".join(f.read_text(errors="replace") for f in run_dir.glob("submitit/*/*_0_log.err"))  # the job's log
        assert f"egress: reaching the parameter server by {took['path']} (" in said, said[-3000:]
        pulled[role] = [(e["version"], e["digest"]) for e in events(run_dir, job, "pulled")]
    # the PS applied one version per sync round, each round holding one push of each site, none applied twice
    assert after["version"] == before["version"] + SYNCS, (before, after)
    assert {j: after["pushes"].get(j) for j in jobs.values()} == {j: SYNCS for j in jobs.values()}, after
    # and both sites hold the PS's model of the last version, bit for bit
    final = (after["version"], after["digest"])
    assert pulled["compute"][-1] == final and pulled["cloud"][-1] == final, (pulled, final)
    if path == "proxy":  # the proxy was asked for the PS and nothing else (offline means offline)
        assert federation.proxy is not None and set(federation.proxy.requests()) == {("CONNECT", PS)}
    if path == "tunnel":  # the job's ssh ended with it
        left = subprocess.run(["pgrep", "-f", f"127.0.0.1:[0-9]+:{ClusterNet.CLOUD_IP}:{PS_PORT}"], capture_output=True)
        assert left.stdout.strip() == b"", "the tunnel's ssh outlived the site job"


def test_a_dry_run_in_compute_probes_the_ps_along_site_egress(federation: Federation) -> None:
    """`launch site=local --dry-run` where the jobs would run: the PS is probed as they would reach it, by the relay
    from `compute`; with direct, which `compute` has no route for, the preflight refuses in one line."""
    site = federation.start("relay")
    said = {}
    for egress in ("relay", "direct"):
        proc = federation.launch("compute", f"dry{egress}", 0, f"site.egress=[{egress}]", *site, dry_run=True)
        code = proc.wait(timeout=120)
        said[egress] = (code, (federation.where / f"dry{egress}.log").read_text(errors="replace"))
    code, out = said["relay"]
    assert code == 0 and f"{PS} answers by relay (site.egress), round trip" in out, out
    code, out = said["direct"]
    assert code != 0 and "geofed-hpc: error:" in out and PS in out, out
