"""Egress benchmark: a site's sync (push a delta, pull the update it made) over the emulated far link, dialled
directly, through an HTTP CONNECT proxy (squid, as clusters run; --proxy tinyproxy), through `geofed-hpc relay` and
through an ssh tunnel to a real sshd (site.tunnel's `ssh -N -L`) (root; CUBIC).

The proxy, the relay and the sshd run in the site's namespace, on the site's side of the far link, as they do on a
login node: what is measured is the cost of the extra hop (and of the CONNECT, or of ssh's encryption), against
`direct` measured in the same run, paths interleaved round by round so that drift of the machine falls on all of them
alike. A real `ps up` over TLS serves a model of --params parameters; each sync is an int8 push of a delta and a pull
of the update (real encoded bytes). The `spool` row: the site's calls as files in a folder that `geofed-hpc relay
--spool`, in the site's namespace too, moves to the PS; its target is 2x direct plus --spool-poll (spool_target_s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from geofed_hpc.ps.tokens import TokenFile, tokens_path
from geofed_hpc.testing.proxy import Squid, TinyProxy, squid_binary, tinyproxy_binary
from geofed_hpc.testing.sshd import Sshd, sshd_unavailable
from geofed_hpc.testing.wan import FAR, Wan, exit_on_sigterm, unavailable_reason

PATHS = ("direct", "proxy", "relay", "tunnel", "spool")
PS_PORT, PROXY_PORT, RELAY_PORT, SSH_PORT = 50051, 3128, 50052, 2222
CLI = [sys.executable, "-m", "geofed_hpc.cli"]
REPO = Path(__file__).resolve().parents[1]
# One site's syncs through one path: connect, join, (seed the model once), then per sync: push, pull; prints JSON.
SITE = """
import json, os, sys, time, uuid
from datetime import timedelta
import numpy as np
from geofed_hpc import codec
from geofed_hpc.config import CodecConfig, PSConfig
from geofed_hpc.rpc import messages as m
from geofed_hpc.egress.tunnel import SshTunnel
from geofed_hpc.rpc.client import PSClient
from geofed_hpc.egress.spool import SpoolClient

address, ca, token, site, tls_name, params, syncs = sys.argv[1:8]
tunnel = None
if len(sys.argv) > 8:  # through an ssh tunnel (site.tunnel): opened before the clock starts, as a job opens it
    host, port = address.rsplit(":", 1)
    tunnel = SshTunnel(sys.argv[8], host, int(port), sys.argv[9], sys.argv[10]).start()
    address = tunnel.address
