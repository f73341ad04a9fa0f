"""Swarm benchmark: hundreds to thousands of protocol-faithful sites against one `ps up` and a group of three.

    python bench/swarm.py --json swarm.json                                  # the issue's rows (long, many cores)
    python bench/swarm.py --sites 10,100 --group-sites 30 --params 1e6 --minutes 0.5 --json swarm.json  # a quick look

Each simulated site is a thread holding its own PSClient (rpc/client.py: one gRPC channel, the project's retries)
in one of --procs worker processes. A site joins with its own enrollment token (issued before the PS starts, as
`geofed-hpc token issue` does: ps/tokens.py), then every sync, on a jittered cadence (--push-rate pushes per second
over the whole swarm, each site's interval jittered +-50%): pulls the global updates since the version it holds
(the full model once it is further behind than ps.downlink_history), pushes a real encoded delta of a model of
--params parameters based on that version (precomputed int8 or sparse payloads, codec/, so the PS decodes and folds
real data; its push id resent on retry; refused as too stale: pulled and pushed again, up to 3 times), and
heartbeats every ps.heartbeat_interval. Churn: every minute each site leaves (Heartbeat leaving) with probability
--churn and joins again a few seconds later with its one-time rejoin token, as a requeued job does. With
--long-poll, a site also waits for the next version between its syncs (a long-poll: the PS holds one handler thread
per waiting site).

The PS is `geofed-hpc ps up` (plaintext on 127.0.0.1, ps.aggregation=async, a state directory, Prometheus
/metrics); the group is three `ps up` peers (ps.peers, the deltas pooled every --peer-sync), each site dialling
its peer first and the next one second (bench/multi_ps.py starts them). Settings changed from the shipped
defaults, because every simulated site calls from 127.0.0.1: ps.max_streams_per_peer and ps.max_sessions (a real
federation's sites come from many hosts); --ps KEY=VALUE changes any other.

Row per (ps, sites, codec): pushes_per_s (pushes the PS applied per second of the window), push_p50_s/push_p99_s
(a push call, retries included), pull_p99_s, join_storm_s (every site joins at once: the first Join sent to the
last answered), ps_rss_mb (the PS's peak RSS over the row, VmHWM; a group: the largest peer's), ps_cpu_ms_per_push
(the PS processes' CPU over the window per applied push), lost (pushes a site was told were applied that the PS
did not apply) and doubled (pushes applied more than once, or applied without any site being told). Exactly-once
is read from the PS: one PS's pushes applied (ps/pushes_total on /metrics) against the distinct push ids the sites
were acknowledged; a group's push ids applied, per id (its peers' group.jsonl). The baseline is the smallest row
(10 sites) of the same kind in the same run (one PS; the group: a group row, else the one-PS row): targets at the
larger rows, push p99 <= 5x and RSS <= 2x of it, join storm <= 60 s, lost = doubled = 0. The sites, the PS and
anything else on the machine share its cores: the table shows the load average beside each row and the JSON the
cores busy, and a row the machine cannot carry says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flood import proc_cpu, spawn, stop, wait_until  # noqa: E402
from multi_ps import Peer  # noqa: E402
from ps_scale import adam_like, model_shapes  # noqa: E402
from wire import machine_ticks  # noqa: E402

from geofed_hpc import codec  # noqa: E402
from geofed_hpc.config import CodecConfig, PSConfig  # noqa: E402
from geofed_hpc.errors import StaleError  # noqa: E402
from geofed_hpc.rpc import messages as m  # noqa: E402
from geofed_hpc.rpc.client import PSClient  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEYS = (
    "ps",
    "sites",
    "params",
    "codec",
    "pushes_per_s",
    "push_p50_s",
    "push_p99_s",
    "pull_p99_s",
    "join_storm_s",
    "ps_rss_mb",
    "ps_cpu_ms_per_push",
    "lost",
    "doubled",
)
MAX_P99_RATIO, MAX_RSS_RATIO, MAX_STORM = 5.0, 2.0, timedelta(seconds=60)
START_TIMEOUT = timedelta(seconds=180)
READY_TIMEOUT = timedelta(minutes=5)
JOIN_GIVE_UP = timedelta(minutes=5)  # a site that cannot join in this long is counted as failed
SETTLE = timedelta(seconds=20)  # after the window: the calls in flight finish, the PS publishes its counters
HEARTBEAT = timedelta(seconds=10)
CHURN_PAUSE = timedelta(seconds=5)  # a leaving site is away for up to this long
STALE_TRIES = 3  # pushes of one sync refused as stale before the site waits for its next sync
SEED_SITE = "swarmseed"
SITE = "swarm{:05d}"  # site names without a numbered-job suffix: each its own family and token


def shapes_of(params: float) -> dict[str, tuple[int, ...]]:
    """The model's tensors: GPT-like (bench/ps_scale.py) from 4M parameters, one (rows, 256) matrix below it (a
    test's small model)."""
    if params >= 4e6:
        return model_shapes(params)
    return {"w": (max(1, int(params) // 256), 256)}


# ------------------------------------------------------------------------------------------------ the sites
class SiteStats:
    """What one worker process's sites saw, merged into one JSON line at the end."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.joins: list[float] = []  # wall time each first Join was answered
        self.push: list[tuple[float, float]] = []  # (wall start, seconds)
        self.pull: list[tuple[float, float]] = []
        self.acked: list[str] = []  # push ids the PS said it applied (accepted, or a duplicate of an accepted)
        self.pushed_sites: set[str] = set()  # sites with at least one push acknowledged
        self.refused: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.churned = 0
        self.failed_joins = 0

    def error(self, what: str, exc: BaseException) -> None:
        key = f"{what}: {type(exc).__name__}: {str(exc)[:120]}"
        with self.lock:
            self.errors[key] = self.errors.get(key, 0) + 1


def join(client: PSClient, request: m.JoinRequest, stats: SiteStats, give_up: float) -> m.JoinReply | None:
    """Join, again and again while the PS is busy (bounded by `give_up`, wall time)."""
    while time.time() < give_up:
        try:
            return client.join(request)
        except Exception as exc:  # noqa: BLE001 - counted, and tried again
            stats.error("join", exc)
            time.sleep(random.uniform(0.2, 1.0))
    return None


def site_loop(spec: dict[str, Any], i: int, site: str, token: str, payloads: list[bytes], stats: SiteStats) -> None:
    """One site: join at spec["t0"], then syncs (pull, push), heartbeats and churn until spec["until"]."""
    rng = random.Random(spec["seed"] * 100_003 + i)
    cfg = PSConfig(rpc_timeout=timedelta(minutes=5), retry_budget=timedelta(seconds=60))
    with PSClient(cfg, spec["address"][i % len(spec["address"])]) as client:
        time.sleep(max(0.0, spec["t0"] - time.time()))
        reply = join(client, m.JoinRequest(site, token), stats, spec["t0"] + JOIN_GIVE_UP.total_seconds())
        if reply is None:
            with stats.lock:
                stats.failed_joins += 1
            return
        with stats.lock:
            stats.joins.append(time.time())
        session, rejoin, have = reply.session_id, reply.rejoin_token, None
        interval = spec["interval_s"]
        start = spec["t1"]
        next_sync = start + rng.uniform(0, interval)
        next_hb = start + rng.uniform(0, HEARTBEAT.total_seconds())
        next_churn = start + rng.uniform(0, 60)
        k = 0
        while time.time() < spec["until"]:
            now = time.time()
            due = min(next_sync, next_hb, next_churn, spec["until"])
            if due > now:
                if spec["long_poll"] and have is not None and next_sync - now > 1.0:
                    _long_poll(client, session, have, min(next_sync - now, due - now), stats)
                else:
                    time.sleep(due - now)
                continue
            if now >= next_churn:
                next_churn += 60
                if rng.random() < spec["churn"]:
                    try:
                        client.heartbeat(m.HeartbeatRequest(session, have or 0, leaving=True))
                        time.sleep(rng.uniform(0, CHURN_PAUSE.total_seconds()))
                        again = m.JoinRequest(site, rejoin, resume_session=session)
                        reply = join(client, again, stats, time.time() + JOIN_GIVE_UP.total_seconds())
                        if reply is None:
                            return
                        session, rejoin = reply.session_id, reply.rejoin_token
                        with stats.lock:
                            stats.churned += 1
                    except Exception as exc:  # noqa: BLE001
                        stats.error("churn", exc)
                continue
            if now >= next_hb:
                next_hb += HEARTBEAT.total_seconds()
                try:
                    client.heartbeat(m.HeartbeatRequest(session, have or 0))
                except Exception as exc:  # noqa: BLE001
                    stats.error("heartbeat", exc)
                continue
            next_sync += interval * rng.uniform(0.5, 1.5)
            for _ in range(STALE_TRIES):  # a push refused as stale: pull again and push again, as a site does
                have = _pull(client, session, have, stats)
                if have is None:
                    break
                outcome = _push(client, session, have, payloads[k % len(payloads)], spec["codec"], stats)
                if outcome == "acked":
                    with stats.lock:
                        stats.pushed_sites.add(site)
                if outcome != "stale":
                    break
            k += 1
        try:
            client.heartbeat(m.HeartbeatRequest(session, have or 0, leaving=True))
        except Exception as exc:  # noqa: BLE001
            stats.error("leave", exc)


def _pull(client: PSClient, session: str, have: int | None, stats: SiteStats) -> int | None:
    """The global updates since `have` (the whole model at first or when far behind); the version now held."""
    t = time.time()
    try:
        header, _payload = client.pull_model(session, have_version=have)
    except Exception as exc:  # noqa: BLE001
        stats.error("pull", exc)
        return have
    with stats.lock:
        stats.pull.append((t, time.time() - t))
    return header.version


def _long_poll(client: PSClient, session: str, have: int, seconds: float, stats: SiteStats) -> None:
    """Wait (on the PS) up to `seconds` for the version after `have`; what arrives is not kept."""
    try:
        client.pull_model(session, have + 1, timedelta(seconds=seconds), have_version=have)
    except Exception as exc:  # noqa: BLE001
        stats.error("long-poll", exc)
        time.sleep(min(seconds, 1.0))


def _push(client: PSClient, session: str, base: int, payload: bytes, name: str, stats: SiteStats) -> str:
    """One push (its id resent on retry): "acked" (the PS said it applied it), "stale" (refused: too many versions
    behind), or "failed"."""
    push_id = uuid.uuid4().hex
    header = m.PushHeader(session, base, 10, 10_000, name, 0, b"", push_id)
    t = time.time()
    try:
        reply = client.push_delta(header, payload)
    except StaleError as exc:
        stats.error("push", exc)
        return "stale"
    except Exception as exc:  # noqa: BLE001 - its reply never came: ask the PS whether it holds the push
        stats.error("push", exc)
        try:
            held = client.heartbeat(m.HeartbeatRequest(session, base, push_id=push_id)).push
        except Exception:  # noqa: BLE001
            held = ""
        if held == "applied":
            with stats.lock:
                stats.acked.append(push_id)
        return "acked" if held == "applied" else "failed"
    with stats.lock:
        stats.push.append((t, time.time() - t))
        if reply.accepted:
            stats.acked.append(push_id)
        else:
            key = re.sub(r"\d+", "N", reply.reason)[:80]
            stats.refused[key] = stats.refused.get(key, 0) + 1
    return "acked" if reply.accepted else "failed"


def worker_main(spec: dict[str, Any]) -> None:
    """Child process: its share of the sites; prints "ready", reads the start times, prints its stats at the end."""
    shapes = shapes_of(spec["params"])
    cfg = CodecConfig(name=spec["codec"])
    payloads = [codec.encode(adam_like(shapes, seed=1000 * spec["seed"] + k), cfg) for k in range(2)]
    stats = SiteStats()
    print(json.dumps({"ready": True, "payload_bytes": [len(p) for p in payloads]}), flush=True)
    times = json.loads(sys.stdin.readline())
    spec |= times
    threads = [
        threading.Thread(target=site_loop, args=(spec, i, site, token, payloads, stats), daemon=True)
        for i, (site, token) in enumerate(spec["sites"])
    ]
    for t in threads:
        t.start()
    bound = spec["until"] + JOIN_GIVE_UP.total_seconds() + 600
    for t in threads:
        t.join(timeout=max(0.0, bound - time.time()))
    out = {
        "joins": stats.joins,
        "push": stats.push,
        "pull": stats.pull,
        "acked": stats.acked,
        "refused": stats.refused,
        "errors": stats.errors,
        "churned": stats.churned,
        "pushed_sites": len(stats.pushed_sites),
        "failed_joins": stats.failed_joins,
        "stuck": sum(t.is_alive() for t in threads),
    }
    print(json.dumps(out), flush=True)


# ------------------------------------------------------------------------------------------------ the PS side
def raise_fd_limit(need: int) -> int:
    """Raise the soft limit on open files to `need` (at most the hard limit); the limit now. Children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, need)) if hard != resource.RLIM_INFINITY else max(soft, need)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return want


def issue_tokens(state: Path, sites: list[str]) -> list[str]:
    """An enrollment token per site, as `geofed-hpc token issue site=...` stores them (hashed in tokens.json)."""
    from geofed_hpc.ps.statedir import check_state_dir
    from geofed_hpc.ps.tokens import TokenFile, tokens_path

    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_state_dir(state)
    tokens = TokenFile(tokens_path(str(state)))
    return [token for token, _ in tokens.issue_many(sites, timedelta(days=1))]


def free_port() -> int:
    from multi_ps import free_pair

    return free_pair()


def ps_settings(sites: int, args: argparse.Namespace) -> list[str]:
    """The `ps up` settings every PS of a row gets (see the module's docstring)."""
    base = {
        "ps.insecure": "true",
        "ps.aggregation": "async",
        "codec": args.codec_now,
        "ps.max_streams_per_peer": str(max(64, 3 * sites + 64)),
        "ps.max_sessions": str(max(4096, 2 * sites + 64)),
        "ps.snapshot_every": "50",
    }
    base |= dict(kv.split("=", 1) for kv in args.ps)
    return [f"{k}={v}" for k, v in base.items()]


class Servers:
    """The PS processes of a row: one `ps up`, or three peers of a group; each with a metrics port."""

    def __init__(self, work: Path, kind: str, sites: int, args: argparse.Namespace) -> None:
        self.work, self.kind = work, kind
        self.procs: list[subprocess.Popen[Any]] = []
        self.states: list[Path] = []
        self.metrics: list[int] = []
        self.addresses: list[str] = []
        self.logs: list[Path] = []
        self.peers: list[Peer] = []
        n = 1 if kind == "single" else 3
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(n)]
        self.metrics = [free_port() for _ in range(n)]
        self.states = [work / f"ps-{r}" for r in range(n)]
        self.settings = ps_settings(sites, args)
        self.args = args

    def start(self, tokens_from: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for r, address in enumerate(self.addresses):
            self.states[r].mkdir(parents=True, exist_ok=True, mode=0o700)
            if self.states[r] != tokens_from:
                shutil.copy(tokens_from / "tokens.json", self.states[r] / "tokens.json")
            port = address.rsplit(":", 1)[1]
            extra = [f"ps.metrics_port={self.metrics[r]}", "ps.metrics_host=127.0.0.1", *self.settings]
            if self.kind == "single":
                argv = [sys.executable, "-m", "geofed_hpc.cli", "ps", "up", "ps.host=127.0.0.1", f"ps.port={port}"]
                argv += [f"ps.state_dir={self.states[r]}", *extra]
                log = self.work / f"ps-{r}.log"
                self.procs.append(spawn(argv, log))
                self.logs.append(log)
            else:
                if r == 0:
                    rendezvous = f"127.0.0.1:{free_port()}"
                peer = Peer(self.work, r, self.addresses, rendezvous, argparse.Namespace(local_steps=1))
                peer.argv += ["ps.host=127.0.0.1", f"ps.peer_sync_interval={self.args.peer_sync}", *extra]
                with open(peer.log, "ab") as out:
                    peer.proc = subprocess.Popen(
                        peer.argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                    )
                self.peers.append(peer)
                self.procs.append(peer.proc)  # type: ignore[arg-type]
                self.logs.append(peer.log)

        def serving() -> bool:
            return all(log.exists() and "parameter server on" in log.read_text(errors="replace") for log in self.logs)

        wait_until(serving, START_TIMEOUT, "`ps up` to listen", lambda: all(p.poll() is None for p in self.procs))

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def cpu(self) -> float:
        return sum(proc_cpu(p.pid) for p in self.procs)

    def peak_rss_mb(self) -> float:
        """The largest VmHWM (peak resident memory) among the PS processes, MB."""
        peaks = []
        for p in self.procs:
            try:
                text = Path(f"/proc/{p.pid}/status").read_text()
            except OSError:
                continue
            peaks += [int(ln.split()[1]) / 1024 for ln in text.splitlines() if ln.startswith("VmHWM:")]
        return max(peaks, default=0.0)

    def pushes_applied(self) -> int:
        """Deltas the PS applied (ps/pushes_total on its /metrics), summed over the PS processes."""
        total = 0
        for port in self.metrics:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:  # noqa: S310
                text = reply.read().decode()
            found = re.search(r'^geofed_ps_pushes_total\{site="ps"\} ([0-9.e+]+)$', text, re.M)
            total += int(float(found.group(1))) if found else 0
        return total

    def group_push_ids(self) -> list[str]:
        """Every push id the group applied, once per time it was applied (the peer that outlived the row's
        group.jsonl; all peers record the same rows)."""
        path = self.states[0] / "group.jsonl"
        if not path.exists():
            return []
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [p for r in rows if r.get("kind") == "applied" for p in r.get("push_ids", [])]

    def close(self) -> None:
        for p in self.procs:
            stop(p, timedelta(seconds=60))


def seed(address: str, token: str, params: float) -> None:
    """The model's first version (fp32, pushed with init), as a federation's first site does."""
    shapes = shapes_of(params)
    with PSClient(PSConfig(rpc_timeout=timedelta(minutes=5)), address) as client:
        client.connect()
        session = client.join(m.JoinRequest(SEED_SITE, token)).session_id
        header = m.PushHeader(session, 0, 0, 0, "fp32", 0, b"", "init", init=True)
        reply = client.push_delta(header, codec.encode(adam_like(shapes, 1, 0.02), CodecConfig(name="fp32")))
        if not reply.accepted:
            raise RuntimeError(f"the init push was refused: {reply.reason}")
        client.heartbeat(m.HeartbeatRequest(session, leaving=True))


def wait_seeded(address: str, token: str, version: int = 0) -> None:
    """Until the PS (a group: every peer) holds an initialized model."""
    with PSClient(PSConfig(), address) as client:
        client.connect()

        def ready() -> bool:
            return client.status(token).initialized

        wait_until(ready, START_TIMEOUT, f"{address} to hold the seeded model")


# ------------------------------------------------------------------------------------------------ one row
def percentile(samples: list[float], q: float) -> float | None:
    return round(float(np.percentile(samples, q)), 4) if samples else None


def run_row(kind: str, sites: int, params: float, codec_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start the PS(es), the sites' workers; join storm; the measured window; exactly-once; stop everything."""
    args.codec_now = codec_name
    work = Path(tempfile.mkdtemp(prefix="swarm-", dir=args.work_dir))
    names = [SITE.format(i) for i in range(sites)]
    t_issue = time.monotonic()
    tokens = issue_tokens(work / "ps-0", [SEED_SITE, *names])
    print(f"  issued {sites + 1} tokens in {time.monotonic() - t_issue:.1f}s", flush=True)
    servers = Servers(work, kind, sites, args)
    workers: list[subprocess.Popen[str]] = []
    load0 = list(os.getloadavg())
    try:
        servers.start(work / "ps-0")
        seed(servers.addresses[0], tokens[0], params)
        for address in servers.addresses:
            wait_seeded(address, tokens[0])
        rss_seeded = servers.peak_rss_mb()
        procs = min(args.procs, sites)
        interval = sites / args.push_rate  # each site's mean seconds between syncs
        for w in range(procs):
            mine = [(names[i], tokens[1 + i]) for i in range(w, sites, procs)]
            # site i dials its peer first (i % peers), the next one second
            dial = [
                ",".join(servers.addresses[(j + d) % len(servers.addresses)] for d in range(len(servers.addresses)))
                for j in range(len(servers.addresses))
            ]
            spec = {"sites": mine, "address": dial, "params": params, "codec": codec_name, "seed": w}
            spec |= {"interval_s": interval, "churn": args.churn, "long_poll": args.long_poll}
            with open(work / f"w{w}.log", "a") as log:
                cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
                workers.append(
                    subprocess.Popen(
                        cmd,
                        cwd=ROOT,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        text=True,
                        start_new_session=True,
                    )
                )
        for p in workers:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"a worker exited before it was ready: {(work / 'w0.log').read_text()[-2000:]}")
        t0 = time.time() + 1.0
        window = args.minutes * 60
        # the window opens once every site joined (the storm) and had a first sync's worth of time to spread out
        t1 = t0 + (args.warmup if args.warmup is not None else min(120.0, max(10.0, sites / 20)))
        until = t1 + window
        for p in workers:
            assert p.stdin is not None
            p.stdin.write(json.dumps({"t0": t0, "t1": t1, "until": until}) + "\n")
            p.stdin.flush()
        time.sleep(max(0.0, t1 - time.time()))
        cpu1, applied1, (busy1, ticks1) = servers.cpu(), servers.pushes_applied(), machine_ticks()
        time.sleep(max(0.0, until - time.time()))
        cpu2, applied2, (busy2, ticks2) = servers.cpu(), servers.pushes_applied(), machine_ticks()
        load1 = list(os.getloadavg())
        results = []
        for p in workers:
            assert p.stdout is not None
            out = ""
            for line in p.stdout:  # bounded: the worker ends its threads by spec["until"] + a bound
                out = line
            results.append(json.loads(out) if out.strip().startswith("{") else {})
            p.wait(timeout=60)
        time.sleep(SETTLE.total_seconds() / 4)
        applied_end = servers.pushes_applied()
        group_ids = servers.group_push_ids() if kind == "group" else []
        alive = servers.alive()
        peak = servers.peak_rss_mb()
    finally:
        for p in workers:
            stop(p, timedelta(seconds=10))
        servers.close()
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"  kept {work}")
    merged: dict[str, Any] = {"joins": [], "push": [], "pull": [], "acked": [], "refused": {}, "errors": {}}
    merged |= {"churned": 0, "failed_joins": 0, "stuck": 0, "pushed_sites": 0}
    for r in results:
        for key in ("joins", "push", "pull", "acked"):
            merged[key] += r.get(key, [])
        for key in ("refused", "errors"):
            for k, v in r.get(key, {}).items():
                merged[key][k] = merged[key].get(k, 0) + v
        for key in ("churned", "failed_joins", "stuck", "pushed_sites"):
            merged[key] += r.get(key, 0)
    acked = set(merged["acked"])
    if kind == "group":
        counts: dict[str, int] = {}
        for p in group_ids:
            counts[p] = counts.get(p, 0) + 1
        lost = len(acked - set(counts))
        doubled = sum(c - 1 for c in counts.values()) + len(set(counts) - acked)
    else:
        lost = max(0, len(acked) - applied_end)
        doubled = max(0, applied_end - len(acked))
    in_window = [d for t, d in merged["push"] if t1 <= t < until]
    pulls = [d for t, d in merged["pull"] if t1 <= t < until]
    window_pushes = (applied2 - applied1) if kind == "single" else len(in_window)
    row = {
        "ps": kind,
        "sites": sites,
        "params": sum(math.prod(s) for s in shapes_of(params).values()),
        "codec": codec_name,
        "pushes_per_s": round(window_pushes / window, 3),
        "push_p50_s": percentile(in_window, 50),
        "push_p99_s": percentile(in_window, 99),
        "pull_p99_s": percentile(pulls, 99),
        "join_storm_s": round(max(merged["joins"]) - t0, 2) if merged["joins"] else None,
        "ps_rss_mb": round(peak, 1),
        "ps_cpu_ms_per_push": round(1000 * (cpu2 - cpu1) / window_pushes, 1) if window_pushes else None,
        "lost": lost,
        "doubled": doubled,
    }
    detail = {
        "joined": len(merged["joins"]),
        "failed_joins": merged["failed_joins"],
        "churned": merged["churned"],
        "pushed_sites": merged["pushed_sites"],
        "stuck_threads": merged["stuck"],
        "pushes_acked": len(acked),
        "pushes_applied": len(group_ids) if kind == "group" else applied_end,
        "push_calls_in_window": len(in_window),
        "pull_calls_in_window": len(pulls),
        "refused": merged["refused"],
        "errors": dict(sorted(merged["errors"].items(), key=lambda kv: -kv[1])[:12]),
        "ps_alive_at_end": alive,
        "ps_rss_seeded_mb": round(rss_seeded, 1),
        "ps_cpu_s_window": round(cpu2 - cpu1, 2),
        "cores_busy": round((busy2 - busy1) / max(1, ticks2 - ticks1), 2),
        "load_average_start": [round(x, 2) for x in load0],
        "load_average_end": [round(x, 2) for x in load1],
        "interval_s": round(interval, 1),
        "window_s": window,
        "workers": procs,
    }
    return row | {"_detail": detail}


