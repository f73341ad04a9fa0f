"""PS scaling benchmark: K concurrent sites push deltas over real gRPC; the PS's peak RSS and throughput per K.

Full size (the issue's numbers, ~25M parameters; about 30 minutes and 10 GB of scratch disk on 2 cores):
    python bench/ps_scale.py --json ps_scale.json
Modest (this 2-core development machine):
    python bench/ps_scale.py --params 4e6 --rounds 2 --json ps_scale.json

The PS runs in its own process (started with --serve); sites are threads of this process, one gRPC channel
each. A row per (rule, K): peak RSS of the PS process (VmHWM), deltas/s and compressed MB/s accepted.
Baseline in the same run: the PS's RSS after the model was seeded (idle_rss_mb), and K=4 for the K=64 ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from geofed_hpc import codec
from geofed_hpc.config import CodecConfig, PSConfig

RULES = {"fedavg": {"robust": "none"}, "trimmed_mean": {"robust": "trimmed_mean", "trim_fraction": 0.1}}


def model_shapes(params: float) -> dict[str, tuple[int, ...]]:
    """A GPT-like set of tensor shapes holding about `params` values (an embedding plus blocks)."""
    d = 512
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (max(64, int(params * 0.16) // d), d)}
    per_block = 3 * d * d + d * d + 2 * 4 * d * d + 4 * d
    for i in range(max(1, round((params - math.prod(shapes["wte.weight"])) / per_block))):
        shapes |= {f"h.{i}.attn.qkv": (d, 3 * d), f"h.{i}.attn.proj": (d, d)}
        shapes |= {f"h.{i}.mlp.fc": (d, 4 * d), f"h.{i}.mlp.proj": (4 * d, d), f"h.{i}.ln.weight": (4 * d,)}
    return shapes


def adam_like(shapes: dict[str, tuple[int, ...]], seed: int, scale: float = 1e-3) -> dict[str, np.ndarray]:
    """Deltas after Adam steps: t-distributed values around lr, a fifth of them untouched (zeros)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        x = (rng.standard_t(4, size=shape) * scale).astype(np.float32)
        x[rng.random(shape) < 0.2] = 0.0
        out[name] = x
    return out


# ------------------------------------------------------------------------------------------------ PS process


def _rss() -> dict[str, float]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0]) / 1024
    return {"peak_rss_mb": fields["VmHWM"], "rss_mb": fields["VmRSS"]}


def _sink_server(cfg: PSConfig) -> tuple[Any, int]:
    """A bare client-streaming gRPC method that reads (and parses) every chunk and discards it: the baseline."""
    from concurrent import futures

    import grpc

    from geofed_hpc.rpc import messages as m
    from geofed_hpc.rpc import serde
    from geofed_hpc.rpc.channel import server_options

    def push(chunks: Any, context: Any) -> m.PushReply:
        n = sum(len(c.data) for c in chunks)
        return m.PushReply(True, n)

    handler = grpc.stream_unary_rpc_method_handler(push, serde.deserializer(m.Chunk), serde.serializer(m.PushReply))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=server_options(cfg))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Sink", {"Push": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def serve(spec: dict[str, Any]) -> None:
    """Child process: a real ParameterServer (and the sink); answers 'rss' and 'quit' lines on stdin."""
    from geofed_hpc.config import RunConfig
    from geofed_hpc.log import setup_logging
    from geofed_hpc.ps.app import ParameterServer

    setup_logging(-1)
    cfg = RunConfig(ps=PSConfig(**spec["ps"]), codec=CodecConfig(**spec["codec"]))
    ps = ParameterServer(cfg)
    sink, sink_port = _sink_server(cfg.ps)
    print(json.dumps({"port": ps.port, "sink_port": sink_port}), flush=True)
    for line in sys.stdin:
        if line.strip() == "rss":
            print(json.dumps(_rss() | {"version": ps.logic.version}), flush=True)
        elif line.strip() == "quit":
            break
    sink.stop(0)
    ps.stop(timedelta(seconds=5))


