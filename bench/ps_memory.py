"""PS memory benchmark: the peak RSS of `ps up` per model size, outer optimizer and codec, in fp32 copies of the model.

    python bench/ps_memory.py --json ps_memory.json                           # 560M and 1.2B (about 24 GB free)
    python bench/ps_memory.py --params 560e6 --json ps_memory.json            # 560M only (about 11 GB free)

A row per (params, outer, codec): a fresh `geofed-hpc ps up` (plaintext on 127.0.0.1, ps.aggregation=async, a
state directory, snapshots every version); its RSS once it listens is the empty PS (the baseline, measured in the
same row); the model is seeded with an fp32 init push; then --sites simulated sites (threads of this process, as in
bench/swarm.py: only the PS holds a model) each --pushes times pull the updates since their version and push an
encoded delta of the model (int8 or sparse payloads, precomputed). ps_peak_rss_mb is the PS's VmHWM at the end;
fp32_copies = (ps_peak_rss_mb - empty PS's RSS) / (4 bytes x params). Targets: <= 3 (plain), <= 4 (nesterov).

Before each model size the benchmark checks MemAvailable: a size whose row would need more than it (this process
holds the seed and the payloads, the PS up to --assume-copies fp32 copies) is skipped and says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flood import proc_rss_mb  # noqa: E402
from ps_scale import adam_like, model_shapes  # noqa: E402
from swarm import SEED_SITE, Servers, issue_tokens  # noqa: E402

from geofed_hpc import codec  # noqa: E402
from geofed_hpc.config import CodecConfig, PSConfig  # noqa: E402
from geofed_hpc.rpc import messages as m  # noqa: E402
from geofed_hpc.rpc.client import PSClient  # noqa: E402

KEYS = ("params", "outer", "codec", "sites", "ps_peak_rss_mb", "fp32_copies")
TARGET = {"plain": 3.0, "nesterov": 4.0}
CALL = PSConfig(rpc_timeout=timedelta(minutes=30), retry_budget=timedelta(minutes=2))
CALL_BUDGET = timedelta(minutes=30)


def mem_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return 0.0


def seed(address: str, token: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """The model's first version: an fp32 init push (the arrays freed before it is sent)."""
    payload = codec.encode(adam_like(shapes, 1, 0.02), CodecConfig(name="fp32"))
    gc.collect()
    with PSClient(CALL, address) as client:
        client.connect()
        session = client.join(m.JoinRequest(SEED_SITE, token)).session_id
        header = m.PushHeader(session, 0, 0, 0, "fp32", 0, b"", "init", init=True)
        reply = client.push_delta(header, payload)
        if not reply.accepted:
            raise RuntimeError(f"the init push was refused: {reply.reason}")
        client.heartbeat(m.HeartbeatRequest(session, leaving=True), CALL_BUDGET, CALL.rpc_timeout)


def site(address: str, name: str, token: str, payload: bytes, codec_name: str, pushes: int, errors: list) -> None:
    """One simulated site: join; per push, pull the updates since its version, push a delta based on it."""
    try:
        with PSClient(CALL, address) as client:
            session = client.join(m.JoinRequest(name, token)).session_id
            have: int | None = None
            for _ in range(pushes):
                header, _ = client.pull_model(session, have_version=have)
                have = header.version
                push = m.PushHeader(session, have, 10, 10_000, codec_name, 0, b"", uuid.uuid4().hex)
                reply = client.push_delta(push, payload)
                if not reply.accepted:
                    raise RuntimeError(f"{name}: push refused: {reply.reason}")
            # the PS may be applying the other site's push (a long step at this size, under the coordinator's lock)
            client.heartbeat(m.HeartbeatRequest(session, have or 0, leaving=True), CALL_BUDGET, CALL.rpc_timeout)
    except BaseException as exc:  # noqa: BLE001 - reported by the caller
        errors.append(exc)


