"""A site that reaches its PS only through an HTTP proxy: a real tinyproxy (and squid) that admits CONNECT to the PS
alone, a real `ps up` over TLS, the site's own client; a proxy that refuses the port or wants credentials is one line
saying what to do; a whole local federation with W&B offline asks the proxy for nothing but its PS."""

from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from geofed_hpc.config import RunConfig, SiteConfig
from geofed_hpc.config.run import shareable
from geofed_hpc.errors import UnavailableError
from geofed_hpc.launch.jobs import print_logs
from geofed_hpc.launch.manifest import JobRecord
from geofed_hpc.log import hide_passwords
from geofed_hpc.rpc.proxy import parse_proxy, proxy_for
from geofed_hpc.testing.proxy import Squid, TinyProxy, squid_binary, tinyproxy_binary
from tests.dist_util import free_port
from tests.test_launch_slurm import cli, login_env
from tests.test_ps_edge import EdgePS, legit_push

REPO = Path(__file__).resolve().parents[1]
needs_proxy = pytest.mark.skipif(
    not tinyproxy_binary(),
    reason="tinyproxy is not installed (`make install` installs it as root where apt-get is available)",
)
NO_SQUID = "squid is not installed (`make install` installs it as root where apt-get is available)"
# the proxies a cluster's login node runs: each test of the path through one runs with both
KINDS = [
    pytest.param(TinyProxy, marks=needs_proxy, id="tinyproxy"),
    pytest.param(Squid, marks=pytest.mark.skipif(not squid_binary(), reason=NO_SQUID), id="squid"),
]
PROXY_ENV = ("grpc_proxy", "https_proxy", "http_proxy", "no_grpc_proxy", "no_proxy", "HTTPS_PROXY", "HTTP_PROXY")


@pytest.fixture
def proxied(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[TinyProxy]]:
    """Proxies a test starts (`start(...)` appends); the site's environment points at the last one started."""
    for name in PROXY_ENV:
        monkeypatch.delenv(name, raising=False)
    started: list[TinyProxy] = []
    yield started
    for proxy in started:
        proxy.stop()


def start(
    started: list[TinyProxy],
    folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    url: str = "",
    kind: type = TinyProxy,
    **kw: object,
) -> TinyProxy:
    proxy = kind(folder / f"proxy{len(started)}", free_port(), **kw).start()
    started.append(proxy)
    monkeypatch.setenv("grpc_proxy", url or proxy.url)  # what the batch script exports from site.proxy
    return proxy


