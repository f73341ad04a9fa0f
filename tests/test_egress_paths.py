"""site.egress on a real topology (namespaces cloud, login, compute; a real `ps up` over TLS in `cloud`): a site in
`compute` reaches the PS by the first path that works (a real tinyproxy, `geofed-hpc relay`, an ssh tunnel to a real
sshd on `login`) and holds the same global versions as a site in `cloud`; a push cut by the proxy's or the relay's
death is applied once; `site check` from `compute` names the paths that work and the preflight refuses `direct`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from geofed_hpc.testing.proxy import TinyProxy, tinyproxy_binary
from geofed_hpc.testing.sshd import Sshd, sshd_unavailable
from geofed_hpc.testing.topology import ClusterNet
from tests.test_egress_topology import CLI, PS_PORT, REPO, Cluster, wait_for_line
from tests.test_egress_topology import cluster as cluster  # noqa: F401  (the module's fixture)

pytestmark = [pytest.mark.wan, pytest.mark.slow]
PROXY_PORT, RELAY_PORT, SSH_PORT = 3129, 50053, 2222
PS = f"{ClusterNet.CLOUD_IP}:{PS_PORT}"
NUMBER = {"proxy": 10, "relay": 20, "tunnel": 30}  # site names osc-N: what the enrollment token of `osc` admits
needs_proxy = pytest.mark.skipif(not tinyproxy_binary(), reason="tinyproxy is not installed (`make install`, root)")
needs_sshd = pytest.mark.skipif(bool(sshd_unavailable()), reason=sshd_unavailable() or "sshd is here")
# A site's client as the site job makes it: site.egress chooses the route (egress/paths.py), then Join and
# `push` (one delta, then the global model at the version it made), `pull` (the model at argv's version) or `cut`
# (half a push, held until the marker file appears, then the same push retried, and once more: a duplicate).
SITE = """
import hashlib, json, os, sys, time, uuid
from datetime import timedelta
import numpy as np
from geofed_hpc import codec
from geofed_hpc.config import CodecConfig, PSConfig, RunConfig, SiteConfig
from geofed_hpc.egress.paths import choose
from geofed_hpc.errors import GeofedError
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.guard import bearer
from geofed_hpc.rpc.stream import digest, to_chunks
from tests.conftest import small_params
from tests.test_ps_edge import Held

spec = json.loads(sys.argv[1])
fp32 = CodecConfig(name="fp32")
ps = PSConfig(insecure=False, ca_file=spec["ca"], address=spec["address"], rpc_timeout="20s", retry_budget="60s",
              connect_timeout="20s")
cfg = RunConfig(ps=ps, site=SiteConfig(**spec["site"]))
out = {}
try:
    with choose(cfg, spec["address"]) as route, route.connect() as client:
        out["path"] = route.path
        client.connect(timedelta(seconds=20))
        session = client.join(m.JoinRequest(spec["name"], spec["token"])).session_id
        version = client.heartbeat(m.HeartbeatRequest(session)).version
        if version == 0:
            init = m.PushHeader(session, 0, 0, 0, "fp32", 0, b"", "seed", init=True)
            client.push_delta(init, codec.encode(small_params(), fp32))
            version = client.heartbeat(m.HeartbeatRequest(session)).version
        delta = codec.encode({k: np.full_like(v, 1e-3) for k, v in small_params().items()}, fp32)
        header = m.PushHeader(session, version, 1, 1, "fp32", 0, b"", uuid.uuid4().hex)
        if spec["mode"] == "cut":
            header.total_bytes, header.sha256 = len(delta), digest(delta)
            cut = Held(client._calls["PushDelta"], list(to_chunks(header, delta, 64))[:2], bearer(session))
            assert cut.sent.wait(30)
            print("half-sent", flush=True)
            deadline = time.monotonic() + 120
            while not os.path.exists(spec["marker"]) and time.monotonic() < deadline:
                time.sleep(0.1)
            out["cut_ok"] = cut.code(timeout=60).name == "OK"
            cut.release.set()
            out["before"] = version
            out["after_cut"] = client.heartbeat(m.HeartbeatRequest(session)).version
            out["accepted"] = client.push_delta(header, delta).version
            out["again_duplicate"] = client.push_delta(header, delta).duplicate
        elif spec["mode"] == "push":
            version = client.push_delta(header, delta).version
        else:
            version = spec["version"]
        if spec["mode"] != "cut":
            head, model = client.pull_model(session, min_version=version)
            out.update(version=head.version, digest=hashlib.sha256(model).hexdigest())
