"""Wire benchmark: raw gRPC client-streaming vs a real PushDelta (PS-side verify, decode and fold) of the same bytes.

Full size (~25M parameters):
    python bench/wire.py --json wire.json
Modest (this 2-core development machine):
    python bench/wire.py --params 4e6 --repeats 3 --json wire.json

Both go to one PS process (bench/ps_scale.py --serve): (a) a bare client-streaming method that parses and drops 1
MiB chunks, (b) PushDelta into a buffered PS that folds every delta (no version bump, so nothing else runs). The
payload is the encoded delta; its checksum is computed before timing, as a site does before it pushes. Per codec
also (c) two sites of two clusters (two threads sharing one channel) pushing at once, push after push, and once (d)
the bare method carrying the raw float32 bytes of the same parameters. The JSON's top level has, for the first codec
(int8 by default): int8_params_vs_raw_fp32, its push ingest in parameters/s over (d)'s (>= 1: compression never
makes the PS slower than shipping fp32), and concurrent_speedup, (c)'s parameters/s over (b)'s, both as the steady
rate of back-to-back pushes (--repeats of them per site, after one each to warm up); one site and two take --rounds
turns each, and concurrent_speedup is the median of the turns' ratios (a drift of the machine during the run touches
both sides of a ratio alike). Rows also carry concurrent_speedup_paired: two pushes started together and both
awaited, again and again (each pair takes as long as its slower push, with one core idle at its end). The PS's CPU
time per push, alone and two at once, tells contention (it grows) from a machine without free cores (it stays, the
wall time grows).

What bounds concurrent_speedup on this machine, per row: the pushing side (this process: the two sites' gRPC
streams) runs on the same cores as the PS, so two pushes at once need (PS + site) CPU per push twice over;
with every core busy a push cannot take less than that over the core count. speedup_ceiling = one push's wall
time x cores / that CPU per push (two at once), the speedup at full use of every core; cores_busy_one and
cores_busy_two are the cores in use (from /proc/stat, every process) while one and two sites push; cores are
the ones this process may run on (its affinity).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ps_scale import PSProcess, adam_like, model_shapes, seed  # noqa: E402

from geofed_hpc import codec  # noqa: E402
from geofed_hpc.config import CodecConfig, PSConfig  # noqa: E402
from geofed_hpc.rpc import messages as m  # noqa: E402
from geofed_hpc.rpc import serde  # noqa: E402
from geofed_hpc.rpc.channel import client_options  # noqa: E402
from geofed_hpc.rpc.client import PSClient  # noqa: E402
from geofed_hpc.rpc.guard import bearer  # noqa: E402
from geofed_hpc.rpc.stream import digest, to_chunks  # noqa: E402


def timed(fn: Any, repeats: int) -> float:
    """Median seconds of `repeats` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ps_cpu(child: PSProcess) -> float:
    """CPU seconds (user + system) the PS process has used so far."""
    fields = Path(f"/proc/{child.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(busy ticks of every core, ticks of one core) so far (/proc/stat: idle and iowait are not busy)."""
    lines = Path("/proc/stat").read_text().splitlines()
    ticks = [int(x) for x in lines[0].split()[1:]]
    cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks) // cores


def own_cpu() -> float:
    """CPU seconds this process (the pushing sites' side) has used so far."""
    t = os.times()
    return t.user + t.system


def at_once(fn: Any, sites: int) -> None:
    """Run fn(i) for site i on `sites` threads at once and wait for them all."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(sites)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class Meter:
    """CPU used while one kind of measurement ran, summed over its rounds: the PS's and this process's (seconds),
    and every core's busy ticks against the ticks of one core."""

    def __init__(self, child: PSProcess) -> None:
        self.child = child
        self.ps = self.site = 0.0
        self.busy = self.ticks = self.pushes = 0

    @contextmanager
    def counting(self, pushes: int) -> Iterator[None]:
        ps0, site0, (busy0, ticks0) = ps_cpu(self.child), own_cpu(), machine_ticks()
        yield
        ps1, site1, (busy1, ticks1) = ps_cpu(self.child), own_cpu(), machine_ticks()
        self.ps, self.site = self.ps + ps1 - ps0, self.site + site1 - site0
        self.busy, self.ticks = self.busy + busy1 - busy0, self.ticks + ticks1 - ticks0
        self.pushes += pushes


