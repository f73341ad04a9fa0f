"""Flood benchmark: a legitimate two-site federation keeps training while one attack at a time runs beside it.

    python bench/flood.py --json flood.json                     # every row, 20 s each (about 7 minutes)
    python bench/flood.py --seconds 5 --attack stalled_pushes   # one attack and the baseline

The PS is `geofed-hpc ps up` in its own process, over TLS on 127.0.0.1, with enrollment tokens issued before it
starts (site "legit" for the federation, site "evil" for the attacker), ps.aggregation=async, codec=int8 and the
shipped limits, except ps.stream_idle_timeout=5s (60 s is long for a bench; --ps changes any setting). Two legit
sites (legit-0, legit-1), each its own process so that no attack shares their interpreter, loop: pull the updates
since their version, push an int8 delta of --params parameters based on it, heartbeat, rest --pause, and every
--rejoin-every iterations Join again with their rejoin token (what a requeued job does). A sample is the wall time
of one Join, push or pull, retries included; a row's samples are those that started in its --seconds window (a
call still running at the window's end is waited for, the attack still on, and counted with the time it took).

Rows, in this order: none (the baseline, always run), then each attack in its own process (bench/flood_attacks.py),
started and ramped up before the row's window and stopped by PID after it: idle_connections (500 TLS connections
that send nothing), stalled_pushes (32 enrolled sessions whose pushes send a header and stall), unauthenticated_streams
(200 calls in flight without a valid credential), long_polls (140 long-polls of one session), oversized_fields
(Joins with 16 MiB strings, pushes with 4 MiB push ids). The attacker calls from 127.0.0.2 (--attacker-source; a
relay in its process binds it), so the PS sees another host than the sites', as it would.

Targets, against the none row of the same run: every legit p99 under attack at most 2x none's, ps_rss_mb (the PS's
peak RSS during the row, VmRSS every 0.2 s) at most none's + 100 MB, versions (global updates during the row) > 0.
The PS, the sites and the attacker share this machine's cores, so the JSON's details give per row the CPU seconds of
each and the cores busy (/proc/stat), and after an attack whose process used 0.25 cores or more, a control window
with a process that burns as much CPU and calls nothing (--cpu-control): what the attacker's CPU alone does to the
sites. A note per missed row says what the numbers show: legit calls refused, the attacker's CPU, the PS's CPU, or
none of these (legit calls waited inside the PS). The baseline is measured once more after every attack
(baseline_after): the federation recovered, or not; the none row's p99s pool the calls of both baseline windows
(the machine drifts over a run of several minutes), its RSS is the first window's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ps_scale import adam_like, model_shapes  # noqa: E402
from wire import machine_ticks, own_cpu  # noqa: E402

from geofed_hpc import codec  # noqa: E402
from geofed_hpc.config import CodecConfig, PSConfig  # noqa: E402
from geofed_hpc.rpc import messages as m  # noqa: E402
from geofed_hpc.rpc.client import PSClient  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ATTACKS = ("idle_connections", "stalled_pushes", "unauthenticated_streams", "long_polls", "oversized_fields")
KEYS = ("legit_join_p99_s", "legit_push_p99_s", "legit_pull_p99_s")
PS_SETTINGS = {"stream_idle_timeout": "5s"}  # the one change from the shipped defaults (ps/local.yaml)
SIZES = {  # the attacks' sizes (bench/flood_attacks.py)
    "connections": 500,
    "sessions": 32,  # x ps.max_uploads_per_session stalled pushes: ps.max_streams_per_peer of one host
    "uploads_per_session": 2,
    "stall_bytes": 1 << 30,
    "streams": 200,
    "polls": 140,
    "in_flight": 4,
}
MAX_RATIO, MAX_RSS_MB = 2.0, 100.0
CONTROL_MIN_CORES = 0.25  # an attacker using this much CPU or more gets a cpu_burn control window (--cpu-control)
SAMPLE_EVERY = timedelta(milliseconds=200)
START_TIMEOUT = timedelta(seconds=90)
STOP_TIMEOUT = timedelta(seconds=60)
READY_TIMEOUT = timedelta(seconds=60)
SETTLE_TIMEOUT = timedelta(seconds=30)
ERROR_PAUSE = timedelta(milliseconds=500)


# ------------------------------------------------------------------------------------------------ a legit site
def site_main(spec: dict[str, Any]) -> None:
    """Child process: one legit site's loop (pull, push, heartbeat, a rejoin every few), a JSON line per call to
    spec["samples"]: {"k": kind, "t": start, "b": 1} when it starts, {"k", "t", "d": seconds, "err"} when it ends."""
    import logging

    from geofed_hpc.errors import AuthError, GeofedError

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    parent = os.getppid()
    out = open(spec["samples"], "a", buffering=1)  # noqa: SIM115 - open for the whole process

    def write(**row: Any) -> None:
        out.write(json.dumps(row) + "\n")

    class Retries(logging.Handler):  # PSClient says "<call> to <address> failed (<code>); retry ..." per retry
        def emit(self, record: logging.LogRecord) -> None:
            if "retry" in record.msg and isinstance(record.args, tuple) and len(record.args) >= 3:
                write(k="retry", t=time.monotonic(), call=str(record.args[0]), code=str(record.args[2]))

    logging.getLogger("geofed_hpc").addHandler(Retries())
    shapes = model_shapes(spec["params"])
    int8 = CodecConfig(name="int8")
    payloads = [codec.encode(adam_like(shapes, seed=100 * spec["index"] + k), int8) for k in range(3)]
    cfg = PSConfig(insecure=False, ca_file=spec["ca_file"])

    def timed(kind: str, call: Any, *args: Any, **kwargs: Any) -> Any:
        """call(*args, **kwargs), timed; the exception it raised, if it did."""
        t = time.monotonic()
        write(k=kind, t=t, b=1)
        try:
            result, err = call(*args, **kwargs), ""
        except GeofedError as exc:
            result, err = exc, f"{type(exc).__name__}: {str(exc)[:300]}"
        write(k=kind, t=t, d=time.monotonic() - t, err=err)
        return result

    with PSClient(cfg, spec["address"]) as client:
        client.connect()
        session, rejoin, have, i = "", "", None, 0
        while not stop.is_set() and time.monotonic() < spec["until"] and os.getppid() == parent:
            if not session:  # enroll (at the start, or after the PS forgot the session)
                reply = timed("join", client.join, m.JoinRequest(spec["site"], spec["token"]))
                if isinstance(reply, Exception):
                    stop.wait(ERROR_PAUSE.total_seconds())
                    continue
                session, rejoin, have = reply.session_id, reply.rejoin_token, None
            pulled = timed("pull", client.pull_model, session, have_version=have)
            if not isinstance(pulled, Exception):
                have = pulled[0].version
                header = m.PushHeader(session, have, 10, 10_000, "int8", 0, b"", uuid.uuid4().hex)
                pushed = timed("push", client.push_delta, header, payloads[i % len(payloads)])
                if not isinstance(pushed, Exception) and not pushed.accepted:
                    write(k="refused", t=time.monotonic(), reason=pushed.reason[:300])
                timed("heartbeat", client.heartbeat, m.HeartbeatRequest(session, have or 0))
            i += 1
            if i % spec["rejoin_every"] == 0:
                again = m.JoinRequest(spec["site"], rejoin, resume_session=session)
                reply = timed("join", client.join, again)
                if not isinstance(reply, Exception):
                    session, rejoin = reply.session_id, reply.rejoin_token
                elif isinstance(reply, AuthError):
                    session = ""
            if isinstance(pulled, AuthError):
                session = ""
            stop.wait(spec["pause"])
        if session:
            timed("heartbeat", client.heartbeat, m.HeartbeatRequest(session, leaving=True))


# ------------------------------------------------------------------------------------------------ processes
def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, every thread) process `pid` has used so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mb(pid: int) -> float:
    """Resident memory of process `pid` now (VmRSS), MB (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def spawn(cmd: list[str], log: Path, pipe: bool = False) -> subprocess.Popen[str]:
    """A child in its own session (a Ctrl-C reaches only this script, which stops its children by PID)."""
    with open(log, "a") as out:
        return subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE if pipe else out,
            stderr=out,
            text=True,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen[str] | None, timeout: timedelta = STOP_TIMEOUT) -> None:
    """SIGTERM, then SIGKILL after `timeout`; by PID, and only a child of this script."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout.total_seconds())
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def sizes(args: argparse.Namespace) -> dict[str, int]:
    """The attacks' sizes: SIZES with --size KEY=N."""
    given = dict(kv.split("=", 1) for kv in args.size)
    unknown = set(given) - set(SIZES)
    if unknown:
        raise SystemExit(f"--size: unknown {', '.join(sorted(unknown))} (known: {', '.join(SIZES)})")
    return SIZES | {k: int(v) for k, v in given.items()}


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(cond: Any, timeout: timedelta, what: str, alive: Any = lambda: True) -> None:
    deadline = time.monotonic() + timeout.total_seconds()
    while not cond():
        if not alive() or time.monotonic() > deadline:
            raise RuntimeError(f"gave up waiting for {what}")
        time.sleep(0.05)


