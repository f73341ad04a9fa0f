"""A user-space netem link: two namespaces' TUN devices bridged with delay, jitter, loss, rate and a queue."""

# Run as `python -m geofed_hpc.testing.netem` (root). The kernel here has no sch_netem, so each emulated link is
# this process: it reads IP packets from one namespace's TUN device and writes them into the other's after the
# link's delay. SIGUSR1 takes the link down (every packet is dropped), SIGUSR2 brings it back, SIGHUP writes the
# counters to --stats, SIGTERM writes them and exits.

from __future__ import annotations

import argparse
import asyncio
import ctypes
import fcntl
import json
import os
import random
import signal
import struct
from pathlib import Path

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def open_tun(netns: str, name: str) -> int:
    """Create TUN device `name` inside network namespace `netns` (by its /run/netns name); return its fd."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET):
            raise OSError(ctypes.get_errno(), f"setns into network namespace {netns}")
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    finally:
        if libc.setns(own, CLONE_NEWNET):
            raise OSError(ctypes.get_errno(), "setns back into the forwarder's own network namespace")
        os.close(own)
        os.close(target)
    os.set_blocking(fd, False)
    return fd


class Direction:
    """One direction of the link: loss, a FIFO queue served at `rate`, then delay +- jitter (never reordering)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, src: int, dst: int, args: argparse.Namespace, rng) -> None:
        self.loop, self.src, self.dst, self.args, self.rng = loop, src, dst, args, rng
        self.up = True
        self.free = 0.0  # when the emulated wire finishes sending what is queued
        self.last = 0.0  # delivery time of the previous packet (FIFO)
        self.queued = 0
        self.stats = {"packets": 0, "bytes": 0, "lost": 0, "tail_dropped": 0, "down_dropped": 0}

    def on_readable(self) -> None:
        a, s = self.args, self.stats
        while True:
            try:
                pkt = os.read(self.src, 65535)
            except BlockingIOError:
                return
            if not self.up:
                s["down_dropped"] += 1
                continue
            if self.rng.random() * 100 < a.loss:
                s["lost"] += 1
                continue
            if self.queued >= a.queue:
                s["tail_dropped"] += 1
                continue
            s["packets"] += 1
            s["bytes"] += len(pkt)
            now = self.loop.time()
            self.free = max(now, self.free) + len(pkt) * 8 / (a.rate * 1e6)
            delay = max(0.0, self.rng.uniform(a.delay - a.jitter, a.delay + a.jitter)) / 1e3
            when = max(self.free + delay, self.last)
            self.last = when
            self.queued += 1
            self.loop.call_at(when, self.deliver, pkt)

    def deliver(self, pkt: bytes) -> None:
        self.queued -= 1
        try:
            os.write(self.dst, pkt)
        except OSError:
            pass  # the far device went away (namespace deleted): the packet is lost, as on a real link


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m geofed_hpc.testing.netem", description=__doc__)
    p.add_argument("--a-netns", required=True)
    p.add_argument("--a-dev", required=True)
    p.add_argument("--b-netns", required=True)
    p.add_argument("--b-dev", required=True)
    p.add_argument("--delay", type=float, default=50.0, help="one-way delay, ms (each direction)")
    p.add_argument("--jitter", type=float, default=0.0, help="uniform +- jitter, ms")
    p.add_argument("--loss", type=float, default=0.0, help="random loss, percent of packets")
    p.add_argument("--rate", type=float, default=100.0, help="rate cap, Mbit/s")
    p.add_argument("--queue", type=int, default=1000, help="queue limit, packets (tail drop)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready", type=Path, required=True, help="file created once both devices exist")
    p.add_argument("--stats", type=Path, required=True, help="JSON counters, written on SIGHUP and exit")
    args = p.parse_args(argv)

    a, b = open_tun(args.a_netns, args.a_dev), open_tun(args.b_netns, args.b_dev)
    loop = asyncio.new_event_loop()
    rng = random.Random(args.seed)
    dirs = {"a_to_b": Direction(loop, a, b, args, rng), "b_to_a": Direction(loop, b, a, args, rng)}
    seq = 0

    def dump() -> None:
        nonlocal seq
        seq += 1
        tmp = args.stats.with_suffix(".tmp")
        tmp.write_text(json.dumps({"seq": seq, "up": dirs["a_to_b"].up, **{k: d.stats for k, d in dirs.items()}}))
        os.replace(tmp, args.stats)

    def set_up(up: bool) -> None:
        for d in dirs.values():
            d.up = up
        dump()

    for d in dirs.values():
        loop.add_reader(d.src, d.on_readable)
    loop.add_signal_handler(signal.SIGUSR1, set_up, False)
    loop.add_signal_handler(signal.SIGUSR2, set_up, True)
    loop.add_signal_handler(signal.SIGHUP, dump)
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    loop.add_signal_handler(signal.SIGINT, loop.stop)
    dump()
    args.ready.touch()
    try:
        loop.run_forever()
    finally:
        dump()


if __name__ == "__main__":
    main()
