"""Helpers for tests that run real multi-process torch.distributed groups (gloo on CPU)."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

_HANDED: set[int] = set()  # ports this test process handed out (a pair's second included): none is handed out twice


def free_port() -> int:
    """A loopback port that was free a moment ago, below the kernel's ephemeral range (see free_pair): a PS
    restarted on it after an outage does not find it taken by an outgoing connection that dialled it meanwhile."""
    return _pick(1)


def free_pair() -> int:
    """A loopback port p, with p + 1 (where a PS group peer serves its store), both free a moment ago and both below
    the kernel's ephemeral range: the peers' own outgoing connections (store probes, gloo) take their source ports
    from that range, so one could otherwise land on a port a peer is about to listen on."""
    return _pick(2)


def _pick(span: int) -> int:
    """The first of `span` consecutive free ports in [20000, 32766), none of them handed out before."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32766 - span)
        wanted = set(range(port, port + span))
        if wanted & _HANDED:
            continue
        try:
            with contextlib.ExitStack() as held:
                for p in wanted:
                    held.enter_context(socket.socket()).bind(("127.0.0.1", p))
        except OSError:
            continue
        _HANDED.update(wanted)
        return port


def _entry(rank: int, fn: Callable[..., None], world: int, port: int, args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()
    # Done: leave without interpreter finalization. FSDP still holds the group, so its gloo worker threads live
    # on, and one still freeing fn's last collective then would abort the process (see wait_released).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., None], world: int, *args: Any) -> None:
    """Run fn(rank, *args) in `world` spawned processes joined in one gloo group; raises if any rank fails."""
    mp.spawn(_entry, args=(fn, world, free_port(), args), nprocs=world, join=True)