@pytest.mark.parametrize("kind", KINDS)
def test_a_site_reaches_its_ps_through_a_proxy_that_admits_only_the_ps(
    tls_ps: EdgePS, proxied: list[TinyProxy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: type
) -> None:
    proxy = start(proxied, tmp_path, monkeypatch, kind=kind, ports=(tls_ps.port,))
    with tls_ps.client() as client:
        client.connect(timedelta(seconds=30))
        session = tls_ps.joined(client, "osc-1").session_id
        assert legit_push(client, session).accepted
        header, payload = client.pull_model(session)
        assert header.version >= 1 and payload
    proxy.stop()  # squid logs a tunnel when it closes
    tunnels = proxy.requests()
    assert tunnels and set(tunnels) == {("CONNECT", f"127.0.0.1:{tls_ps.port}")}  # TLS inside: the proxy saw no more


@pytest.mark.parametrize("kind", KINDS)
def test_a_proxy_that_allows_only_port_443_is_named_at_once_with_the_fix(
    tls_ps: EdgePS, proxied: list[TinyProxy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: type
) -> None:
    proxy = start(proxied, tmp_path, monkeypatch, kind=kind, ports=(443,))
    with tls_ps.client() as client, pytest.raises(UnavailableError) as info:
        client.connect(timedelta(seconds=60))
    why = str(info.value)
    assert f"the proxy {proxy.url} refused CONNECT to port {tls_ps.port} (403" in why
    assert "ps.port=443" in why and "no more connection attempts" in why  # not 60 s of retries first


@needs_proxy
def test_a_proxy_that_wants_credentials_says_so_and_takes_them_from_site_proxy(
    tls_ps: EdgePS, proxied: list[TinyProxy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = start(proxied, tmp_path, monkeypatch, credentials="osc:s3cret")
    with tls_ps.client() as client, pytest.raises(UnavailableError) as info:
        client.connect(timedelta(seconds=60))
    assert f"the proxy {proxy.url} asks for credentials (407" in str(info.value)
    assert f"site.proxy=http://USER:PASS@127.0.0.1:{proxy.port}" in str(info.value)

    monkeypatch.setenv("grpc_proxy", f"http://osc:wrong@127.0.0.1:{proxy.port}")
    with tls_ps.client() as client, pytest.raises(UnavailableError) as info:
        client.connect(timedelta(seconds=60))
    assert "refused the credentials of site.proxy (40" in str(info.value) and "wrong" not in str(info.value)

    monkeypatch.setenv("grpc_proxy", f"http://osc:s3cret@127.0.0.1:{proxy.port}")
    with tls_ps.client() as client:
        client.connect(timedelta(seconds=30))
        assert legit_push(client, tls_ps.joined(client, "osc-2").session_id).accepted
    assert ("CONNECT", f"127.0.0.1:{tls_ps.port}") in proxy.requests()


@needs_proxy
def test_an_offline_federation_asks_the_proxy_for_its_ps_and_nothing_else(
    proxied: list[TinyProxy], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = start(proxied, tmp_path, monkeypatch)  # any port, host 127.0.0.1 only: nothing leaves the machine
    run_dir = tmp_path / "run"
    env = {**os.environ, "https_proxy": proxy.url, "http_proxy": proxy.url, "WANDB_SILENT": "true"}
    env.pop("WANDB_MODE", None)
    args = ["launch", "site=local", "model=tiny", "site.num_sites=1", f"run_dir={run_dir}", "wandb_mode=offline"]
    args += ["site.egress=[proxy]"]  # the PS is on this machine: [direct, proxy] would take direct
    args += ["train.max_syncs=1", "train.sync_interval=2s", "data.max_tokens=20000", "data.val_batches=1"]
    args += [f"data.cache_dir={tmp_path / 'cache'}"]
    done = subprocess.run(
        [sys.executable, "-m", "geofed_hpc.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(run_dir.rglob("offline-run-*")), "W&B wrote no offline run"
    took = [json.loads(f.read_text()) for f in run_dir.rglob("egress.json")]  # the path each site took, for status
    assert [t["path"] for t in took] == ["proxy"], took
    logged = "".join(f.read_text() for f in run_dir.rglob("*.metrics.jsonl"))
    assert '"egress/path": "proxy"' in logged, logged[-2000:]  # the site's metrics (and W&B run) say it too
    targets = {target for _, target in proxy.requests()}
    assert targets, "the sites did not go through the proxy"
    assert {t.rsplit(":", 1)[0] for t in targets} == {"127.0.0.1"}, targets  # the PS, never W&B or a model hub
    assert len({t.rsplit(":", 1)[1] for t in targets}) == 1, targets


def test_the_proxy_is_read_from_the_environment_as_grpc_reads_it() -> None:
    env = {"https_proxy": "http://a:1", "grpc_proxy": "http://u:p%40ss@proxy.example:3128", "no_proxy": ".internal"}
    chosen = proxy_for("ps.example.org", env)
    assert chosen is not None and (chosen.host, chosen.port, chosen.user, chosen.password) == (
        "proxy.example",
        3128,
        "u",
        "p@ss",
    )
    assert chosen.shown == "http://u:***@proxy.example:3128"  # messages never carry the password
    assert proxy_for("ps.internal", env) is None and proxy_for("internal", env) is None
    assert proxy_for("ps.example.org", {"no_grpc_proxy": "*", "grpc_proxy": "http://a:1"}) is None
    assert proxy_for("ps.example.org", {}) is None
    assert parse_proxy("socks5://a:1") is None and parse_proxy("http://h") == parse_proxy("h:80")


def test_what_a_run_shares_with_wandb_carries_no_secret() -> None:
    cfg = RunConfig(site=SiteConfig(token="gft_site_secret", proxy="http://osc:s3cret@proxy.example:3128"))
    shared = str(shareable(cfg))
    assert "gft_site_secret" not in shared and "s3cret" not in shared
    assert "http://osc:(hidden)@proxy.example:3128" in shared
    with pytest.raises(Exception) as info:
        SiteConfig(proxy="http://osc:s3cret@proxy example:3128")
    assert "s3cret" not in str(info.value)


def test_launch_and_logs_show_the_proxy_password_as_stars(tmp_path: Path) -> None:
    proxy = "site.proxy=http://bob:s3cret@proxy.example.org:3128"
    args = ["launch", "site=osc", "ps.address=vm.example.org:50051", proxy, "--dry-run", "--no-ps-check"]
    result = cli(args, tmp_path, **login_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "s3cret" not in result.stdout + result.stderr
    assert "export https_proxy=http://bob:***@proxy.example.org:3128 " in result.stdout  # the batch file it shows
    quoted = "export https_proxy=" + shlex.quote("http://bob:it's$ecret@proxy.example.org:3128") + " grpc_proxy=x"
    assert hide_passwords(quoted) == "export https_proxy='http://bob:***@proxy.example.org:3128' grpc_proxy=x"
    log = tmp_path / "job.out"
    log.write_text("egress: reaching the parameter server by proxy (http://bob:s3cret@proxy.example.org:3128)\n")
    shown = io.StringIO()
    print_logs({"osc-0": JobRecord("osc-0", "7", "osc", "slurm", str(log), str(tmp_path / "job.err"))}, out=shown)
    assert "s3cret" not in shown.getvalue() and "(http://bob:***@proxy.example.org:3128)" in shown.getvalue()