class PSProcess:
    """The PS child as seen from the benchmark: its address, and its RSS on request."""

    def __init__(self, ps: dict[str, Any], codec_cfg: dict[str, Any]) -> None:
        spec = json.dumps({"ps": ps, "codec": codec_cfg})
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        ports = json.loads(self.proc.stdout.readline())
        self.address = f"127.0.0.1:{ports['port']}"
        self.sink_address = f"127.0.0.1:{ports['sink_port']}"

    def ask(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------------------------------------ sites


def seed(client: Any, shapes: dict[str, tuple[int, ...]]) -> None:
    from geofed_hpc.rpc import messages as m

    s = client.join(m.JoinRequest("seeder"))
    theta0 = adam_like(shapes, seed=12345, scale=0.02)
    header = m.PushHeader(s.session_id, 0, 0, 0, "fp32", 0, b"", "", init=True)
    client.push_delta(header, codec.encode(theta0, CodecConfig("fp32")))
    client.heartbeat(m.HeartbeatRequest(s.session_id, leaving=True))


def run_sites(address: str, k: int, rounds: int, payloads: list[bytes], name: str) -> tuple[float, int]:
    """K site threads: join, then per round push (base = the round) and long-poll the next version's updates."""
    from geofed_hpc.config import PSConfig
    from geofed_hpc.rpc import messages as m
    from geofed_hpc.rpc.client import PSClient

    cfg = PSConfig(rpc_timeout="30m")
    ready = threading.Barrier(k + 1)
    errors: list[BaseException] = []
    sent = [0] * k

    def site(i: int) -> None:
        try:
            with PSClient(cfg, address) as c:
                session = c.join(m.JoinRequest(f"{name}-{i:02d}")).session_id
                ready.wait()
                for r in range(rounds):
                    payload = payloads[(i + r) % len(payloads)]
                    header = m.PushHeader(session, r, 10, 10_000, "int8", 0, b"", "")
                    reply = c.push_delta(header, payload)
                    if not reply.accepted:
                        raise RuntimeError(f"push refused: {reply.reason}")
                    sent[i] += len(payload)
                    c.pull_model(session, r + 1, timedelta(minutes=30), have_version=r)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
            ready.abort()

    threads = [threading.Thread(target=site, args=(i,), daemon=True) for i in range(k)]
    for t in threads:
        t.start()
    ready.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, sum(sent)


def measure(rule: str, k: int, args: argparse.Namespace, shapes: dict, payloads: list[bytes]) -> dict[str, Any]:
    from geofed_hpc.config import PSConfig
    from geofed_hpc.rpc.client import PSClient

    ps = {"aggregation": "sync", "round_timeout": "30m", "max_staleness": 8}
    # every site is on this host, each holding a push and a pull: threads and streams for all of them, and the reserve
    ps |= {"max_workers": max(16, 3 * k) + PSConfig().reserved_workers, "max_streams_per_peer": max(64, 3 * k)}
    ps |= {"downlink_history": 4, "staging_dir": args.staging, "rpc_timeout": "30m"} | RULES[rule]
    ps |= {"stream_window_bytes": args.window} if args.window >= 0 else {}
    child = PSProcess(ps, {"name": "int8", "block_size": args.block_size})
    try:
        with PSClient(PSConfig(rpc_timeout="30m"), child.address) as client:
            client.connect()
            seed(client, shapes)
        idle = child.ask("rss")
        seconds, nbytes = run_sites(child.address, k, args.rounds, payloads, f"{rule}-{k}")
        after = child.ask("rss")
        assert after["version"] == args.rounds, after
    finally:
        child.close()
    deltas = k * args.rounds
    return {
        "sites": k,
        "rule": rule,
        "peak_rss_mb": round(after["peak_rss_mb"], 1),
        "idle_rss_mb": round(idle["peak_rss_mb"], 1),
        "deltas_per_s": round(deltas / seconds, 3),
        "mb_per_s": round(nbytes / seconds / 1e6, 2),
        "seconds": round(seconds, 2),
        "params": sum(math.prod(s) for s in shapes.values()),
        "delta_mb": round(nbytes / deltas / 1e6, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("ps_scale.json"))
    p.add_argument("--params", type=float, default=25e6)
    p.add_argument("--sites", default="1,4,16,64")
    p.add_argument("--rules", default="fedavg,trimmed_mean")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--block-size", type=int, default=1 << 16)
    p.add_argument("--staging", default="", help="PS staging directory (default: a temp dir)")
    p.add_argument("--window", type=int, default=-1, help="ps.stream_window_bytes (default: the PS default)")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(json.loads(args.serve))
        return
    shapes = model_shapes(args.params)
    cfg = CodecConfig(name="int8", block_size=args.block_size)
    payloads = [codec.encode(adam_like(shapes, seed=i), cfg) for i in range(4)]
    rows = []
    print(f"{'rule':<14}{'sites':>6}{'peak RSS MB':>13}{'idle RSS MB':>13}{'deltas/s':>10}{'MB/s':>9}{'s':>8}")
    for rule in args.rules.split(","):
        for k in (int(x) for x in args.sites.split(",")):
            row = measure(rule, k, args, shapes, payloads)
            rows.append(row)
            print(
                f"{rule:<14}{k:>6}{row['peak_rss_mb']:>13.1f}{row['idle_rss_mb']:>13.1f}"
                f"{row['deltas_per_s']:>10.2f}{row['mb_per_s']:>9.1f}{row['seconds']:>8.1f}",
                flush=True,
            )
    args.json.parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in the checkout
    args.json.write_text(json.dumps({"rows": rows}, indent=1))
    for rule in args.rules.split(","):
        by_k = {r["sites"]: r["peak_rss_mb"] for r in rows if r["rule"] == rule}
        if 4 in by_k and 64 in by_k:
            print(f"{rule}: peak RSS at K=64 is {by_k[64] / by_k[4]:.2f}x K=4 (target for mean rules: <= 1.25x)")
    print(f"wrote {args.json} ({rows[0]['params']:,} parameters, {rows[0]['delta_mb']} MB per int8 delta)")


if __name__ == "__main__":
    os.environ.setdefault("WANDB_SILENT", "true")
    main()