def steady(push: Any, sites: int, pushes: int) -> float:
    """Seconds per round of `sites` pushes in the steady state: `sites` threads push `pushes` times each, back to
    back, after one push each to warm up."""
    at_once(push, sites)
    t0 = time.perf_counter()
    at_once(lambda i: [push(i) for _ in range(pushes)], sites)
    return (time.perf_counter() - t0) / pushes


def measure(codec_name: str, args: argparse.Namespace) -> dict[str, Any]:
    shapes = model_shapes(args.params)
    cfg = CodecConfig(name=codec_name, block_size=args.block_size)
    delta = adam_like(shapes, seed=1)
    payload = codec.encode(delta, cfg)
    raw32 = b"".join(v.tobytes() for v in delta.values())
    sha = digest(payload)
    chunk = PSConfig().chunk_bytes
    ps = {"aggregation": "buffered", "buffer_size": 1_000_000, "round_timeout": "1h", "rpc_timeout": "1h"}
    child = PSProcess(ps, {"name": codec_name, "block_size": args.block_size})
    try:
        with PSClient(PSConfig(rpc_timeout="1h"), child.address) as client:
            client.connect()
            seed(client, shapes)
            # two sites of two clusters, each its own family (of the PS's two decoders one family streams into one
            # at a time, so that its pushes, stalled or not, leave the others one)
            sessions = [client.join(m.JoinRequest(name)).session_id for name in ("wire-east", "wire-west")]
            push = client._calls["PushDelta"]

            def real_push(site: int = 0) -> None:
                session = sessions[site]
                header = m.PushHeader(session, 0, 1, 1, codec_name, len(payload), sha, uuid.uuid4().hex)
                reply = push(to_chunks(header, payload, chunk), timeout=3600, metadata=bearer(session))
                assert reply.accepted, reply.reason

            with grpc.insecure_channel(child.sink_address, options=client_options(PSConfig())) as channel:
                sink = channel.stream_unary(
                    "/bench.Sink/Push",
                    request_serializer=serde.serializer(m.Chunk),
                    response_deserializer=serde.deserializer(m.PushReply),
                )

                def raw() -> None:
                    header = m.PushHeader("raw", 0, 1, 1, codec_name, len(payload), sha, "raw")
                    assert sink(to_chunks(header, payload, chunk), timeout=3600).version == len(payload)

                def raw_fp32() -> None:
                    header = m.PushHeader("raw", 0, 1, 1, "fp32", len(raw32), digest(raw32), "raw")
                    assert sink(to_chunks(header, raw32, chunk), timeout=3600).version == len(raw32)

                raw_s = timed(raw, args.repeats)
                raw_fp32_s = timed(raw_fp32, args.repeats)
            one, two, ones, twos = Meter(child), Meter(child), [], []
            for _ in range(args.rounds):  # one site, then two, in turn: a drift of the machine touches both alike
                with one.counting(args.repeats + 1):  # steady() makes one more push per site than it times
                    ones.append(steady(real_push, 1, args.repeats))
                with two.counting(2 * (args.repeats + 1)):
                    twos.append(steady(real_push, 2, args.repeats))
            pair_s = timed(lambda: at_once(real_push, 2), args.repeats)
            rss = child.ask("rss")
    finally:
        child.close()
    mb = len(payload) / 1e6
    push_s, push2_s = statistics.median(ones), statistics.median(twos)
    speedups = [2 * a / b for a, b in zip(ones, twos, strict=True)]
    cpu_two = (two.ps + two.site) / two.pushes  # PS and pushing side, per push, two at once
    cores = len(os.sched_getaffinity(0))  # the cores this benchmark and its PS may run on
    decode_s = timed(lambda: codec.decode(payload), args.repeats)
    params = sum(v[0] if len(v) == 1 else v[0] * v[1] for v in shapes.values())
    return {
        "codec": codec_name,
        "params": params,
        "payload_mb": round(mb, 2),
        "raw_mb_per_s": round(mb / raw_s, 1),
        "push_mb_per_s": round(mb / push_s, 1),
        "ratio": round(raw_s / push_s, 3),
        "push_mparams_per_s": round(params / push_s / 1e6, 1),
        "raw_fp32_mparams_per_s": round(params / raw_fp32_s / 1e6, 1),
        "params_vs_raw_fp32": round(raw_fp32_s / push_s, 3),
        "two_pushes_mparams_per_s": round(2 * params / push2_s / 1e6, 1),
        "concurrent_speedup": round(statistics.median(speedups), 3),
        "concurrent_speedup_rounds": [round(x, 3) for x in speedups],
        "concurrent_speedup_paired": round(2 * push_s / pair_s, 3),
        "ps_cpu_ms_per_push": round(1000 * one.ps / one.pushes, 1),
        "ps_cpu_ms_per_push_two_at_once": round(1000 * two.ps / two.pushes, 1),
        "site_cpu_ms_per_push": round(1000 * one.site / one.pushes, 1),
        "site_cpu_ms_per_push_two_at_once": round(1000 * two.site / two.pushes, 1),
        "cores_busy_one": round(one.busy / one.ticks, 2),
        "cores_busy_two": round(two.busy / two.ticks, 2),
        "speedup_ceiling": round(push_s * cores / cpu_two, 3),
        "decode_only_mb_per_s": round(mb / decode_s, 1),
        "ps_peak_rss_mb": round(rss["peak_rss_mb"], 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("wire.json"))
    p.add_argument("--params", type=float, default=25e6)
    p.add_argument("--codecs", default="int8,fp32", help="the first one fills the top-level fields of --json")
    p.add_argument("--repeats", type=int, default=10, help="pushes per site, per measurement")
    p.add_argument("--rounds", type=int, default=3, help="one site then two, this many times in turn (median)")
    p.add_argument("--block-size", type=int, default=1 << 16)
    args = p.parse_args()
    rows = [measure(name, args) for name in args.codecs.split(",")]
    head = ("payload MB", "raw MB/s", "push MB/s", "ratio", "Mparam/s", "fp32 Mp/s", "vs fp32", "x2 Mp/s", "speedup")
    head += ("paired",)
    head += ("decode MB/s", "PS ms CPU", "x2 ms CPU", "x2 site ms", "busy x1", "busy x2", "ceiling", "PS RSS MB")
    print(f"{'codec':<8}" + "".join(f"{h:>12}" for h in head))
    keys = ("payload_mb", "raw_mb_per_s", "push_mb_per_s", "ratio", "push_mparams_per_s", "raw_fp32_mparams_per_s")
    keys += ("params_vs_raw_fp32", "two_pushes_mparams_per_s", "concurrent_speedup", "concurrent_speedup_paired")
    keys += ("decode_only_mb_per_s",)
    keys += ("ps_cpu_ms_per_push", "ps_cpu_ms_per_push_two_at_once", "site_cpu_ms_per_push_two_at_once")
    keys += ("cores_busy_one", "cores_busy_two", "speedup_ceiling", "ps_peak_rss_mb")
    for r in rows:
        print(f"{r['codec']:<8}" + "".join(f"{r[k]:>12}" for k in keys))
    first = rows[0]
    out = {k: first[k] for k in ("raw_mb_per_s", "push_mb_per_s", "ratio", "concurrent_speedup")}
    out[f"{first['codec']}_params_vs_raw_fp32"] = first["params_vs_raw_fp32"]
    out |= {"load_average": list(os.getloadavg()), "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in the checkout
    args.json.write_text(json.dumps(out, indent=1))
    print(
        f"wrote {args.json}; targets ({first['codec']}): ratio >= 0.8 (push/raw), params_vs_raw_fp32 >= 1.0, "
        f"concurrent_speedup >= 1.6 (this machine's ceiling: {first['speedup_ceiling']}, every core busy)"
    )


if __name__ == "__main__":
    main()
