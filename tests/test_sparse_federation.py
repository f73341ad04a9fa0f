"""Two real sites with codec=sparse and a sparse downlink: every replica is the PS's model, version by version,
through a site kill and a PS kill."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from geofed_hpc import codec
from geofed_hpc.config import CodecConfig
from geofed_hpc.models import build_model
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from tests.conftest import ps_config
from tests.dist_util import free_port
from tests.site_procs import Site, events, wait_for
from tests.test_site_client import MODEL, shards, site_cfg

__all__ = ["shards"]
REPO = Path(__file__).resolve().parents[1]
SYNCS = 6
PS_ARGS = [
    "codec=sparse",
    "codec.chunk=256",
    "codec.density=0.0625",
    "ps.aggregation=async",
    "ps.downlink_codec=sparse",
    "ps.downlink_density=0.125",
    "ps.downlink_history=1000",
    "train.sync_interval=60s",
    "train.max_local_steps=3",
]


@contextmanager
def ps_up(state: Path, port: int) -> Iterator[subprocess.Popen]:
    """`geofed-hpc ps up` as a real process on a fixed port (killed by PID at the end)."""
    args = ["ps", "up", f"ps.port={port}", f"ps.state_dir={state}", *PS_ARGS]
    proc = subprocess.Popen(
        [sys.executable, "-m", "geofed_hpc.cli", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        assert proc.stdout is not None
        line = b""
        for _ in range(50):
            line = proc.stdout.readline()
            if re.search(rb"^parameter server on ", line) or not line:
                break
        assert b"parameter server on" in line, line
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()


def initial_model() -> dict[str, np.ndarray]:
    model = build_model(MODEL, seed=0)
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def status(address: str) -> m.StatusReply:
    with PSClient(ps_config(connect_timeout="5s"), address) as client:
        client.connect()
        return client.status()


@pytest.mark.slow
def test_sparse_sites_and_a_sparse_downlink_stay_bit_identical_to_the_ps_through_kills(
    tmp_path: Path, shards: Path
) -> None:
    torch.set_num_threads(1)
    state, port = tmp_path / "ps", free_port()
    address = f"127.0.0.1:{port}"
    theta0 = initial_model()
    cfg = site_cfg(tmp_path, shards, max_syncs=SYNCS)
    cfg["codec"] = {**cfg["codec"], "name": "sparse", "chunk": 256, "density": 0.0625}
    cfg["ps"]["retry_budget"] = "120s"
    sites: list[Site] = []
    try:
        with ps_up(state, port):
            with PSClient(ps_config(), address) as client:  # the test seeds the model, so it knows version 0
                client.connect()
                s = client.join(m.JoinRequest("seeder")).session_id
                init = m.PushHeader(s, 0, 0, 0, "fp32", 0, b"", "init", init=True)
                assert client.push_delta(init, codec.encode(theta0, CodecConfig(name="fp32"))).accepted
                client.heartbeat(m.HeartbeatRequest(s, leaving=True))
            sites = [Site(cfg, tmp_path, address, index=i) for i in range(2)]
            wait_for(lambda: status(address).version >= 3, 300, "version 3")
            sites[0].signal(signal.SIGKILL)  # a site killed mid-run: its job is requeued from its checkpoint
            sites[0].wait(timeout=60)
            sites[0] = Site(cfg, tmp_path, address, index=0)
            wait_for(lambda: status(address).version >= 6, 300, "version 6")
        # the PS was SIGKILLed (leaving the context): it restarts from its state directory on the same port
        time.sleep(1.0)
        with ps_up(state, port):
            for site in sites:
                assert site.wait(timeout=600) == [0], site.output()
            with PSClient(ps_config(), address) as client:
                client.connect()
                s = client.join(m.JoinRequest("reader")).session_id
                header, payload = client.pull_model(s)
            final = codec.decode(payload)
    finally:
        for site in sites:
            site.close()
    # The global model at version v is version 0 plus the published updates 0..v-1, added in order.
    replay = {k: v.copy() for k, v in theta0.items()}
    prints = {0: codec.model_digest(replay).hex()}
    for v in range(header.version):
        for k, u in codec.decode((state / "updates" / f"update-{v:09d}.gfdc").read_bytes()).items():
            replay[k] += u
        prints[v + 1] = codec.model_digest(replay).hex()
    assert prints[header.version] == codec.model_digest(final).hex()  # the PS's model is the sum of what it published
    pulls = [e for i in range(2) for e in events(tmp_path / "run" / "sites" / f"local-{i}") if e["event"] == "pulled"]
    kinds = {e["kind"] for e in pulls}
    assert len(pulls) >= 2 * SYNCS and kinds == {"full", "updates"}
    for e in pulls:  # every replica a site ever held is the PS's model at that version, bit for bit
        assert e["digest"] == prints[e["version"]], e
    restarted = [e for e in events(tmp_path / "run" / "sites" / "local-0") if e["event"] == "ready"]
    assert len(restarted) == 2 and header.version >= 2 * SYNCS
