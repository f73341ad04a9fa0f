"""Observability end to end: a real PS's /metrics after pushes over gRPC, and a local federation's W&B runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.client.events import preemptions
from geofed_hpc.config import CodecConfig, RunConfig
from geofed_hpc.errors import UnavailableError
from geofed_hpc.metrics import METRIC_HELP, read_jsonl
from geofed_hpc.ps.app import ParameterServer
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from tests.conftest import ps_config, small_params
from tests.dist_util import free_port

PS_METRICS = [n for n in METRIC_HELP if n.startswith("ps/")]
# Metrics only a GPU site has: the CPU-only test federation below must not log them (no CUDA, nothing to measure).
GPU_ONLY = ["sys/gpu_util", "sys/gpu_mem_gb"]
# Metrics of split learning (paradigm fsl_sage or split; tests/test_split.py checks them): not in this federation.
SITE_METRICS = [n for n in METRIC_HELP if not n.startswith(("ps/", "split/")) and n not in GPU_ONLY]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def value(text: str, sample: str) -> float:
    """The value of one exact sample line (`name{labels}`), or fail listing what is there."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} not in /metrics:\n{text}")


def test_ps_serves_rpc_and_per_site_metrics_after_real_pushes(tmp_path: Path) -> None:
    ps = ps_config(aggregation="async", state_dir=str(tmp_path / "ps"), metrics_port=free_port(), enroll_token="t")
    server = ParameterServer(replace(RunConfig(), ps=ps, wandb_mode="disabled"))
    try:
        assert server.metrics_port == ps.metrics_port
        with PSClient(ps_config(), server.address) as client:
            client.connect(timedelta(seconds=5))
            with pytest.raises(Exception, match="token"):
                client.join(m.JoinRequest("osc", "wrong"))
            sid = client.join(m.JoinRequest("osc", "t")).session_id
            params = small_params()
            init = m.PushHeader(sid, 0, 0, 0, "fp32", 0, b"", "", init=True)
            assert client.push_delta(init, codec.encode(params, CodecConfig(name="fp32"))).accepted
            client.pull_model(sid)
            delta = codec.encode({k: np.full_like(v, 0.01) for k, v in params.items()}, CodecConfig(name="int8"))
            header = m.PushHeader(sid, 0, 7, 4096, "int8", 0, b"", "", train_loss=2.5)
            reply = client.push_delta(header, delta)
            assert reply.accepted and reply.version == 1
            client.heartbeat(m.HeartbeatRequest(sid, 1, val_loss=2.25))
        deadline = time.monotonic() + 120  # the ticker publishes the ps/* values every 0.5 s
        while 'geofed_ps_global_val_loss{site="ps"}' not in (text := scrape(server.metrics_port)):
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
        for method in ("Join", "PushDelta", "StreamModel", "Heartbeat"):
            assert value(text, f'geofed_rpc_requests_total{{code="OK",method="{method}"}}') >= 1
            assert value(text, f'geofed_rpc_latency_seconds_count{{method="{method}"}}') >= 1
        assert value(text, 'geofed_rpc_requests_total{code="UNAUTHENTICATED",method="Join"}') == 1
        assert value(text, 'geofed_sync_bytes_sent{site="osc"}') == len(delta)
        assert value(text, 'geofed_sync_local_steps{site="osc"}') == 7
        assert value(text, 'geofed_sync_staleness{site="osc"}') == 0
        assert value(text, 'geofed_train_loss{site="osc"}') == 2.5
        assert value(text, 'geofed_val_loss{site="osc"}') == 2.25
        assert value(text, 'geofed_site_contribution_tokens{site="osc"}') == 4096
        assert value(text, 'geofed_site_contribution_total{site="osc"}') == 4096
        assert value(text, 'geofed_ps_version{site="ps"}') == 1
        assert value(text, 'geofed_ps_pushes_total{site="ps"}') == 1
        assert value(text, 'geofed_ps_bytes_received_total{site="ps"}') == len(delta)
        assert value(text, 'geofed_ps_active_sites{site="ps"}') == 1
        assert value(text, 'geofed_ps_global_val_loss{site="ps"}') == 2.25
    finally:
        server.stop()
    with pytest.raises(OSError):  # stopped with the PS
        scrape(ps.metrics_port)
    records = read_jsonl(tmp_path / "ps" / "metrics" / "ps.metrics.jsonl")
    assert [r["ps/version"] for r in records][:1] == [0] and records[-1]["ps/version"] == 1
    assert records[-1]["ps/global_val_loss"] == 2.25 and records[-1]["ps/pushes_total"] == 1