# ------------------------------------------------------------------------------------------------ main
def verdicts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each row's targets against its baseline: the smallest row of the same kind (one PS, or the group), codec and
    params, so a row measures what more sites cost, not what a group costs; a group row with no smaller group row
    is held to the smallest one-PS row."""
    out: dict[str, Any] = {}
    for r in rows:
        like = [b for b in rows if b["codec"] == r["codec"] and b["params"] == r["params"]]
        base = min((b for b in like if b["ps"] == r["ps"]), key=lambda b: b["sites"], default=None)
        if base is r or base is None:
            base = min((b for b in like if b["ps"] == "single"), key=lambda b: b["sites"], default=None)
        if base is None or base is r:
            continue
        ok = {
            "push_p99": r["push_p99_s"] is not None
            and base["push_p99_s"] is not None
            and r["push_p99_s"] <= MAX_P99_RATIO * base["push_p99_s"],
            "rss": r["ps_rss_mb"] <= MAX_RSS_RATIO * base["ps_rss_mb"],
            "join_storm": r["join_storm_s"] is not None and r["join_storm_s"] <= MAX_STORM.total_seconds(),
            "exactly_once": r["lost"] == 0 and r["doubled"] == 0,
        }
        out[f"{r['ps']}-{r['sites']}-{r['codec']}-{r['params']}"] = ok | {"all": all(ok.values())}
    return out


def codec_timing(params: float, name: str, repeats: int = 3) -> dict[str, float]:
    """The least seconds of 3 encodes and 3 decodes of one delta with this codec (in this process): the PS's share of a
    push (decode) and of a version (encode and decode of the downlink's update), for the capacity model."""
    delta = adam_like(shapes_of(params), seed=99)
    cfg = CodecConfig(name=name)
    enc, dec, payload = [], [], b""
    for _ in range(repeats):
        t = time.perf_counter()
        payload = codec.encode(delta, cfg)
        enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        codec.decode(payload)
        dec.append(time.perf_counter() - t)
    n = sum(math.prod(s) for s in shapes_of(params).values())
    return {"encode_s": round(min(enc), 4), "decode_s": round(min(dec), 4), "bytes_per_param": len(payload) / n}


def table(rows: list[dict[str, Any]], details: list[dict[str, Any]]) -> str:
    head = (
        f"{'ps':<7}{'sites':>6}{'params':>10}{'codec':>7}{'push/s':>8}{'push p50':>9}{'push p99':>9}{'pull p99':>9}"
        f"{'storm s':>8}{'RSS MB':>8}{'cpu ms':>8}{'lost':>5}{'dbl':>4}  load (1m at start/end)"
    )
    lines = [head]
    for r, d in zip(rows, details, strict=True):
        cells = [
            f"{r['ps']:<7}{r['sites']:>6}{r['params']:>10}{r['codec']:>7}{r['pushes_per_s']:>8}",
            *(f"{'-' if r[k] is None else r[k]:>9}" for k in ("push_p50_s", "push_p99_s", "pull_p99_s")),
            f"{'-' if r['join_storm_s'] is None else r['join_storm_s']:>8}{r['ps_rss_mb']:>8}",
            f"{'-' if r['ps_cpu_ms_per_push'] is None else r['ps_cpu_ms_per_push']:>8}{r['lost']:>5}{r['doubled']:>4}",
            f"  {d['load_average_start'][0]}/{d['load_average_end'][0]}",
        ]
        lines.append("".join(cells))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", type=Path, default=Path("swarm.json"))
    p.add_argument("--sites", default="10,100,1000", help="sites per row on one PS (comma-separated)")
    p.add_argument("--group-sites", default="3000", help="sites per row on a group of three ('' for none)")
    p.add_argument("--params", default="10e6", help="model sizes (comma-separated)")
    p.add_argument("--codecs", default="int8,sparse")
    p.add_argument("--minutes", type=float, default=3.0, help="measured window of each row")
    p.add_argument("--push-rate", type=float, default=1.0, help="pushes per second over the whole swarm")
    p.add_argument("--churn", type=float, default=0.1, help="share of sites that leave and rejoin each minute")
    p.add_argument("--procs", type=int, default=4, help="worker processes the sites are spread over")
    p.add_argument("--peer-sync", default="5s", help="a group's ps.peer_sync_interval")
    p.add_argument("--long-poll", action="store_true", help="sites long-poll for the next version between syncs")
    p.add_argument("--ps", action="append", default=[], metavar="KEY=VALUE", help="another `ps up` setting")
    p.add_argument("--warmup", type=float, default=None, help="seconds from the join storm to the window")
    p.add_argument("--work-dir", default=None, help="where the PS state directories go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep each row's work directory (logs, state)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker_main(json.loads(args.worker))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    plan = [("single", int(s)) for s in args.sites.split(",") if s]
    plan += [("group", int(s)) for s in args.group_sites.split(",") if s]
    fds = raise_fd_limit(4 * max(n for _, n in plan) + 1024)
    print(f"open files limit {fds}; load average {os.getloadavg()}; {os.cpu_count()} cores", flush=True)
    rows, details, timing = [], [], {}
    for params in (float(x) for x in args.params.split(",")):
        for name in args.codecs.split(","):
            timing[f"{name}-{params:g}"] = codec_timing(params, name) | {"load_average": os.getloadavg()[0]}
            for kind, sites in plan:
                print(f"[{kind} {sites} sites, {params:g} params, {name}] {time.strftime('%H:%M:%S')}", flush=True)
                try:
                    row = run_row(kind, sites, params, name, args)
                except Exception as exc:  # noqa: BLE001 - a row the machine cannot carry is reported, the run goes on
                    print(f"  failed: {type(exc).__name__}: {exc}", flush=True)
                    details.append({"failed": f"{type(exc).__name__}: {str(exc)[:500]}", "ps": kind, "sites": sites})
                    continue
                detail = row.pop("_detail")
                rows.append(row)
                details.append(detail | {"ps": kind, "sites": sites, "codec": name})
                print(f"  {json.dumps(row)}\n  {json.dumps(detail)}", flush=True)
                args.json.write_text(json.dumps({"rows": rows, "details": details}, indent=1))
    met = verdicts(rows)
    out = {
        "rows": rows,
        "met": met,
        "targets": {
            "push_p99": f"<= {MAX_P99_RATIO:g}x the smallest row of the same kind (one PS, group), codec and params",
            "ps_rss_mb": f"<= {MAX_RSS_RATIO:g}x that row's",
            "join_storm_s": f"<= {MAX_STORM.total_seconds():g}",
            "lost_doubled": "0",
        },
        "details": details,
        "codec_timing": timing,
        "settings": {
            "minutes": args.minutes,
            "push_rate": args.push_rate,
            "churn": args.churn,
            "procs": args.procs,
            "long_poll": args.long_poll,
            "ps": args.ps,
            "peer_sync": args.peer_sync,
        },
        "machine": {"cpu_count": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0))},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(table(rows, [d for d in details if "failed" not in d]))
    for key, ok in met.items():
        print(
            f"  {key}: "
            + ("all targets met" if ok["all"] else "missed " + ", ".join(k for k, v in ok.items() if not v))
        )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