shape = (int(params) // 1024, 1024)
int8, fp32 = CodecConfig(name="int8"), CodecConfig(name="fp32")
cfg = PSConfig(insecure=False, ca_file=ca, tls_name=tls_name, rpc_timeout="300s", retry_budget="60s")
rng = np.random.default_rng(0)
times = []
poll = timedelta(seconds=float(os.environ.get("BENCH_SPOOL_POLL", "0.2")))
spooled = address.startswith("spool:")  # files in that folder, moved by `relay --spool`
with SpoolClient(cfg, address[6:], poll) if spooled else PSClient(cfg, address) as client:
    client.connect(timedelta(seconds=60))
    session = client.join(m.JoinRequest(site, token)).session_id
    version = client.heartbeat(m.HeartbeatRequest(session)).version
    if version == 0:
        init = m.PushHeader(session, 0, 0, 0, "fp32", 0, b"", "seed", init=True)
        client.push_delta(init, codec.encode({"w": np.zeros(shape, np.float32)}, fp32))
        version = client.heartbeat(m.HeartbeatRequest(session)).version
    for _ in range(int(syncs)):
        delta = codec.encode({"w": (rng.standard_normal(shape) * 1e-3).astype(np.float32)}, int8)
        started = time.perf_counter()
        header = m.PushHeader(session, version, 1, 1, "int8", 0, b"", uuid.uuid4().hex)
        reply = client.push_delta(header, delta)
        got, _ = client.pull_model(session, min_version=reply.version, have_version=version)
        times.append(time.perf_counter() - started)
        version = got.version
if tunnel is not None:
    tunnel.stop()
print(json.dumps({"times": times, "bytes": len(delta)}))
"""


class Lab:
    """The far link, a `ps up` over TLS in the PS's namespace, and the paths a site in the other namespace takes."""

    def __init__(self, wan: Wan, work: Path, params: int, spool_poll: float = 0.2, proxy: str = "squid") -> None:
        self.wan, self.work, self.params, self.spool_poll = wan, work, params, spool_poll
        self.ps_ip = wan.ps_ip("far")
        self.pki, state = work / "pki", work / "state"
        run([*CLI, "ps", "init", f"ps.ca_file={self.pki}/ca.crt", f"ps.cert_file={self.pki}/server.crt",
             f"ps.key_file={self.pki}/server.key", f"ps.tls_names=[{self.ps_ip}]"])  # fmt: skip
        self.token, _ = TokenFile(tokens_path(str(state))).issue("bench", timedelta(days=1))
        args = [f"ps.host={self.ps_ip}", f"ps.port={PS_PORT}", f"ps.state_dir={state}", "ps.insecure=false",
                f"ps.cert_file={self.pki}/server.crt", f"ps.key_file={self.pki}/server.key",
                "ps.aggregation=async", "codec=int8", "wandb_mode=disabled"]  # fmt: skip
        log = work / "ps.log"
        wan.popen(wan.ps_ns, [*CLI, "ps", "up", *args], log, cwd=REPO)
        wait_line(log, "parameter server on")
        relay_log = work / "relay.log"
        to = f"{self.ps_ip}:{PS_PORT}"
        wan.popen(wan.site_ns("far"), [*CLI, "relay", "--to", to, "--listen", f"127.0.0.1:{RELAY_PORT}"], relay_log)
        wait_line(relay_log, "relay on")
        spool_log = work / "spool-relay.log"  # the spool's relay, on the login node's side of the far link too
        spool = [*CLI, "relay", "--spool", str(work / "spool"), "--to", to, "--poll", f"{spool_poll}s",
                 "ps.insecure=false", f"ps.ca_file={self.pki}/ca.crt"]  # fmt: skip
        wan.popen(wan.site_ns("far"), spool, spool_log)
        wait_line(spool_log, "relay on spool")
        kind = Squid if proxy == "squid" else TinyProxy
        self.proxy = kind(work / "proxy", PROXY_PORT, allow=(self.ps_ip,), ports=(PS_PORT,), netns=wan.site_ns("far"))
        self.proxy.start()
        self.sshd = Sshd(work / "sshd", SSH_PORT, netns=wan.site_ns("far")).start()
        self.sites = 0

    def syncs(self, path: str, n: int) -> tuple[list[float], int, int]:
        """(seconds of each sync, payload bytes of a push, bytes both ways on the far link per sync) through `path`."""
        address, tls_name, env = f"{self.ps_ip}:{PS_PORT}", "", {}
        if path == "proxy":
            env = {"grpc_proxy": self.proxy.url}
        elif path == "relay":
            address, tls_name = f"127.0.0.1:{RELAY_PORT}", self.ps_ip
        elif path == "spool":
            address, env = f"spool:{self.work / 'spool'}", {"BENCH_SPOOL_POLL": str(self.spool_poll)}
        tunnel = [self.sshd.target, str(self.sshd.client_key), str(self.sshd.known_hosts)] if path == "tunnel" else []
        if tunnel:
            tls_name = self.ps_ip
        self.sites += 1
        before = self.wan.counters("far")
        ca, name = str(self.pki / "ca.crt"), f"bench-{self.sites}"
        argv = ["ip", "netns", "exec", self.wan.site_ns("far"), sys.executable, "-c", SITE, address, ca, self.token,
                name, tls_name, str(self.params), str(n), *tunnel]  # fmt: skip
        out = json.loads(run(argv, env=env).strip().splitlines()[-1])
        after = self.wan.counters("far")
        wire = sum(after[d]["bytes"] - before[d]["bytes"] for d in ("up", "down"))
        return out["times"], out["bytes"], wire // (n + 1)  # the join and the seed ride on the first sync's share


def run(argv: list[str], env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        sys.exit(f"bench/egress.py: {' '.join(argv[:6])}... failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def wait_line(log: Path, text: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while text not in (log.read_text(errors="replace") if log.exists() else ""):
        if time.monotonic() > deadline:
            sys.exit(f"bench/egress.py: no {text!r} in {log}:\n{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=Path("bench/results/egress.json"))
    parser.add_argument("--params", type=int, default=2_000_000, help="model parameters (int8: ~1 byte each a push)")
    parser.add_argument("--syncs", type=int, default=3, help="syncs per path in each round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every path, interleaved")
    parser.add_argument("--cc", default="cubic", help="TCP congestion control in every namespace")
    parser.add_argument("--spool-poll", type=float, default=0.2, help="spool: seconds between looks, site and relay")
    parser.add_argument(
        "--loss", type=float, default=FAR.loss_pct,
        help="random loss on the far link, %% (0 with --jitter-ms 0: a steady link, for paths that differ by a few %%)",
    )  # fmt: skip
    parser.add_argument("--proxy", choices=("squid", "tinyproxy"), default="squid", help="the proxy path's proxy")
    parser.add_argument("--paths", default=",".join(PATHS), help="the paths to measure, comma-separated")
    parser.add_argument("--jitter-ms", type=float, default=FAR.jitter.total_seconds() * 1e3, help="the far link's")
    args = parser.parse_args()
    link = replace(FAR, loss_pct=args.loss, jitter=timedelta(milliseconds=args.jitter_ms))
    paths = tuple(p for p in PATHS if p in args.paths.split(","))
    if "direct" not in paths or len(paths) != len(args.paths.split(",")):
        sys.exit(f"bench/egress.py: --paths must name direct and only paths of {', '.join(PATHS)}")
    binary = squid_binary() if args.proxy == "squid" else tinyproxy_binary()
    reason = unavailable_reason() or ("" if binary else f"{args.proxy} is not installed (`make install`, as root)")
    reason = reason or sshd_unavailable()
    if reason:
        sys.exit(f"bench/egress.py: {reason}")
    started = time.time()
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    wire: dict[str, list[int]] = {p: [] for p in PATHS}
    payload = 0
    with tempfile.TemporaryDirectory(prefix="geofed-egress-bench-") as tmp:
        with Wan({"far": link}, Path(tmp) / "wan", congestion_control=args.cc) as wan:
            lab = Lab(wan, Path(tmp), args.params, args.spool_poll, args.proxy)
            try:
                for r in range(args.rounds):
                    for path in paths if r % 2 == 0 else reversed(paths):
                        seconds, payload, per_sync = lab.syncs(path, args.syncs)
                        times[path] += seconds
                        wire[path].append(per_sync)
                        print(f"round {r + 1}/{args.rounds} {path}: {statistics.median(seconds):.2f}s a sync")
            finally:
                lab.proxy.stop()
                lab.sshd.stop()
    direct = statistics.median(times["direct"])
    rows = [
        {
            "path": path,
            "sync_s": statistics.median(times[path]),
            "bytes_per_sync": int(statistics.median(wire[path])),
            "overhead_vs_direct": statistics.median(times[path]) / direct - 1.0,
        }
        for path in paths
    ]
    out = {
        "bench": "egress",
        "link": f"far {link.describe()}",
        "congestion_control": args.cc,
        "params": args.params,
        "codec": "int8",
        "proxy": args.proxy,
        "push_payload_bytes": payload,
        "syncs_per_path": args.syncs * args.rounds,
        "spool_poll_s": args.spool_poll,
        "spool_target_s": 2 * direct + args.spool_poll,  # the issue's target: within 2x of direct plus the poll
        "seconds": time.time() - started,
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    print(f"{'path':<8}{'sync s':>9}{'wire bytes/sync':>17}{'vs direct':>11}")
    for row in rows:
        print(f"{row['path']:<8}{row['sync_s']:>9.2f}{row['bytes_per_sync']:>17,}{row['overhead_vs_direct']:>+10.1%}")
    print(f"{out['link']}; {args.params:,} parameters, int8 push of {payload:,} bytes; TCP {args.cc}; {args.json}")


if __name__ == "__main__":
    main()
