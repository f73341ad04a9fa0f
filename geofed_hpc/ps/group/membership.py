"""Who is in the PS group: each generation's members in the store, re-formed when a peer dies or comes back.

One member serves the store and decides each new generation (the server): peer 0 when the group forms. When the
server dies, the lowest member left serves a new store at its own address and the others find it there, in member
order (succeed); a peer that starts while a group runs looks for it at every peer's store address before it forms
one (find_running), so a restarted peer 0 joins the group its successor serves.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from geofed_hpc.config import PSConfig
from geofed_hpc.errors import MismatchError
from geofed_hpc.log import escape, logger, quote
from geofed_hpc.ps.group.collectives import Group, PeerLost
from geofed_hpc.ps.group.rendezvous import (
    NONCE,
    POLL,
    check_hello,
    check_listen,
    gloo_group,
    gloo_host,
    hello,
    meet,
    open_store,
    serve_store,
    show,
    store_address,
    store_client,
)

GENERATION = "generation"  # the newest generation's number; its members are under gen{N}/members


class StoreLost(PeerLost):
    """The group's store does not answer, or its server left: the group needs a new server."""


@dataclass
class Joined:
    """A formed generation of the group: its gloo process group, the store the peers meet at, its number, its
    members (ranks in ps.peers, in group-rank order) and which of them serves the store."""

    pg: Group
    store: dist.Store
    generation: int
    members: list[int]
    server: int = 0


def form(cfg: PSConfig, identity: dict[str, Any]) -> Joined:
    """Meet the peers of ps.peers and form their gloo group (generation 0), or, when the group runs already (this
    peer restarted), ask to be taken back at its next sync point. Errors name the peer at fault."""
    check_listen(cfg)
    found = find_running(cfg)
    if found is not None:
        store, server = found
        generation, members = join_running(cfg, identity, store)
    else:
        store, server = open_store(cfg), 0
        meet(cfg, identity, store)
        generation, members = 0, list(range(len(cfg.peers)))
    joined = connect(cfg, store, generation, members, server)
    if cfg.peer_rank == 0 and generation == 0:
        publish(store, 0, members)
    what = "formed" if found is None else "took this PS back"
    listing = _listing(cfg, members, server)
    logger.info("PS group %s (generation %d): %s; this PS is peer %d", what, generation, listing, cfg.peer_rank)
    return joined


def describe(cfg: PSConfig, joined: Joined) -> str:
    """A generation as a log line (or `ps up`) shows it: its number, members and the peer serving the store."""
    return f"generation {joined.generation}: {_listing(cfg, joined.members, joined.server)}"


def _listing(cfg: PSConfig, members: list[int], server: int, changes: str = "") -> str:
    """`peers [0, 1]{changes}; addresses a:p, b:p; store served by peer 0 at a:p+1` (from this PS's settings)."""
    host, port = store_address(cfg, server)
    addresses = ", ".join(cfg.peers[r] for r in members)
    return f"peers {members}{changes}; addresses {addresses}; store served by peer {server} at {show(host, port)}"


def find_running(cfg: PSConfig) -> tuple[dist.Store, int] | None:
    """The store of a group that runs already, and the peer serving it: looked for at every other peer's store
    address in rank order (None: no group runs; a store whose group is still forming does not count)."""
    for rank in range(len(cfg.peers)):
        if rank == cfg.peer_rank:
            continue
        store = store_client(cfg, rank, timedelta(0))
        try:
            if store is not None and running(store) is not None:
                logger.info("PS group: a running group found at peer %d's store (%s)", rank, cfg.peers[rank])
                return store, rank
        except RuntimeError:  # it went away while we looked
            continue
    return None


def connect(cfg: PSConfig, store: dist.Store, generation: int, members: list[int], server: int = 0) -> Joined:
    """This peer's gloo group of a generation (every member calls it at once)."""
    rank = members.index(cfg.peer_rank)
    pg = gloo_group(store, rank, len(members), generation, gloo_host(cfg), cfg.peer_timeout)
    return Joined(pg, store, generation, members, server)


def _members_key(generation: int) -> str:
    return f"gen{generation}/members"


def _join_key(rank: int) -> str:
    return f"join/{rank}"


def _left_key(generation: int, rank: int) -> str:
    return f"gen{generation}/left/{rank}"


def leave(cfg: PSConfig, joined: Joined) -> None:
    """A stopping peer says so, so that the server re-forms without waiting for it, or (the server itself) so that
    the others choose a new one (best effort)."""
    try:
        joined.store.set(_left_key(joined.generation, cfg.peer_rank), "1")
    except RuntimeError as exc:  # the rendezvous is gone too
        logger.debug("PS group: could not say that this peer leaves: %s", exc)


