"""Compute nodes that cannot dial out, as network namespaces (cloud, login, compute): a real `ps up` over TLS in
`cloud`; from `compute` a site's client finds no route to it, and reaches it through a real HTTP proxy on `login`
(tinyproxy, admitting CONNECT to the PS alone) and through `geofed-hpc relay` on `login`, each push applied once."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from geofed_hpc.ps.tokens import TokenFile, tokens_path
from geofed_hpc.testing.proxy import TinyProxy, tinyproxy_binary
from geofed_hpc.testing.topology import ClusterNet, unavailable_reason
from tests.test_tls import ps_init

pytestmark = [pytest.mark.wan, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]
PS_PORT, PROXY_PORT, RELAY_PORT = 50051, 3128, 50052
CLI = [sys.executable, "-m", "geofed_hpc.cli"]
# A site's client, as the site job runs it: connect, join with its token, push one delta; prints the PS's answer.
SITE = """
import json, sys, uuid
from datetime import timedelta
import numpy as np
from geofed_hpc import codec
from geofed_hpc.config import CodecConfig, PSConfig
from geofed_hpc.errors import GeofedError
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from tests.conftest import small_params

address, ca, token, site, tls_name = sys.argv[1:6]
fp32 = CodecConfig(name="fp32")
cfg = PSConfig(insecure=False, ca_file=ca, tls_name=tls_name, rpc_timeout="20s", retry_budget="5s")
try:
    with PSClient(cfg, address) as client:
        client.connect(timedelta(seconds=8))
        session = client.join(m.JoinRequest(site, token)).session_id
        version = client.heartbeat(m.HeartbeatRequest(session)).version
        if version == 0:  # the first site seeds the model
            init = m.PushHeader(session, 0, 0, 0, "fp32", 0, b"", "seed", init=True)
            client.push_delta(init, codec.encode(small_params(), fp32))
            version = client.heartbeat(m.HeartbeatRequest(session)).version
        delta = codec.encode({k: np.full_like(v, 1e-3) for k, v in small_params().items()}, fp32)
        reply = client.push_delta(m.PushHeader(session, version, 1, 1, "fp32", 0, b"", uuid.uuid4().hex), delta)
        print(json.dumps({"accepted": reply.accepted, "version": reply.version}))
except GeofedError as exc:
    print(json.dumps({"error": str(exc)}))
"""


class Cluster:
    """The namespaces, the PS in `cloud`, and how a site in `compute` fares."""

    def __init__(self, net: ClusterNet, where: Path) -> None:
        self.net, self.where = net, where
        self.pki, self.state = where / "pki", where / "state"
        assert ps_init(self.pki, f"ps.tls_names=[{net.CLOUD_IP}]") == 0
        self.token, _ = TokenFile(tokens_path(str(self.state))).issue("osc", timedelta(days=1))
        args = [f"ps.host={net.CLOUD_IP}", f"ps.port={PS_PORT}", f"ps.state_dir={self.state}", "ps.insecure=false"]
        args += [f"ps.cert_file={self.pki / 'server.crt'}", f"ps.key_file={self.pki / 'server.key'}"]
        args += ["ps.aggregation=async", "codec=fp32", "wandb_mode=disabled"]
        self.ps_log = where / "ps.log"
        net.popen("cloud", [*CLI, "ps", "up", *args], self.ps_log, cwd=REPO)
        wait_for_line(self.ps_log, "parameter server on")

    def site(self, address: str, name: str, tls_name: str = "", env: dict[str, str] | None = None) -> dict:
        done = self.net.python(
            "compute",
            SITE,
            address,
            str(self.pki / "ca.crt"),
            self.token,
            name,
            tls_name,
            env={"PYTHONPATH": str(REPO), **(env or {})},
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])


def wait_for_line(log: Path, text: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while text not in (log.read_text(errors="replace") if log.exists() else ""):
        assert time.monotonic() < deadline, f"no {text!r} in {log}: {log.read_text(errors='replace')[-2000:]}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    where = tmp_path_factory.mktemp("cluster")
    with ClusterNet(where / "net") as net:
        yield Cluster(net, where)


def test_a_compute_node_has_no_route_to_the_ps(cluster: Cluster) -> None:
    answer = cluster.site(f"{ClusterNet.CLOUD_IP}:{PS_PORT}", "osc-0")
    assert "cannot reach the parameter server at 10.252.0.1:50051" in answer.get("error", ""), answer


@pytest.mark.skipif(not tinyproxy_binary(), reason="tinyproxy is not installed (`make install` installs it as root)")
def test_a_compute_node_reaches_the_ps_through_a_proxy_on_the_login_node(cluster: Cluster) -> None:
    net = cluster.net
    proxy = TinyProxy(
        cluster.where / "proxy",
        PROXY_PORT,
        allow=(net.CLOUD_IP,),
        ports=(PS_PORT,),
        listen=net.LOGIN_IP,
        clients=f"{net.COMPUTE_IP}/32",
        netns=net.ns("login"),
    ).start()
    try:
        first = cluster.site(f"{net.CLOUD_IP}:{PS_PORT}", "osc-1", env={"grpc_proxy": proxy.url})
        second = cluster.site(f"{net.CLOUD_IP}:{PS_PORT}", "osc-2", env={"https_proxy": proxy.url})
    finally:
        proxy.stop()
    assert first["accepted"] and second["accepted"] and second["version"] == first["version"] + 1, (first, second)
    assert set(proxy.requests()) == {("CONNECT", f"{net.CLOUD_IP}:{PS_PORT}")}


def test_a_compute_node_reaches_the_ps_through_a_relay_on_the_login_node(cluster: Cluster) -> None:
    net = cluster.net
    log = cluster.where / "relay.log"
    to, listen = f"{net.CLOUD_IP}:{PS_PORT}", f"{net.LOGIN_IP}:{RELAY_PORT}"
    relay = net.popen("login", [*CLI, "relay", "-v", "--to", to, "--listen", listen], log, cwd=REPO)
    try:
        wait_for_line(log, "relay on")
        first = cluster.site(listen, "osc-3", tls_name=net.CLOUD_IP)
        second = cluster.site(listen, "osc-4", tls_name=net.CLOUD_IP)
    finally:
        relay.terminate()
        relay.wait(timeout=30)
    assert first["accepted"] and second["accepted"] and second["version"] == first["version"] + 1, (first, second)
    lines = log.read_text()
    assert f"relay: {net.COMPUTE_IP}:" in lines and f"-> {to} closed" in lines, lines
