"""The PS group's rendezvous: a TCP store, each peer's identity proven with the shared secret, a gloo group."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar, cast

import torch.distributed as dist

from geofed_hpc.config import PSConfig, RunConfig, to_dict
from geofed_hpc.config.fields import split_host_port
from geofed_hpc.errors import ConfigError, MismatchError, UnavailableError
from geofed_hpc.log import logger, quote
from geofed_hpc.ps.group.collectives import Group, PeerLost
from geofed_hpc.rpc.channel import listening
from geofed_hpc.rpc.listen import listen_socket, self_dial

T = TypeVar("T")

POLL = timedelta(milliseconds=50)
NONCE = "gen0/nonce"  # the store's nonce, which every hello proves the shared secret over
PROBE = timedelta(seconds=1)  # how long a look for a listening store may take (a plain TCP connect, before a store
# client, which would retry a refused connection until its timeout)
WILDCARDS = ("", "*", "0.0.0.0", "::")  # a ps.host that listens on every interface
BACKLOG = 128  # of the store's listening socket until its server listens on it (torch then sets its own)


def _build() -> str:
    """The installed geofed-hpc version ("unknown" when it runs from a tree that was never installed)."""
    try:
        return metadata.version("geofed-hpc")
    except metadata.PackageNotFoundError:
        return "unknown"


def identity(cfg: RunConfig) -> dict[str, Any]:
    """What peers must agree on to keep one model: the geofed-hpc version, model, paradigm, codecs, aggregation,
    outer optimizer and peer list."""
    ps = cfg.ps
    return {
        "geofed_hpc": _build(),
        "model": to_dict(cfg.model),
        "paradigm": cfg.paradigm.describe(),
        "codec": cfg.codec.name,
        "peer_codec": ps.peer_codec,
        "aggregation": [ps.aggregation, ps.peer_sync_interval.total_seconds(), ps.max_staleness],
        "outer_optimizer": [ps.outer_optimizer, ps.global_lr, ps.momentum, ps.weighting],
        "peers": list(ps.peers),
    }


def store_address(cfg: PSConfig, rank: int) -> tuple[str, int]:
    """Where peer `rank` serves the group's TCP store when it is the group's server: peer 0 at the rendezvous
    (ps.peer_rendezvous, else its port + 1); any other peer, once it succeeds a server that died, at its host and
    port + 1."""
    if rank == 0 and cfg.peer_rendezvous:
        return split_host_port(cfg.peer_rendezvous)
    host, port = split_host_port(cfg.peers[rank])
    return host, port + 1


def peer_secret(cfg: PSConfig) -> bytes:
    """The group's shared secret: ps.peer_secret, else the first line of ps.peer_secret_file ("": none)."""
    if cfg.peer_secret and cfg.peer_secret_file:
        raise ConfigError("ps.peer_secret_file: set either ps.peer_secret or ps.peer_secret_file, not both")
    if not cfg.peer_secret_file:
        return cfg.peer_secret.encode()
    path = Path(cfg.peer_secret_file).expanduser()
    try:
        return path.read_text().splitlines()[0].strip().encode() if path.stat().st_size else b""
    except OSError as exc:
        raise ConfigError(f"ps.peer_secret_file: cannot read {path}: {exc.strerror or exc}") from None


def _proof(secret: bytes, nonce: bytes, identity: bytes) -> str:
    return hmac.new(secret, nonce + identity, hashlib.sha256).hexdigest()


def _describe(key: str, value: Any, other: Any) -> str:
    """`value` as the error shows it: for a dict, only the fields where it differs from `other`."""
    if isinstance(value, dict) and isinstance(other, dict):
        diff = {k: value.get(k) for k in sorted(set(value) | set(other)) if value.get(k) != other.get(k)}
        name = value.get("name", "")
        return f"{key} {name} {json.dumps(diff)}" if name else f"{key} {json.dumps(diff)}"
    return f"{key} {json.dumps(value)}"


def check_identities(cfg: PSConfig, mine: dict[str, Any], theirs: dict[int, dict[str, Any]]) -> None:
    """MismatchError naming both sides when a peer runs another model, paradigm, codec or peer list."""
    me = f"this PS (peer {cfg.peer_rank}, {cfg.peers[cfg.peer_rank]})"
    for rank, identity in sorted(theirs.items()):
        peer = f"peer {rank} ({cfg.peers[rank]})"
        for key in mine:
            if identity.get(key) != mine[key]:
                raise MismatchError(
                    f"refused at the PS group's rendezvous: {peer} has {_describe(key, identity.get(key), mine[key])}"
                    f", {me} has {_describe(key, mine[key], identity.get(key))}: every peer must run the same "
                    "model, paradigm, codec and ps.peers list"
                )