except GeofedError as exc:
    out["error"] = str(exc)
print(json.dumps(out), flush=True)
"""


class Paths:
    """The cluster with a proxy, a relay and an sshd on `login`, each started on demand and stopped by PID."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster, self.net, self.where = cluster, cluster.net, cluster.where
        self.proxy: TinyProxy | None = None
        self.relay: subprocess.Popen | None = None
        self.sshd: Sshd | None = None
        self.runs = 0

    def start_proxy(self) -> TinyProxy:
        net = self.net
        folder, clients = self.where / f"proxy{self.runs}", f"{net.COMPUTE_IP}/32"
        admit = {"allow": (net.CLOUD_IP,), "ports": (PS_PORT,), "listen": net.LOGIN_IP, "clients": clients}
        self.proxy = TinyProxy(folder, PROXY_PORT, netns=net.ns("login"), **admit).start()  # type: ignore[arg-type]
        self.runs += 1
        return self.proxy

    def start_relay(self) -> subprocess.Popen:
        log = self.where / f"relay{self.runs}.log"
        self.runs += 1
        argv = [*CLI, "relay", "-v", "--to", PS, "--listen", f"{self.net.LOGIN_IP}:{RELAY_PORT}"]
        self.relay = self.net.popen("login", argv, log, cwd=REPO)
        wait_for_line(log, "relay on")
        return self.relay

    def start_sshd(self) -> Sshd:
        if self.sshd is None:
            self.sshd = Sshd(self.where / "sshd", SSH_PORT, listen=self.net.LOGIN_IP, netns=self.net.ns("login"))
            self.sshd.start()
        return self.sshd

    def site(self, path: str) -> dict[str, Any]:
        """site.* of a site in `compute` that tries direct first, then `path`."""
        net, site = self.net, {"egress": ["direct", path]}
        if path == "proxy":
            site["proxy"] = f"http://{net.LOGIN_IP}:{PROXY_PORT}"
        if path == "relay":
            site["relay"] = f"{net.LOGIN_IP}:{RELAY_PORT}"
        if path == "tunnel":
            sshd = self.start_sshd()
            site.update(tunnel=sshd.target, tunnel_identity=str(sshd.client_key),
                        tunnel_known_hosts=str(sshd.known_hosts))  # fmt: skip
        return site

    def spec(self, name: str, site: dict[str, Any], mode: str, **more: Any) -> str:
        pki = self.cluster.pki
        base = {"name": name, "token": self.cluster.token, "ca": str(pki / "ca.crt"), "address": PS, "site": site}
        return json.dumps({**base, "mode": mode, **more})

    def run(self, role: str, spec: str) -> dict[str, Any]:
        done = self.net.python(role, SITE, spec, env={"PYTHONPATH": str(REPO)}, timeout=150)
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self.relay is not None and self.relay.poll() is None:
            self.relay.terminate()
            self.relay.wait(timeout=30)
        if self.sshd is not None:
            self.sshd.stop()
            self.sshd = None


@pytest.fixture(scope="module")
def paths(cluster: Cluster) -> Iterator[Paths]:  # noqa: F811
    made = Paths(cluster)
    yield made
    made.stop()


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("proxy", marks=needs_proxy),
        "relay",
        pytest.param("tunnel", marks=needs_sshd),
    ],
)
def test_a_site_in_compute_holds_the_same_versions_as_a_site_in_cloud_through_each_path(
    paths: Paths, path: str
) -> None:
    stop: Any = None
    if path == "proxy":
        stop = paths.start_proxy().stop
    elif path == "relay":
        stop = paths.start_relay().terminate
    try:
        cloud = paths.run("cloud", paths.spec(f"osc-{NUMBER[path]}", {"egress": ["direct"]}, "push"))
        compute = paths.run("compute", paths.spec(f"osc-{NUMBER[path] + 1}", paths.site(path), "push"))
        assert "error" not in cloud and "error" not in compute, (cloud, compute)
        pull = paths.spec(f"osc-{NUMBER[path]}", {"egress": ["direct"]}, "pull", version=compute["version"])
        again = paths.run("cloud", pull)
    finally:
        if stop is not None:
            stop()
    assert cloud["path"] == "direct" and compute["path"] == path, (cloud, compute)
    assert compute["version"] == cloud["version"] + 1, (cloud, compute)  # the compute site's push went in, once
    assert (again["version"], again["digest"]) == (compute["version"], compute["digest"]), (again, compute)
    if path == "proxy":
        assert paths.proxy is not None and set(paths.proxy.requests()) == {("CONNECT", PS)}  # nothing else asked
    if path == "tunnel":
        assert paths.sshd is not None and "Accepted publickey" in paths.sshd.log()
        leftover = subprocess.run(["pgrep", "-f", f"127.0.0.1:.*:{ClusterNet.CLOUD_IP}:{PS_PORT}"], capture_output=True)
        assert leftover.stdout.strip() == b"", "the tunnel's ssh outlived the site"