def publish(store: dist.Store, generation: int, members: list[int]) -> None:
    """The server names the members (their ranks in ps.peers) of a new generation."""
    store.set(_members_key(generation), json.dumps(members))
    store.set(GENERATION, str(generation))


def read_members(cfg: PSConfig, store: dist.Store, generation: int) -> list[int]:
    """The members of `generation` its server named in the store; PeerLost when they are not ranks in ps.peers."""
    raw = store.get(_members_key(generation))
    try:
        members = json.loads(raw)
    except ValueError:
        members = None
    if not (
        isinstance(members, list)
        and members
        and all(type(r) is int and 0 <= r < len(cfg.peers) for r in members)
        and len(set(members)) == len(members)
    ):
        raise PeerLost(f"the PS group's store names no members of ps.peers for generation {generation}: {quote(raw)}")
    return members


def running(store: dist.Store) -> int | None:
    """The generation of a group that runs already (None: it is still forming)."""
    return int(store.get(GENERATION)) if store.check([GENERATION]) else None


def joiners(cfg: PSConfig, store: dist.Store, members: list[int], identity: dict[str, Any]) -> list[int]:
    """Peers of ps.peers outside the group that asked to join and proved the secret and the same identity (one
    that does not is told why, and not admitted). The server asks at every sync point."""
    out = []
    for rank in range(len(cfg.peers)):
        key = _join_key(rank)
        if rank in members or not store.check([key]):
            continue
        try:
            check_hello(cfg, identity, rank, store.get(key), store.get(NONCE))
        except MismatchError as exc:
            store.set(key + "/refused", str(exc))
            store.delete_key(key)
            logger.error("PS group: %s", exc)
            continue
        out.append(rank)
    return out


def reform(cfg: PSConfig, joined: Joined, joining: list[int]) -> list[int]:
    """As _reform; a store that no longer answers, or whose server left, is StoreLost."""
    try:
        return _reform(cfg, joined, joining)
    except RuntimeError as exc:  # torch's DistNetworkError, DistStoreError
        server = f"peer {joined.server} ({cfg.peers[joined.server]})"
        raise StoreLost(f"the PS group's store (served by {server}) does not answer: {exc}") from None


def _reform(cfg: PSConfig, joined: Joined, joining: list[int]) -> list[int]:
    """The members of the next generation: the current ones still alive (each says so in the store) and
    `joining`. The server waits up to ps.peer_timeout for them and names them; the others read its answer."""
    store, members, generation, server = joined.store, joined.members, joined.generation, joined.server
    nxt, me = generation + 1, cfg.peer_rank
    store.set(f"gen{nxt}/alive/{me}", "1")
    if me == server:
        deadline = time.monotonic() + cfg.peer_timeout.total_seconds()
        wanted = [r for r in members if r != me and not store.check([_left_key(generation, r)])]
        while time.monotonic() < deadline:
            if all(store.check([f"gen{nxt}/alive/{r}"]) for r in wanted):
                break
            time.sleep(POLL.total_seconds())
        alive = [r for r in members if r == me or store.check([f"gen{nxt}/alive/{r}"])]
        new = sorted(set(alive) | set(joining))
        publish(store, nxt, new)
        for r in joining:
            store.delete_key(_join_key(r))
    else:
        deadline = time.monotonic() + 2 * cfg.peer_timeout.total_seconds()
        while not store.check([_members_key(nxt)]):
            if store.check([_left_key(generation, server)]):
                raise StoreLost(f"the server of the PS group, peer {server} ({cfg.peers[server]}), left it")
            if time.monotonic() > deadline:
                raise PeerLost(
                    f"waited {2 * cfg.peer_timeout.total_seconds():g}s for peer {server} ({cfg.peers[server]}) to "
                    "re-form the group"
                )
            time.sleep(POLL.total_seconds())
        new = read_members(cfg, store, nxt)
    _log_generation(cfg, nxt, members, new, joining, server)
    if me not in new:
        raise PeerLost(f"this PS (peer {me}) was left out of the PS group at generation {nxt}")
    return new


def _log_generation(
    cfg: PSConfig, generation: int, old: list[int], new: list[int], joining: list[int], server: int
) -> None:
    """One line for each peer that left or was taken back, and one for the new generation (members, store)."""
    gone = sorted(set(old) - set(new))
    back = [r for r in joining if r in new]
    for rank in gone:
        logger.warning("PS group: peer %d (%s) left (generation %d)", rank, cfg.peers[rank], generation)
    for rank in back:
        logger.info("PS group: peer %d (%s) taken back (generation %d)", rank, cfg.peers[rank], generation)
    changes = (f"; gone: {gone}" if gone else "") + (f"; back: {back}" if back else "")
    logger.warning(
        "PS group re-formed (generation %d): %s; this PS is peer %d",
        generation,
        _listing(cfg, new, server, changes),
        cfg.peer_rank,
    )