def _wait_keys(store: dist.Store, keys: dict[int, str], timeout: timedelta, what: str, cfg: PSConfig) -> None:
    """Wait until every key is set; UnavailableError naming the peers that never came."""
    deadline = time.monotonic() + timeout.total_seconds()
    missing = dict(keys)
    while missing:
        missing = {r: k for r, k in missing.items() if not _read(store, cfg, partial(store.check, [k]))}
        if not missing:
            return
        if time.monotonic() > deadline:
            names = ", ".join(f"peer {r} ({cfg.peers[r]})" for r in sorted(missing))
            raise UnavailableError(
                f"the PS group did not form: {names} did not {what} within {timeout.total_seconds():g}s "
                "(ps.peer_timeout); is it started, with the same ps.peers, and reachable?"
            )
        time.sleep(POLL.total_seconds())


def _read(store: dist.Store, cfg: PSConfig, call: Callable[[], T]) -> T:
    """A call on the rendezvous store; UnavailableError when the peer serving it went away meanwhile (it refused
    this group, or stopped: its log says why)."""
    try:
        return call()
    except RuntimeError as exc:  # torch's DistNetworkError, DistStoreError
        host, port = store_address(cfg, 0)
        raise UnavailableError(
            f"the PS group did not form: the rendezvous store at {show(host, port)} (peer 0, {cfg.peers[0]}) went "
            f"away ({str(exc).splitlines()[0][:120]}): see why in peer 0's log, fix it and start every peer again"
        ) from None


def listen_host(cfg: PSConfig) -> str:
    """Where the group's store listens when this PS serves it: ps.host, where the PS itself listens (a wildcard
    there, 0.0.0.0 or ::, listens on every interface)."""
    return cfg.host.strip("[]")


def gloo_host(cfg: PSConfig) -> str:
    """The one address this PS's gloo connections listen on; gloo also tells the peers to dial it there: ps.host,
    or, when ps.host is a wildcard (gloo cannot listen on one), this PS's host in ps.peers."""
    host = listen_host(cfg)
    return split_host_port(cfg.peers[cfg.peer_rank])[0] if host in WILDCARDS else host