def measure(params: float, outer: str, codec_name: str, payload: bytes, args: argparse.Namespace) -> dict[str, Any]:
    shapes = model_shapes(params)
    n = sum(math.prod(s) for s in shapes.values())
    work = Path(tempfile.mkdtemp(prefix="ps-memory-", dir=args.work_dir))
    names = [f"memsite{i}" for i in range(args.sites)]
    tokens = issue_tokens(work / "ps-0", [SEED_SITE, *names])
    args.codec_now = codec_name
    args.ps = [f"ps.outer_optimizer={outer}", "ps.snapshot_every=1", *args.extra_ps]
    servers = Servers(work, "single", args.sites, args)
    try:
        servers.start(work / "ps-0")
        time.sleep(2.0)  # settled after start
        empty = proc_rss_mb(servers.procs[0].pid)
        seed(servers.addresses[0], tokens[0], shapes)
        errors: list[BaseException] = []
        threads = [
            threading.Thread(
                target=site,
                args=(servers.addresses[0], names[i], tokens[1 + i], payload, codec_name, args.pushes, errors),
            )
            for i in range(args.sites)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        peak = servers.peak_rss_mb()
    finally:
        servers.close()
        shutil.rmtree(work, ignore_errors=True)
    copies = (peak - empty) * 2**20 / (4 * n)
    return {
        "params": n,
        "outer": outer,
        "codec": codec_name,
        "sites": args.sites,
        "ps_peak_rss_mb": round(peak, 1),
        "fp32_copies": round(copies, 2),
        "_empty_ps_rss_mb": round(empty, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=Path("ps_memory.json"))
    p.add_argument("--params", default="560e6,1.2e9")
    p.add_argument("--outers", default="plain,nesterov")
    p.add_argument("--codecs", default="int8,sparse")
    p.add_argument("--sites", type=int, default=2)
    p.add_argument("--pushes", type=int, default=2, help="pushes per site")
    p.add_argument("--assume-copies", type=float, default=4.5, help="fp32 copies the PS may peak at (memory check)")
    p.add_argument("--ps", dest="extra_ps", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--work-dir", default=None, help="where the PS's state goes (snapshots: a model's size each)")
    args = p.parse_args()
    args.peer_sync = "5s"
    rows, skipped, empties = [], [], []
    load0 = list(os.getloadavg())
    for params in (float(x) for x in args.params.split(",")):
        n = sum(math.prod(s) for s in model_shapes(params).values())
        # this process holds the seed (its arrays and payload: 2 copies) before the PS grows, then one payload; the
        # PS up to the assumed copies
        need = (4 * n * max(2.0, args.assume_copies)) / 2**20 + 1024
        free = mem_available_mb()
        if need > free:
            skipped.append({"params": n, "needed_mb": round(need), "available_mb": round(free)})
            print(f"skipped {n:,} parameters: needs about {need:,.0f} MB, {free:,.0f} MB available", flush=True)
            continue
        for codec_name in args.codecs.split(","):
            t = time.monotonic()
            payload = codec.encode(adam_like(model_shapes(params), 7), CodecConfig(name=codec_name))
            gc.collect()
            print(f"{n:,} parameters, {codec_name}: payload {len(payload) / 1e6:.1f} MB ({time.monotonic() - t:.0f}s)")
            for outer in args.outers.split(","):
                row = measure(params, outer, codec_name, payload, args)
                empties.append(row.pop("_empty_ps_rss_mb"))
                rows.append(row)
                print(f"  {json.dumps(row)} (empty PS {empties[-1]} MB, load {os.getloadavg()[0]:.2f})", flush=True)
            del payload
            gc.collect()
    out = {
        "rows": rows,
        "empty_ps_rss_mb": empties,
        "targets": {"fp32_copies": TARGET},
        "met": [r["fp32_copies"] <= TARGET[r["outer"]] for r in rows],
        "skipped": skipped,
        "settings": {"pushes_per_site": args.pushes, "ps": ["ps.aggregation=async", "ps.snapshot_every=1"]},
        "machine": {"cpu_count": os.cpu_count(), "load_average_start": load0, "load_average_end": os.getloadavg()},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"{'params':>14}{'outer':>10}{'codec':>8}{'sites':>6}{'peak RSS MB':>13}{'fp32 copies':>13}  target")
    for r in rows:
        print(
            f"{r['params']:>14,}{r['outer']:>10}{r['codec']:>8}{r['sites']:>6}{r['ps_peak_rss_mb']:>13}"
            f"{r['fp32_copies']:>13}  <= {TARGET[r['outer']]:g}"
        )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
