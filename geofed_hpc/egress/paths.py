"""The path a site's job takes to its PS (site.egress): the first of direct, proxy, relay, tunnel, spool that works.

Each path has an opener in PATHS: (cfg, PS address, timeout) -> a Route (what the rpc client dials and how), or
UnavailableError saying in one line why that path does not work here. `register_path` adds one (the spool does,
from its own module). `choose` tries site.egress in order and returns the first Route whose PS answers.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from geofed_hpc.ckpt.atomic import atomic_write_bytes
from geofed_hpc.config import PSConfig, RunConfig
from geofed_hpc.config.fields import split_host_port
from geofed_hpc.egress.relay import RELAY_FILE
from geofed_hpc.errors import ConfigError, GeofedError, UnavailableError
from geofed_hpc.log import logger
from geofed_hpc.rpc.proxy import Proxy, parse_proxy, proxy_for, tunnel

# How long a path may take to answer before the next one is tried (a single configured path gets ps.connect_timeout).
PROBE_TIMEOUT = timedelta(seconds=10)


@dataclass
class Route:
    """How to reach the PS along one path: the address the rpc client dials, the PS settings it dials with (ps.tls_name
    set to the PS's host when it dials a relay or a tunnel), gRPC channel options put before the usual ones, a factory
    for a client other than PSClient (the spool), and `close` to end what the path started (the tunnel's ssh)."""

    path: str
    address: str
    ps: PSConfig
    options: list[tuple[str, Any]] = field(default_factory=list)
    detail: str = ""
    client: Callable[[Route], Any] | None = None
    close: Callable[[], None] = lambda: None

    def connect(self) -> Any:
        """A client for this route (PSClient, or what the path's factory makes); not yet connected."""
        if self.client is not None:
            return self.client(self)
        from geofed_hpc.rpc.client import PSClient

        return PSClient(self.ps, self.address, options=self.options)

    def describe(self) -> str:
        return f"{self.path} ({self.detail})" if self.detail else self.path

    def __enter__(self) -> Route:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Opener = Callable[[RunConfig, str, timedelta], Route]
Probe = Callable[[Route, RunConfig, timedelta], float]
PATHS: dict[str, tuple[Opener, Probe | None]] = {}
# Paths built in a module of their own, imported when site.egress names them (the module calls register_path).
PLUGINS = {"spool": "geofed_hpc.egress.spool"}


def register_path(name: str, opener: Opener, probe: Probe | None = None) -> None:
    """Add (or replace) a path: `opener` makes its Route; `probe` returns the PS's round-trip seconds along it
    (default: connect, then one Health call)."""
    PATHS[name] = (opener, probe)


def _lookup(name: str) -> tuple[Opener, Probe | None]:
    if name not in PATHS and name in PLUGINS:
        try:
            importlib.import_module(PLUGINS[name])
        except ImportError as exc:
            raise UnavailableError(f"site.egress: the {name} path is not available in this install ({exc})") from None
    if name not in PATHS:
        raise ConfigError(f"site.egress: unknown path {name!r}; known: {', '.join([*PATHS, *PLUGINS])}")
    return PATHS[name]


def _ps_host_port(address: str) -> tuple[str, int]:
    try:
        return split_host_port(address.split(",")[0].strip())
    except ValueError as exc:
        raise ConfigError(f"ps.address: {exc}") from None


def _through(cfg: RunConfig, address: str) -> PSConfig:
    """PS settings for dialling something other than the PS (relay, tunnel): its certificate is still the PS's."""
    host, _ = _ps_host_port(address)
    return replace(cfg.ps, tls_name=cfg.ps.tls_name or host)


def open_direct(cfg: RunConfig, address: str, timeout: timedelta) -> Route:
    # gRPC would otherwise take https_proxy/grpc_proxy from the environment: direct means no proxy
    return Route("direct", address, cfg.ps, [("grpc.enable_http_proxy", 0)], detail=address)


def _first_reachable(address: str, dial: Callable[[str, int], None]) -> None:
    """`dial` each PS of a comma-separated ps.address in turn until one answers (a group whose first peer is down
    is still reachable); UnavailableError naming each that did not, when none does."""
    failed: list[str] = []
    for one in (a.strip() for a in address.split(",") if a.strip()):
        try:
            dial(*_ps_host_port(one))
            return
        except OSError as exc:
            failed.append(f"nothing answers at {one} from here ({exc.strerror or exc})")
        except UnavailableError as exc:
            failed.append(str(exc))
    # each reason once: a proxy that does not answer is said once, not once a PS
    raise UnavailableError("; ".join(dict.fromkeys(failed)) or f"ps.address {address!r} names no PS")


def probe_direct(route: Route, cfg: RunConfig, timeout: timedelta) -> float:
    """A TCP connection first (no route, refused: said at once), then the default probe."""

    def dial(host: str, port: int) -> None:
        socket.create_connection((host, port), timeout=timeout.total_seconds()).close()

    _first_reachable(route.address, dial)
    return default_probe(route, cfg, timeout)


def _proxy_of(cfg: RunConfig, host: str) -> tuple[Proxy, str]:
    proxy = parse_proxy(cfg.site.proxy) if cfg.site.proxy else proxy_for(host)
    if proxy is None:
        raise UnavailableError("site.proxy is empty (and no https_proxy/grpc_proxy here): no proxy to try")
    url = cfg.site.proxy or os.environ.get("grpc_proxy") or os.environ.get("https_proxy") or proxy.shown
    return proxy, url


def open_proxy(cfg: RunConfig, address: str, timeout: timedelta) -> Route:
    proxy, url = _proxy_of(cfg, _ps_host_port(address)[0])
    return Route("proxy", address, cfg.ps, [("grpc.http_proxy", url)], detail=proxy.shown)


def probe_proxy(route: Route, cfg: RunConfig, timeout: timedelta) -> float:
    """One CONNECT by hand first (a refusal or a request for credentials: one line saying so), then the default."""

    def dial(host: str, port: int) -> None:
        tunnel(_proxy_of(cfg, host)[0], host, port, timeout).close()

    _first_reachable(route.address, dial)
    return default_probe(route, cfg, timeout)


def relay_address(cfg: RunConfig, timeout: timedelta) -> str:
    """site.relay, or for site.relay=job where the relay job listens (its file in the run directory, waited for)."""
    if cfg.site.relay != "job":
        return cfg.site.relay
    path = Path(cfg.run_dir).expanduser() / RELAY_FILE
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            return str(json.loads(path.read_text())["listen"])
        except (OSError, ValueError, KeyError, TypeError):
            if time.monotonic() >= deadline:
                raise UnavailableError(
                    f"site.relay=job: no relay job has written {path} yet: is it queued on site.relay_partition "
                    "(`squeue --me`)?"
                ) from None
            time.sleep(0.5)


def open_relay(cfg: RunConfig, address: str, timeout: timedelta) -> Route:
    if not cfg.site.relay:
        raise UnavailableError("site.relay is empty: give HOST:PORT of a `geofed-hpc relay`, or job")
    where = relay_address(cfg, timeout)
    options: list[tuple[str, Any]] = [("grpc.enable_http_proxy", 0)]
    return Route("relay", where, _through(cfg, address), options, detail=f"{where} -> {address}")


def open_tunnel(cfg: RunConfig, address: str, timeout: timedelta) -> Route:
    from geofed_hpc.egress.tunnel import SshTunnel

    site = cfg.site
    if not site.tunnel:
        raise UnavailableError("site.tunnel is empty: give USER@LOGIN_HOST for an ssh tunnel")
    host, port = _ps_host_port(address)
    ssh = SshTunnel(site.tunnel, host, port, site.tunnel_identity, site.tunnel_known_hosts).start(timeout)
    options: list[tuple[str, Any]] = [("grpc.enable_http_proxy", 0)]
    detail = f"ssh -L {ssh.address} via {site.tunnel}"
    return Route("tunnel", ssh.address, _through(cfg, address), options, detail=detail, close=ssh.stop)


register_path("direct", open_direct, probe_direct)
register_path("proxy", open_proxy, probe_proxy)
register_path("relay", open_relay)
register_path("tunnel", open_tunnel)


def default_probe(route: Route, cfg: RunConfig, timeout: timedelta) -> float:
    """Seconds of one Health call along `route`, after the PS answered within `timeout`; UnavailableError if not."""
    with route.connect() as client:
        client.connect(timeout)
        started = time.monotonic()
        client.health()
        return time.monotonic() - started


def try_path(name: str, cfg: RunConfig, address: str, timeout: timedelta) -> tuple[Route, float]:
    """Open path `name` and measure the PS's round trip along it; the route stays open (close it)."""
    opener, probe = _lookup(name)
    route = opener(cfg, address, timeout)
    try:
        return route, (probe or default_probe)(route, cfg, timeout)
    except BaseException:
        route.close()
        raise


def choose(cfg: RunConfig, address: str | None) -> Route:
    """The first path of site.egress along which the PS answers. A single path is taken without a probe, and so is
    the first one that opens when none answers (a PS still starting): the client's connect then waits for the PS
    as usual, and says why it does not answer."""
    address = address or cfg.ps.address or cfg.ps.dial_address()
    order = cfg.site.egress
    if len(order) == 1:
        route = _lookup(order[0])[0](cfg, address, cfg.ps.connect_timeout)
        logger.info("egress: reaching the parameter server by %s", route.describe())
        return route
    failed: list[str] = []
    for name in order:
        try:
            route, rtt = try_path(name, cfg, address, min(cfg.ps.connect_timeout, PROBE_TIMEOUT))
        except GeofedError as exc:
            logger.info("egress: %s does not reach the parameter server: %s", name, exc)
            failed.append(f"{name}: {exc}")
            continue
        logger.info("egress: reaching the parameter server by %s (round trip %.0f ms)", route.describe(), rtt * 1e3)
        return route
    logger.warning("egress: no path of site.egress reaches the parameter server yet: %s", "; ".join(failed))
    for name in order:
        try:
            route = _lookup(name)[0](cfg, address, cfg.ps.connect_timeout)
        except GeofedError:
            continue
        logger.info("egress: reaching the parameter server by %s (waiting for it to answer)", route.describe())
        return route
    raise UnavailableError(f"no path of site.egress={order} to the parameter server at {address}: {'; '.join(failed)}")


def record(run_dir: Path, site: str, route: Route) -> None:
    """Write which path `site` took into <run_dir>/sites/<site>/egress.json (for `geofed-hpc status`), atomically."""
    folder = run_dir / "sites" / site
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(
            folder / "egress.json", json.dumps({"path": route.path, "detail": route.detail, "at": time.time()}).encode()
        )
    except OSError as exc:
        logger.warning("egress: cannot record the path in %s: %s", folder, exc)


def recorded(run_dir: Path) -> dict[str, dict[str, Any]]:
    """{site: {"path", "detail", "at"}} for every site of the run directory that recorded its path."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted((run_dir / "sites").glob("*/egress.json")):
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(value, dict):  # a file of the run directory: shown bounded and printable
            shown = {k: "".join(c if c.isprintable() else "?" for c in str(v))[:200] for k, v in value.items()}
            found[path.parent.name] = shown
    return found


def announce(rec: Any, route: Route) -> None:
    """The path in a site's metrics (a metrics.Recorder): its JSONL file, and its W&B run's config and summary."""
    rec.log({"egress/path": route.path, "egress/detail": route.detail})
    run = getattr(rec, "wandb_run", None)
    if run is not None:
        run.config.update({"egress_path": route.path, "egress_detail": route.detail}, allow_val_change=True)
        run.summary["egress/path"] = route.path