@dataclass
class Sampler:
    """The PS's RSS every SAMPLE_EVERY, in a thread: (time.monotonic(), MB)."""

    pid: int
    samples: list[tuple[float, float]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.done.wait(SAMPLE_EVERY.total_seconds()):
            self.samples.append((time.monotonic(), proc_rss_mb(self.pid)))

    def peak_rss(self, t0: float, t1: float) -> float:
        return max((rss for t, rss in self.samples if t0 <= t <= t1), default=proc_rss_mb(self.pid))


class Federation:
    """The PS (`ps up`, TLS, tokens), its two legit sites, and the attacker of the moment, in a work directory."""

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        self.work, self.args = work, args
        self.ca = str(work / "ca.crt")
        self.state = work / "state"
        self.ps: subprocess.Popen[str] | None = None
        self.sites: list[subprocess.Popen[str]] = []
        self.attacker: subprocess.Popen[str] | None = None
        self.attacker_lines: list[str] = []
        self.tokens: dict[str, str] = {}
        self.port = 0
        self.admin = ""

    def start(self) -> None:
        from geofed_hpc.ps.statedir import admin_token
        from geofed_hpc.ps.tokens import TokenFile, tokens_path

        w = self.work
        keys = [f"ps.ca_file={self.ca}", f"ps.cert_file={w}/server.crt", f"ps.key_file={w}/server.key"]
        init = subprocess.run(
            [sys.executable, "-m", "geofed_hpc.cli", "ps", "init", *keys], cwd=ROOT, text=True, capture_output=True
        )
        if init.returncode:
            raise RuntimeError(f"ps init failed: {init.stdout}{init.stderr}")
        for family in ("legit", "evil"):
            self.tokens[family], _ = TokenFile(tokens_path(str(self.state))).issue(family, timedelta(days=1))
        self.port = free_port()
        cmd = [sys.executable, "-m", "geofed_hpc.cli", "ps", "up", "ps.host=127.0.0.1", f"ps.port={self.port}"]
        cmd += [f"ps.state_dir={self.state}", "ps.insecure=false", *keys[1:], "ps.aggregation=async", "codec=int8"]
        cmd += [f"ps.{k}={v}" for k, v in self.ps_settings().items()]
        self.ps = spawn(cmd, w / "ps.log")
        wait_until(lambda: "parameter server on" in self.ps_log(), START_TIMEOUT, "`ps up` to listen", self.ps_alive)
        self.admin = admin_token(self.state, create=False)
        self.sampler = Sampler(self.ps.pid)
        self.sampler.start()
        self.seed()
        until = time.monotonic() + 3600 * 6  # a bound on the sites' loops; they are stopped long before
        for i in range(2):
            spec = {"index": i, "site": f"legit-{i}", "address": self.address, "ca_file": self.ca, "until": until}
            spec |= {"token": self.tokens["legit"], "params": self.args.params, "pause": self.args.pause}
            spec |= {"rejoin_every": self.args.rejoin_every, "samples": str(w / f"site-{i}.jsonl")}
            self.sites.append(spawn([sys.executable, __file__, "--site", json.dumps(spec)], w / f"site-{i}.log"))
        wait_until(
            lambda: all(len(self.calls(i)) >= 6 for i in range(2)),
            START_TIMEOUT,
            "the sites to train",
            self.sites_alive,
        )

    def ps_settings(self) -> dict[str, str]:
        return PS_SETTINGS | dict(kv.split("=", 1) for kv in self.args.ps)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> PSClient:
        return PSClient(PSConfig(insecure=False, ca_file=self.ca), self.address)

    def seed(self) -> None:
        """The model's first version, pushed by the federation (site "legit") before its sites start."""
        shapes = model_shapes(self.args.params)
        with self.client() as client:
            client.connect()
            session = client.join(m.JoinRequest("legit", self.tokens["legit"])).session_id
            header = m.PushHeader(session, 0, 0, 0, "fp32", 0, b"", "init", init=True)
            reply = client.push_delta(header, codec.encode(adam_like(shapes, 1, 0.02), CodecConfig(name="fp32")))
            if not reply.accepted:
                raise RuntimeError(f"the init push was refused: {reply.reason}")
            client.heartbeat(m.HeartbeatRequest(session, leaving=True))

    def status(self) -> m.StatusReply:
        with self.client() as client:
            return client.status(self.admin)

    def ps_log(self) -> str:
        return (self.work / "ps.log").read_text(errors="replace")

    def ps_alive(self) -> bool:
        return self.ps is not None and self.ps.poll() is None

    def sites_alive(self) -> bool:
        return all(p.poll() is None for p in self.sites)

    def calls(self, i: int) -> list[dict[str, Any]]:
        path = self.work / f"site-{i}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    # ---------------------------------------------------------------- the attacker
    def start_attack(self, name: str, extra: dict[str, Any]) -> None:
        spec = {"attack": name, "host": "127.0.0.1", "port": self.port, "ca_file": self.ca} | extra
        spec |= {"token": self.tokens["evil"], "sources": self.args.attacker_source.split(",")}
        spec |= {"until": time.monotonic() + self.args.seconds + 600, "params": self.args.params} | sizes(self.args)
        cmd = [sys.executable, str(Path(__file__).with_name("flood_attacks.py")), json.dumps(spec)]
        self.attacker, self.attacker_lines = spawn(cmd, self.work / f"attack-{name}.log", pipe=True), []
        threading.Thread(target=self._read_attacker, args=(self.attacker,), daemon=True).start()
        attacker = self.attacker
        wait_until(
            lambda: any('"ready"' in ln for ln in self.attacker_lines),
            READY_TIMEOUT,
            f"{name} to ramp up",
            lambda: attacker.poll() is None,
        )

    def _read_attacker(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.attacker_lines.append(line)

    def stop_attack(self) -> dict[str, Any]:
        """Stop the attacker (SIGTERM, then SIGKILL) and return what it reported."""
        proc, self.attacker = self.attacker, None
        stop(proc, timedelta(seconds=15))
        if proc is not None and proc.stdout is not None:
            time.sleep(0.2)
        found = [json.loads(ln) for ln in self.attacker_lines if ln.startswith("{")]
        return {k: v for d in found for k, v in d.items()}

    def close(self) -> None:
        stop(self.attacker, timedelta(seconds=5))
        for p in self.sites:
            stop(p, timedelta(seconds=30))
        stop(self.ps)
        if hasattr(self, "sampler"):
            self.sampler.done.set()


# ------------------------------------------------------------------------------------------------ one row
def in_flight(calls: list[dict[str, Any]], before: float) -> bool:
    """The site's last call started before `before` and has not ended (a site makes one call at a time)."""
    started = [c for c in calls if c.get("b") and c["k"] != "retry"]
    if not started:
        return False
    last = started[-1]["t"]
    return last < before and not any(c["t"] == last and "d" in c for c in calls)


def run_row(
    fed: Federation, attack: str, args: argparse.Namespace, extra: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One row: the attack ramped up, the window of --seconds, the calls of the window finished, the attack stopped.
    `extra`: more of the attack's spec (cpu_burn: its cores)."""
    print(f"[{attack}] starting", flush=True)
    t_attack, rss0 = time.monotonic(), proc_rss_mb(fed.sampler.pid)
    if attack != "none":
        fed.start_attack(attack, extra or {})
    busy0, ticks0 = machine_ticks()
    self0 = own_cpu()
    ps_cpu0, t0 = proc_cpu(fed.sampler.pid), time.monotonic()
    sites_cpu0 = sum(proc_cpu(p.pid) for p in fed.sites)
    attack_pid = fed.attacker.pid if fed.attacker is not None else 0
    attack_cpu0 = proc_cpu(attack_pid) if attack_pid else 0.0
    v0 = fed.status().version
    print(f"[{attack}] attack in place; measuring {args.seconds:g}s", flush=True)
    deadline = t0 + args.seconds
    while time.monotonic() < deadline and fed.ps_alive() and fed.sites_alive():
        time.sleep(0.1)
    t1 = time.monotonic()
    status = fed.status()
    v1, streams = status.version, status.streams
    waited = time.monotonic()
    cap = max(args.seconds, 30.0)
    while any(in_flight(fed.calls(i), t1) for i in range(2)) and time.monotonic() - waited < cap:
        time.sleep(0.1)
    t2 = time.monotonic()
    busy1, ticks1 = machine_ticks()
    attack_cpu = (proc_cpu(attack_pid) - attack_cpu0) if attack_pid else 0.0
    ps_cpu = proc_cpu(fed.sampler.pid) - ps_cpu0
    sites_cpu = sum(proc_cpu(p.pid) for p in fed.sites) - sites_cpu0
    ours = attack_cpu + ps_cpu + sites_cpu + own_cpu() - self0
    others = (busy1 - busy0) / os.sysconf("SC_CLK_TCK") - ours  # processes that are not this benchmark's
    site_calls = [fed.calls(i) for i in range(2)]  # read before the attack stops: a call still held counts so far
    calls = [c for cs in site_calls for c in cs if t0 <= c["t"] < t1]
    reported = fed.stop_attack() if attack != "none" else {}
    t3 = time.monotonic()
    rows = summarize(attack, calls, t2, fed.sampler.peak_rss(t_attack, t3), v1 - v0)
    details = {
        "calls": {k: sum(1 for c in calls if c["k"] == k and "d" in c) for k in ("join", "push", "pull", "heartbeat")},
        "errors": [c["err"] for c in calls if c.get("err")][:20],
        "error_count": sum(1 for c in calls if c.get("err")),
        "retries": count(c["call"] + ":" + c["code"] for c in calls if c["k"] == "retry"),
        "pushes_refused": count(c["reason"][:80] for c in calls if c["k"] == "refused"),
        "unfinished": sum(1 for cs in site_calls if in_flight(cs, t1)),  # counted with their time so far
        "wait_after_window_s": round(t2 - t1, 2),
        "ps_streams_at_end": streams,
        "ps_alive": fed.ps_alive(),
        "attacker_cpu_s": round(attack_cpu, 2),
        "ps_cpu_s": round(ps_cpu, 2),
        "sites_cpu_s": round(sites_cpu, 2),
        "ps_rss_before_attack_mb": round(rss0, 1),
        "window_s": round(t2 - t0, 2),
        "cores_busy": round((busy1 - busy0) / max(1, ticks1 - ticks0), 2),
        "others_cores": round(max(0.0, others) / (t2 - t0), 2),
        "attacker": reported,
    }
    settle(fed, attack)
    print(f"[{attack}] done: {json.dumps(rows)}", flush=True)
    details["_window"] = (calls, t2)  # the calls themselves, for a pooled baseline (measure); not in the JSON
    return rows, details


def durations(calls: list[dict[str, Any]], kind: str, now: float) -> list[float]:
    """Seconds each call of `kind` took (one still running at `now` counts with its time so far)."""
    ends = {c["t"]: c["d"] for c in calls if c["k"] == kind and "d" in c}
    return [ends.get(c["t"], now - c["t"]) for c in calls if c["k"] == kind and c.get("b")]


def p99s(windows: list[tuple[list[dict[str, Any]], float]]) -> dict[str, float | None]:
    """The p99 of each kind of call over the calls of every window (calls, the window's end)."""
    out: dict[str, float | None] = {}
    for key, kind in zip(KEYS, ("join", "push", "pull"), strict=True):
        times = [d for calls, now in windows for d in durations(calls, kind, now)]
        out[key] = round(float(np.percentile(times, 99)), 4) if times else None
    return out


def summarize(attack: str, calls: list[dict[str, Any]], now: float, rss: float, versions: int) -> dict[str, Any]:
    """The row: p99 of each kind of call (one still running counts with its time so far)."""
    return {"attack": attack, **p99s([(calls, now)]), "ps_rss_mb": round(rss, 1), "versions": versions}


def count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def settle(fed: Federation, attack: str) -> None:
    """After an attack: wait until the PS holds no more than the sites' streams again."""
    deadline = time.monotonic() + SETTLE_TIMEOUT.total_seconds()
    while time.monotonic() < deadline and fed.ps_alive():
        if fed.status().streams <= 2:
            break
        time.sleep(0.5)
    else:
        print(f"[{attack}] the PS still holds streams {SETTLE_TIMEOUT.total_seconds():g}s after the attack", flush=True)
    time.sleep(1.0)


# ------------------------------------------------------------------------------------------------ verdicts
def verdicts(rows: list[dict[str, Any]], details: dict[str, dict[str, Any]]) -> tuple[dict, dict]:
    """Per attack row: which targets it met, and a note on a missed one."""
    base = rows[0]
    met, notes = {}, {}
    for row in rows[1:]:
        ok = {k: _within(row[k], base[k]) for k in KEYS}
        ok["ps_rss_mb"] = row["ps_rss_mb"] <= base["ps_rss_mb"] + MAX_RSS_MB
        ok["versions"] = row["versions"] > 0
        met[row["attack"]] = ok | {"all": all(ok.values())}
        if not all(ok.values()):
            notes[row["attack"]] = note(details[row["attack"]], details["none"], row, base)
    return met, notes


def _within(value: float | None, base: float | None) -> bool:
    return value is not None and base is not None and value <= MAX_RATIO * base


def note(d: dict[str, Any], base: dict[str, Any], row: dict[str, Any], base_row: dict[str, Any]) -> str:
    """Why a row missed a target, as far as the numbers tell: legit calls refused, the attacker's own CPU (and what a
    process burning as much CPU alone did: the cpu_control window), the PS's CPU, or none of these."""
    attacker, ps = d["attacker_cpu_s"] / d["window_s"], d["ps_cpu_s"] / d["window_s"]
    base_ps = base["ps_cpu_s"] / base["window_s"]
    why = []
    if d["retries"] or d["error_count"]:
        why.append(f"legit calls were refused or failed (retries {d['retries']}, {d['error_count']} errors)")
    if attacker >= 0.5:
        why.append(f"the attacker's own process took {attacker:.2f} cores of this machine")
    if ps >= base_ps + 0.25:
        why.append(f"the PS spent {ps - base_ps:.2f} more cores than in none on the attacker's calls")
    if d["others_cores"] >= 0.25:
        why.append(f"processes outside this benchmark took {d['others_cores']} cores meanwhile")
    cores = len(os.sched_getaffinity(0))
    if not why:
        short = "no core was short" if d["cores_busy"] < cores - 0.25 else "every core was busy"
        why.append(
            f"no legit call was refused and the attacker took little CPU ({short}): legit calls waited inside the PS"
        )
    text = "; ".join(why) + f" (cores busy {d['cores_busy']} of {cores})"
    control = d.get("cpu_control")
    if control:
        p99 = "/".join(f"{control[k]}" for k in KEYS)
        missed = [k for k in KEYS if not _within(row[k], base_row[k])]
        alone = [k.split("_")[1] for k in missed if not _within(control[k], base_row[k])]
        rest = [k.split("_")[1] for k in missed if _within(control[k], base_row[k])]
        text += (
            f". Control: a process burning {control['attacker_cpu_s'] / control['window_s']:.2f} cores and calling "
            f"nothing gave join/push/pull p99 {p99} s: "
        )
        if not alone:
            text += f"the attacker's CPU alone keeps {', '.join(rest)} within {MAX_RATIO:g}x none (the PS's side)"
        else:
            text += f"the attacker's CPU alone puts {', '.join(alone)} over {MAX_RATIO:g}x none" + (
                f", not {', '.join(rest)} (the PS's side)" if rest else " too"
            )
    return text


def table(rows: list[dict[str, Any]], met: dict[str, dict[str, bool]], details: dict[str, Any], after: Any) -> str:
    """The rows, with each attack's cpu_burn control under it and the baseline measured again after every attack."""
    head = f"{'attack':<26}{'join p99 s':>12}{'push p99 s':>12}{'pull p99 s':>12}{'PS RSS MB':>11}{'versions':>10}  met"
    lines = [head]

    def line(label: str, r: dict[str, Any], mark: str) -> str:
        cells = "".join(f"{'-' if r[k] is None else r[k]:>12}" for k in KEYS)
        return f"{label:<26}{cells}{r['ps_rss_mb']:>11}{r['versions']:>10}  {mark}"

    for r in rows:
        ok = met.get(r["attack"])
        missed = ",".join(k for k, v in (ok or {}).items() if not v and k != "all")
        lines.append(line(r["attack"], r, "baseline" if ok is None else ("yes" if ok["all"] else f"NO: {missed}")))
        control = details.get(r["attack"], {}).get("cpu_control")
        if control:
            lines.append(line("  cpu_burn (control)", control, "the attacker's CPU load, no calls to the PS"))
    if after:
        lines.append(line("none (again, after)", after, "recovery"))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", type=Path, default=Path("flood.json"), help="where the rows go (default flood.json)")
    p.add_argument("--seconds", type=float, default=20.0, help="measured window of each row (default 20)")
    p.add_argument("--params", type=float, default=1e6, help="model size of the legit deltas (default 1e6)")
    p.add_argument("--attack", action="append", choices=ATTACKS, help="run only this attack (repeatable; none always)")
    p.add_argument(
        "--attacker-source",
        default="127.0.0.2",
        help="loopback address(es) the attacker calls from, comma-separated (127.0.0.1: the sites' own)",
    )
    p.add_argument("--warmup", type=float, default=5.0, help="seconds the sites train before the first row")
    p.add_argument("--pause", type=float, default=0.2, help="seconds a site rests between iterations (default 0.2)")
    p.add_argument("--rejoin-every", type=int, default=2, help="a site joins again every this many iterations")
    p.add_argument(
        "--size",
        action="append",
        default=[],
        metavar="KEY=N",
        help=f"another size for the attacks (repeatable), of: {', '.join(f'{k}={v}' for k, v in SIZES.items())}",
    )
    p.add_argument(
        "--ps",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another ps.KEY=VALUE for `ps up` (repeatable; default: ps.stream_idle_timeout=5s)",
    )
    p.add_argument(
        "--cpu-control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after an attack whose process used >= 0.25 cores, a window with a process burning as much CPU and "
        "calling nothing: how much of the attack's effect is the CPU it takes from this machine (default on)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, samples) and print its path")
    p.add_argument("--site", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def measure(fed: Federation, args: argparse.Namespace) -> tuple[list[dict], dict[str, Any], dict | None]:
    """Every row (with its cpu_burn control where the attacker took CPU), then the baseline once more."""
    rows, details, after = [], {}, None
    for attack in ("none", *[a for a in ATTACKS if a in (args.attack or ATTACKS)]):
        row, details[attack] = run_row(fed, attack, args)
        rows.append(row)
        cores = details[attack]["attacker_cpu_s"] / details[attack]["window_s"]
        if args.cpu_control and attack != "none" and cores >= CONTROL_MIN_CORES and fed.ps_alive():
            control, info = run_row(fed, "cpu_burn", args, {"cores": round(cores, 2)})
            keep = ("attacker_cpu_s", "ps_cpu_s", "sites_cpu_s", "window_s", "cores_busy", "others_cores")
            details[attack]["cpu_control"] = control | {k: info[k] for k in keep}
        if not fed.ps_alive():
            print("the PS exited; its log ends:\n" + fed.ps_log()[-3000:], flush=True)
            break
    if fed.ps_alive():  # the baseline again, after every attack: did the federation recover?
        after, details["none_after"] = run_row(fed, "none", args)
        # the none row's p99s pool both baseline windows: the machine drifts over a run of several minutes
        rows[0] |= p99s([details["none"]["_window"], details["none_after"]["_window"]])
    for d in details.values():
        d.pop("_window", None)
    return rows, details, after


def report(args: argparse.Namespace, fed: Federation, measured: tuple, log: str, load: list[float]) -> dict:
    """The JSON written to --json."""
    rows, details, after = measured
    met, notes = verdicts(rows, details)
    return {
        "rows": rows,
        "met": met,
        "notes": notes,
        "targets": {
            "p99": f"each legit p99 under attack <= {MAX_RATIO:g} x the none row's",
            "ps_rss_mb": f"<= the none row's + {MAX_RSS_MB:g} MB",
            "versions": "> 0",
        },
        "baseline_after": after,
        "details": details,
        "settings": {
            "seconds": args.seconds,
            "params": args.params,
            "warmup_s": args.warmup,
            "pause_s": args.pause,
            "rejoin_every": args.rejoin_every,
            "ps": fed.ps_settings() | {"aggregation": "async", "codec": "int8", "tls": True, "tokens": True},
            "attacker_sources": args.attacker_source.split(","),
            "attack_sizes": sizes(args),
            "legit_sites": "2 processes (legit-0, legit-1), one PSClient each",
        },
        "ps_log": {
            "lines": log.count("\n"),
            "errors": [ln[:300] for ln in log.splitlines() if " ERROR " in ln or "Traceback" in ln][:20],
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "affinity": sorted(os.sched_getaffinity(0)),
            "load_average_at_start": load,
            "load_average_at_end": list(os.getloadavg()),
            "python": platform.python_version(),
        },
    }


def main() -> None:
    args = parse_args()
    if args.site:
        return site_main(json.loads(args.site))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleaned up like a Ctrl-C
    work = Path(tempfile.mkdtemp(prefix="flood-"))
    fed, load = Federation(work, args), list(os.getloadavg())
    try:
        print(f"starting the PS and two legit sites ({args.params:g} parameters) in {work}", flush=True)
        fed.start()
        time.sleep(args.warmup)
        measured = measure(fed, args)
    except BaseException:
        print("interrupted: stopping the PS, the sites and the attacker", file=sys.stderr, flush=True)
        raise
    finally:
        fed.close()
        log = fed.ps_log() if (work / "ps.log").exists() else ""
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    out = report(args, fed, measured, log, load)
    args.json.write_text(json.dumps(out, indent=1))
    rows, details, after = measured
    print(table(rows, out["met"], details, after))
    for attack, text in out["notes"].items():
        print(f"  {attack}: {text}")
    missed = [a for a, v in out["met"].items() if not v["all"]]
    print(
        f"wrote {args.json}; targets: p99 <= {MAX_RATIO:g}x none, PS RSS <= none + {MAX_RSS_MB:g} MB, versions > 0: "
        + ("missed in " + ", ".join(missed) if missed else "all met")
    )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