def test_ps_metrics_port_in_use_is_a_clear_error_and_frees_the_grpc_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = replace(RunConfig(), ps=ps_config(metrics_port=port), wandb_mode="disabled")
        with pytest.raises(UnavailableError, match=rf"127\.0\.0\.1:{port}.*ps\.metrics_port"):
            ParameterServer(cfg)


def test_preemptions_count_earlier_segments_that_ended_on_a_signal(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    assert preemptions(events, 0) == 0  # first segment: no file yet
    lines = [
        {"event": "restored"},
        {"event": "first_step"},
        {"event": "signal"},
        {"event": "stop"},
        {"event": "stop"},  # the same stop, recorded twice
        {"event": "restored"},  # a normal relaunch after a clean end is not a preemption
        {"event": "restored"},
        {"event": "stop"},
    ]
    events.write_text("".join(json.dumps(e) + "\n" for e in lines) + "{torn")
    assert preemptions(events, 0) == 2
    assert preemptions(events, 5) == 5  # Slurm's restart count when it knows more


@pytest.mark.slow
def test_local_federation_wandb_runs_hold_every_metric_name(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        "launch",
        "site=local",
        "model=tiny",
        f"run_dir={run_dir}",
        "train.max_syncs=2",
        "train.sync_interval=2s",
        "ps.min_sites=2",  # rounds of both sites, however late one starts, closed on their pushes (not a timeout)
        "ps.round_timeout=10m",
        "train.eval_every=3",  # val/local_loss, train/step
        "data.max_tokens=60000",
        "data.val_batches=2",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "geofed_hpc.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "WANDB_SILENT": "true"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    sites = sorted((run_dir / "metrics" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(sites) == 2
    for path in sites:
        data = path.read_bytes()  # protobuf records: metric names are plain UTF-8 inside
        missing = [n for n in SITE_METRICS if n.encode() not in data]
        assert not missing, f"{path} lacks {missing}"
        # CPU sites: no CUDA device, so no GPU numbers (a zero would read as an idle GPU on the dashboard).
        assert not [n for n in GPU_ONLY if n.encode() in data]
    for site in ("local-0", "local-1"):
        records = read_jsonl(run_dir / "metrics" / f"{site}.metrics.jsonl")
        assert [r["resume/source"] for r in records if "resume/source" in r] == ["fresh"]
        last = records[-1]
        assert last["sync/bytes_received"] > 0 and last["net/rtt_ms"] > 0 and last["site/contribution_total"] > 0
        assert 0 < last["sync/comm_overhead"] < 1 and last["job/preemptions"] == 0
    ps_runs = sorted((run_dir / "ps" / "metrics" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(ps_runs) == 1
    data = ps_runs[0].read_bytes()
    assert not [n for n in PS_METRICS if n.encode() not in data], PS_METRICS
    ps_records = read_jsonl(run_dir / "ps" / "metrics" / "ps.metrics.jsonl")
    assert ps_records[-1]["ps/version"] == 2 and ps_records[-1]["ps/pushes_total"] == 4
    val = {r["ps/version"]: r["ps/global_val_loss"] for r in ps_records if "ps/global_val_loss" in r}
    # the sites' evaluations of the global versions (the PS logs what it knows every 0.5 s and when it stops)
    assert 2 in val and len(val) >= 2 and val[2] < val[min(val)]