def succeed(cfg: PSConfig, identity: dict[str, Any], joined: Joined) -> tuple[dist.Store, int, list[int]]:
    """The server is gone: the lowest member left serves a new store at its own address (store_address) and names
    the next generation's members; the others look for it in member order, a candidate that serves nothing within
    ps.peer_timeout counted as gone too. (store, its server, members)."""
    nxt, me = joined.generation + 1, cfg.peer_rank
    for rank in sorted(r for r in joined.members if r != joined.server):
        if rank == me:
            store, members = _serve_next(cfg, identity, joined)
            return store, me, members
        found = store_client(cfg, rank, cfg.peer_timeout)
        if found is None:
            logger.warning("PS group: peer %d (%s) serves no store either: counted as gone", rank, cfg.peers[rank])
            continue
        try:
            found.set(f"gen{nxt}/hello/{me}", hello(cfg, identity, found.get(NONCE)))
            _wait(found, _members_key(nxt), 2 * cfg.peer_timeout, f"peer {rank} ({cfg.peers[rank]}) to re-form")
            members = read_members(cfg, found, nxt)
        except (RuntimeError, PeerLost) as exc:
            logger.warning("PS group: peer %d (%s) stopped answering: %s", rank, cfg.peers[rank], exc)
            continue
        _log_generation(cfg, nxt, joined.members, members, [], rank)
        if me not in members:
            raise PeerLost(f"this PS (peer {me}) was left out of the PS group at generation {nxt}")
        return found, rank, members
    raise PeerLost(f"no member of the PS group is left to serve its store (members were {joined.members})")


def _serve_next(cfg: PSConfig, identity: dict[str, Any], joined: Joined) -> tuple[dist.Store, list[int]]:
    """This peer, the new server, opens its store and names as the next generation itself and the members that
    proved the shared secret and the same identity there within ps.peer_timeout."""
    nxt, me = joined.generation + 1, cfg.peer_rank
    store, where = serve_store(cfg)
    store.set(NONCE, os.urandom(16).hex())
    store.set(GENERATION, str(joined.generation))  # a peer that restarts now finds a running group here
    host, port = store_address(cfg, me)
    logger.warning(
        "PS group: its server is gone; this PS (peer %d) serves the store on %s (listening on %s)",
        me,
        show(host, port),
        where,
    )
    others = {r: f"gen{nxt}/hello/{r}" for r in joined.members if r not in (me, joined.server)}
    deadline = time.monotonic() + cfg.peer_timeout.total_seconds()
    while time.monotonic() < deadline and not all(store.check([k]) for k in others.values()):
        time.sleep(POLL.total_seconds())
    members = [me]
    for rank, key in others.items():
        if not store.check([key]):
            continue
        try:
            check_hello(cfg, identity, rank, store.get(key), store.get(NONCE))
        except MismatchError as exc:
            logger.error("PS group: %s", exc)
            continue
        members.append(rank)
    members.sort()
    publish(store, nxt, members)
    _log_generation(cfg, nxt, joined.members, members, [], me)
    return store, members


def join_running(cfg: PSConfig, identity: dict[str, Any], store: dist.Store) -> tuple[int, list[int]]:
    """A restarted peer asks the running group to take it back; it is let in at the group's next sync point.
    (generation, members) once it is; MismatchError when the server refuses it, PeerLost when nobody answers."""
    rank, key = cfg.peer_rank, _join_key(cfg.peer_rank)
    store.delete_key(key + "/refused")
    seen = running(store) or 0
    store.set(key, hello(cfg, identity, store.get(NONCE)))
    deadline = time.monotonic() + 3 * cfg.peer_timeout.total_seconds()
    while time.monotonic() < deadline:
        if store.check([key + "/refused"]):
            raise MismatchError(escape(store.get(key + "/refused").decode(errors="replace"), limit=2000))
        generation = running(store) or 0
        if generation > seen and store.check([_members_key(generation)]):
            members = read_members(cfg, store, generation)
            if rank in members:
                return generation, members
            seen = generation
        time.sleep(POLL.total_seconds())
    raise PeerLost(
        f"the running PS group did not take this PS (peer {rank}) back within "
        f"{3 * cfg.peer_timeout.total_seconds():g}s (3 x ps.peer_timeout)"
    )


def _wait(store: dist.Store, key: str, timeout: timedelta, what: str) -> None:
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise PeerLost(f"waited {timeout.total_seconds():g}s for {what}")
        time.sleep(POLL.total_seconds())