def show(host: str, port: int) -> str:
    """host:port as a log line shows it ([ipv6]:port)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def check_listen(cfg: PSConfig) -> None:
    """ConfigError when the store this PS may serve would listen where its peers cannot dial it: ps.host a loopback
    address while ps.peers (or ps.peer_rendezvous, for peer 0) names this PS by an IP address of another interface."""
    if not _loopback(listen_host(cfg)):
        return
    dialed = [("ps.peers", split_host_port(cfg.peers[cfg.peer_rank])[0])]
    if cfg.peer_rank == 0 and cfg.peer_rendezvous:
        dialed.append(("ps.peer_rendezvous", store_address(cfg, 0)[0]))
    for setting, host in dialed:
        if _literal(host) and not _loopback(host):
            raise ConfigError(
                f"ps.host: the PS group's store listens where this PS does, on {cfg.host} only, but {setting} has "
                f"its peers dial it at {host}: set ps.host={host} (or 0.0.0.0 to listen on every interface)"
            )


def _same_socket(fd: int, inode: int) -> bool:
    try:
        return os.fstat(fd).st_ino == inode
    except OSError:
        return False


def serve(cfg: PSConfig, port: int) -> tuple[dist.Store, str]:
    """A TCP store server listening on ps.host:`port` only, and where it listens. torch's own server listens on
    every interface whatever host it is given (its TCPStoreOptions carry no host), so the socket is bound here and
    handed to it (master_listen_fd), which then owns and closes it. OSError / RuntimeError when it cannot."""
    sock = listen_socket(listen_host(cfg), port, BACKLOG)
    fd = sock.fileno()
    inode = os.fstat(fd).st_ino
    where = show(*sock.getsockname()[:2])
    try:
        store = dist.TCPStore(
            self_dial(sock),
            port,
            len(cfg.peers),
            True,
            timeout=cfg.peer_timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
            use_libuv=True,
        )
    except BaseException:
        if _same_socket(fd, inode):  # the store never took it
            sock.close()
        else:
            sock.detach()
        raise
    sock.detach()  # the store's server owns the socket now
    return store, where


def open_store(cfg: PSConfig) -> dist.Store:
    """Peer 0 serves the group's TCP store (listening on ps.host only); the others connect to it (waiting up to
    ps.peer_timeout)."""
    host, port = store_address(cfg, 0)  # the rendezvous
    master = cfg.peer_rank == 0
    try:
        if master:
            store, where = serve(cfg, port)
            logger.info(
                "PS group: this PS (peer 0) serves the group's store, listening on %s (its peers dial %s)",
                where,
                show(host, port),
            )
            return store
        return dist.TCPStore(
            host, port, len(cfg.peers), False, timeout=cfg.peer_timeout, wait_for_workers=False, use_libuv=True
        )
    except (RuntimeError, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if master:
            raise UnavailableError(
                f"peer 0 cannot serve the PS group's rendezvous on {show(listen_host(cfg), port)} (ps.host, the "
                f"rendezvous port): {first}"
            ) from None
        raise UnavailableError(
            f"the PS group's rendezvous on {show(host, port)} (served by peer 0, {cfg.peers[0]}) did not answer "
            f"within {cfg.peer_timeout.total_seconds():g}s (ps.peer_timeout): {first}"
        ) from None


def serve_store(cfg: PSConfig) -> tuple[dist.Store, str]:
    """This peer serves a TCP store on ps.host at its store_address's port (a new server of a running group), and
    where it listens."""
    _, port = store_address(cfg, cfg.peer_rank)
    try:
        return serve(cfg, port)
    except (RuntimeError, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UnavailableError(
            f"peer {cfg.peer_rank} cannot serve the PS group's store on {show(listen_host(cfg), port)} (ps.host, "
            f"its port + 1): {first}"
        ) from None


def store_client(cfg: PSConfig, rank: int, wait: timedelta) -> dist.Store | None:
    """A client of the store peer `rank` serves, once something listens there within `wait` (None: nothing
    does, or it is not a store)."""
    host, port = store_address(cfg, rank)
    deadline = time.monotonic() + wait.total_seconds()
    while not listening(host, port, PROBE):
        if time.monotonic() > deadline:
            return None
        time.sleep(POLL.total_seconds())
    try:
        return dist.TCPStore(
            host, port, len(cfg.peers), False, timeout=cfg.peer_timeout, wait_for_workers=False, use_libuv=True
        )
    except (RuntimeError, OSError):
        return None


def hello(cfg: PSConfig, identity: dict[str, Any], nonce: bytes) -> str:
    """What this peer shows at the rendezvous: its identity and proof that it knows the shared secret."""
    body = json.dumps(identity, sort_keys=True).encode()
    return json.dumps({"identity": identity, "proof": _proof(peer_secret(cfg), nonce, body)})


def check_hello(cfg: PSConfig, identity: dict[str, Any], rank: int, raw: bytes, nonce: bytes) -> None:
    """MismatchError naming peer `rank` and this PS when its hello lacks the secret or shows another identity."""
    try:
        got = json.loads(raw)
        expected = _proof(peer_secret(cfg), nonce, json.dumps(got["identity"], sort_keys=True).encode())
    except (ValueError, TypeError, KeyError):
        raise MismatchError(
            f"refused at the PS group's rendezvous: peer {rank} ({cfg.peers[rank]}) sent no hello this PS (peer "
            f"{cfg.peer_rank}) can read: {quote(raw)}"
        ) from None
    if not hmac.compare_digest(expected.encode(), str(got.get("proof", "")).encode()):
        raise MismatchError(
            f"refused at the PS group's rendezvous: peer {rank} ({cfg.peers[rank]}) does not prove the shared "
            f"secret this PS (peer {cfg.peer_rank}) holds: set the same ps.peer_secret (or ps.peer_secret_file) "
            "on every peer"
        )
    check_identities(cfg, identity, {rank: got["identity"]})


def meet(cfg: PSConfig, identity: dict[str, Any], store: dist.Store) -> None:
    """Every peer proves it knows the shared secret and shows what it runs; a peer that differs is refused, named."""
    if cfg.peer_rank == 0:
        store.set(NONCE, os.urandom(16).hex())
    _wait_keys(store, {0: NONCE}, cfg.peer_timeout, "open the rendezvous", cfg)
    nonce = _read(store, cfg, lambda: store.get(NONCE))
    _read(store, cfg, lambda: store.set(f"gen0/hello/{cfg.peer_rank}", hello(cfg, identity, nonce)))
    others = {r: f"gen0/hello/{r}" for r in range(len(cfg.peers)) if r != cfg.peer_rank}
    _wait_keys(store, others, cfg.peer_timeout, "arrive at the rendezvous", cfg)
    hellos = {rank: _read(store, cfg, partial(store.get, key)) for rank, key in others.items()}
    _read(store, cfg, lambda: store.set(f"gen0/read/{cfg.peer_rank}", "1"))
    if cfg.peer_rank == 0:  # it serves the store: every peer has read the hellos before it may refuse and leave
        reads = {r: f"gen0/read/{r}" for r in others}
        _wait_keys(store, reads, cfg.peer_timeout, "read the others' hellos", cfg)
    for rank, raw in hellos.items():
        check_hello(cfg, identity, rank, raw, nonce)


def gloo_group(store: dist.Store, rank: int, size: int, generation: int, host: str, timeout: timedelta) -> Group:
    """A gloo process group of `size` members over `store` (keys under this generation's prefix), bound to `host`;
    every collective on it fails after `timeout`."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # as torch's own group helper does
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"gen{generation}/pg/", store), rank, size, options)
    except RuntimeError as exc:
        raise PeerLost(f"the PS group's gloo connections did not form: {str(exc).splitlines()[0]}") from None
    return cast(Group, pg)
