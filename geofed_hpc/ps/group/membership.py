"""Who is in the PS group: each generation's members in the store, re-formed when a peer dies or comes back."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from geofed_hpc.config import PSConfig
from geofed_hpc.config.fields import split_host_port
from geofed_hpc.errors import MismatchError
from geofed_hpc.log import logger
from geofed_hpc.ps.group.collectives import Group, PeerLost
from geofed_hpc.ps.group.rendezvous import POLL, check_hello, gloo_group, hello, meet, open_store

GENERATION = "generation"  # the newest generation's number; its members are under gen{N}/members


@dataclass
class Joined:
    """A formed generation of the group: its gloo process group, the store the peers meet at, its number and its
    members (ranks in ps.peers, in group-rank order)."""

    pg: Group
    store: dist.Store
    generation: int
    members: list[int]


def form(cfg: PSConfig, identity: dict[str, Any]) -> Joined:
    """Meet the peers of ps.peers and form their gloo group (generation 0), or, when the group runs already (this
    peer restarted), ask to be taken back at its next sync point. Errors name the peer at fault."""
    store = open_store(cfg)
    if cfg.peer_rank != 0 and running(store) is not None:
        generation, members = join_running(cfg, identity, store)
    else:
        meet(cfg, identity, store)
        generation, members = 0, list(range(len(cfg.peers)))
    joined = connect(cfg, store, generation, members)
    if cfg.peer_rank == 0 and generation == 0:
        publish(store, 0, members)
    logger.info("PS group formed (generation %d): peer %d of %s", generation, cfg.peer_rank, members)
    return joined


def connect(cfg: PSConfig, store: dist.Store, generation: int, members: list[int]) -> Joined:
    """This peer's gloo group of a generation (every member calls it at once)."""
    host, _ = split_host_port(cfg.peers[cfg.peer_rank])
    rank = members.index(cfg.peer_rank)
    pg = gloo_group(store, rank, len(members), generation, host, cfg.peer_timeout)
    return Joined(pg, store, generation, members)


def _members_key(generation: int) -> str:
    return f"gen{generation}/members"


def _join_key(rank: int) -> str:
    return f"join/{rank}"


def _left_key(generation: int, rank: int) -> str:
    return f"gen{generation}/left/{rank}"


def leave(cfg: PSConfig, joined: Joined) -> None:
    """A stopping peer says so, so that peer 0 re-forms without waiting for it (best effort)."""
    try:
        joined.store.set(_left_key(joined.generation, cfg.peer_rank), "1")
    except RuntimeError as exc:  # the rendezvous is gone too
        logger.debug("PS group: could not say that this peer leaves: %s", exc)


def publish(store: dist.Store, generation: int, members: list[int]) -> None:
    """Peer 0 names the members (their ranks in ps.peers) of a new generation."""
    store.set(_members_key(generation), json.dumps(members))
    store.set(GENERATION, str(generation))


def running(store: dist.Store) -> int | None:
    """The generation of a group that runs already (None: it is still forming)."""
    return int(store.get(GENERATION)) if store.check([GENERATION]) else None


def joiners(cfg: PSConfig, store: dist.Store, members: list[int], identity: dict[str, Any]) -> list[int]:
    """Peers of ps.peers outside the group that asked to join and proved the secret and the same identity (one
    that does not is told why, and not admitted). Peer 0 asks at every sync point."""
    out = []
    for rank in range(len(cfg.peers)):
        key = _join_key(rank)
        if rank in members or not store.check([key]):
            continue
        try:
            check_hello(cfg, identity, rank, store.get(key), store.get("gen0/nonce"))
        except MismatchError as exc:
            store.set(key + "/refused", str(exc))
            store.delete_key(key)
            logger.error("PS group: %s", exc)
            continue
        out.append(rank)
    return out


def reform(cfg: PSConfig, store: dist.Store, members: list[int], generation: int, joining: list[int]) -> list[int]:
    """As _reform; a store that no longer answers (peer 0 is gone) is PeerLost."""
    try:
        return _reform(cfg, store, members, generation, joining)
    except RuntimeError as exc:  # torch's DistNetworkError, DistStoreError
        raise PeerLost(
            f"the PS group's rendezvous (served by peer 0, {cfg.peers[0]}) does not answer: {exc}; the group cannot "
            "re-form without peer 0"
        ) from None


def _reform(cfg: PSConfig, store: dist.Store, members: list[int], generation: int, joining: list[int]) -> list[int]:
    """The members of generation `generation` + 1: the current ones still alive (each says so in the store) and
    `joining`. Peer 0 waits up to ps.peer_timeout for them and names them; the others read its answer."""
    nxt, me = generation + 1, cfg.peer_rank
    store.set(f"gen{nxt}/alive/{me}", "1")
    if me == 0:
        deadline = time.monotonic() + cfg.peer_timeout.total_seconds()
        wanted = [r for r in members if r != 0 and not store.check([_left_key(generation, r)])]
        while time.monotonic() < deadline:
            if all(store.check([f"gen{nxt}/alive/{r}"]) for r in wanted):
                break
            time.sleep(POLL.total_seconds())
        alive = [r for r in members if r == 0 or store.check([f"gen{nxt}/alive/{r}"])]
        new = sorted(set(alive) | set(joining))
        publish(store, nxt, new)
        for r in joining:
            store.delete_key(_join_key(r))
    else:
        _wait(store, _members_key(nxt), 2 * cfg.peer_timeout, f"peer 0 ({cfg.peers[0]}) to re-form the group")
        new = json.loads(store.get(_members_key(nxt)))
    gone = sorted(set(members) - set(new))
    logger.warning(
        "PS group re-formed (generation %d): peers %s%s%s",
        nxt,
        new,
        f"; gone: {gone}" if gone else "",
        f"; back: {joining}" if joining else "",
    )
    if me not in new:
        raise PeerLost(f"this PS (peer {me}) was left out of the PS group at generation {nxt}")
    return new


def join_running(cfg: PSConfig, identity: dict[str, Any], store: dist.Store) -> tuple[int, list[int]]:
    """A restarted peer asks the running group to take it back; it is let in at the group's next sync point.
    (generation, members) once it is; MismatchError when peer 0 refuses it, PeerLost when nobody answers."""
    rank, key = cfg.peer_rank, _join_key(cfg.peer_rank)
    store.delete_key(key + "/refused")
    seen = running(store) or 0
    store.set(key, hello(cfg, identity, store.get("gen0/nonce")))
    deadline = time.monotonic() + 3 * cfg.peer_timeout.total_seconds()
    while time.monotonic() < deadline:
        if store.check([key + "/refused"]):
            raise MismatchError(store.get(key + "/refused").decode())
        generation = running(store) or 0
        if generation > seen and store.check([_members_key(generation)]):
            members = json.loads(store.get(_members_key(generation)))
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