@pytest.mark.parametrize("path", [pytest.param("proxy", marks=needs_proxy), "relay"])
def test_killing_the_proxy_or_relay_mid_push_loses_and_doubles_nothing(paths: Paths, path: str) -> None:
    marker = paths.where / f"go-{path}"
    log = paths.where / f"cut-{path}.log"
    start = paths.start_proxy if path == "proxy" else paths.start_relay
    start()
    spec = paths.spec(f"osc-{NUMBER[path] + 2}", paths.site(path), "cut", marker=str(marker))
    site = paths.net.popen("compute", [sys.executable, "-c", SITE, spec], log, env={"PYTHONPATH": str(REPO)})
    try:
        wait_for_line(log, "half-sent", 120)
        if path == "proxy":
            assert paths.proxy is not None and paths.proxy.proc is not None
            os.kill(paths.proxy.proc.pid, signal.SIGKILL)  # mid-push, by PID
            paths.proxy.proc.wait(timeout=10)
        else:
            assert paths.relay is not None
            os.kill(paths.relay.pid, signal.SIGKILL)
            paths.relay.wait(timeout=10)
        time.sleep(1)
        start()  # back on the same address
        marker.touch()
        site.wait(timeout=150)
    finally:
        paths.stop()
    out = json.loads(log.read_text().strip().splitlines()[-1])
    assert out["path"] == path and not out["cut_ok"], out
    assert out["after_cut"] == out["before"], out  # nothing of the cut push was applied
    assert out["accepted"] == out["before"] + 1 and out["again_duplicate"], out  # then once, however often retried


def _geofed(role: str, net: ClusterNet, *args: str) -> subprocess.CompletedProcess:
    argv = ["ip", "netns", "exec", net.ns(role), *CLI, *args]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=150, env={**os.environ})


@needs_sshd
def test_site_check_from_compute_names_the_working_paths_and_the_preflight_refuses_direct(paths: Paths) -> None:
    net, federation = paths.net, paths.cluster
    sshd = paths.start_sshd()
    run_dir = paths.where / "run"
    common = [
        "site=local", "site.embedded_ps=false", "site.egress=[direct]", f"site.tunnel={sshd.target}",
        f"site.tunnel_identity={sshd.client_key}", f"site.tunnel_known_hosts={sshd.known_hosts}",
        f"site.token={federation.token}", f"ps.address={PS}", "ps.insecure=false",
        f"ps.ca_file={federation.pki / 'ca.crt'}",
        f"run_dir={run_dir}", "wandb_mode=disabled",
    ]  # fmt: skip
    checked = _geofed("compute", net, "site", "check", *common)
    lines = checked.stdout
    assert "direct   does not work: nothing answers at 10.252.0.1:50051" in lines, lines + checked.stderr
    assert "tunnel   works: round trip" in lines and "(not in site.egress)" in lines, lines
    assert (run_dir / "egress-check.json").is_file()
    launch = _geofed("login", net, "launch", *common, "--dry-run")  # the login node reaches the PS; compute does not
    assert launch.returncode == 2, launch.stdout + launch.stderr
    said = launch.stderr + launch.stdout
    assert "site.egress: no path of [direct] reaches the PS from a compute node" in said, said
    assert "set site.egress=[tunnel]" in said, said
