"""`geofed-hpc relay` as a real process between a site's client and a real `ps up` over TLS: the site dials the relay
(another address, not in the PS's certificate) and checks the PS's certificate by ps.tls_name; a push cut by the
relay's death is applied once after the relay is back, and the relay forwards nowhere but its PS."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import uuid
from datetime import timedelta
from pathlib import Path

import grpc
import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.egress.relay import Relay
from geofed_hpc.errors import UnavailableError
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from geofed_hpc.rpc.guard import bearer
from geofed_hpc.rpc.stream import digest, to_chunks
from tests.conftest import small_params
from tests.dist_util import free_port
from tests.site_procs import wait_for
from tests.test_launch_slurm import cli, login_env
from tests.test_ps_edge import FP32, EdgePS, Held

REPO = Path(__file__).resolve().parents[1]
RELAY_HOST = "127.0.0.2"  # loopback, but not a name in the PS's certificate (127.0.0.1, vm, localhost, ::1)


class RelayProc:
    """`geofed-hpc relay` as its own process; its output collected line by line."""

    def __init__(self, *args: str) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "geofed_hpc.cli", "relay", "-v", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def started(self) -> RelayProc:
        wait_for(
            lambda: any(ln.startswith("relay on") for ln in self.lines) or self.proc.poll() is not None, 60, "relay"
        )
        assert self.proc.poll() is None, "".join(self.lines)
        return self

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout=30)


def relay_to(tls_ps: EdgePS, port: int) -> RelayProc:
    return RelayProc("--to", f"127.0.0.1:{tls_ps.port}", "--listen", f"{RELAY_HOST}:{port}").started()


def test_a_push_cut_by_the_relay_dying_is_applied_once_when_the_relay_is_back(tls_ps: EdgePS) -> None:
    port = free_port()
    relay = relay_to(tls_ps, port)
    try:
        with PSClient(tls_ps.config(tls_name="vm", retry_budget="60s"), f"{RELAY_HOST}:{port}") as client:
            client.connect(timedelta(seconds=30))
            session = tls_ps.joined(client, "osc-6").session_id
            before = tls_ps.status().version
            payload = codec.encode({k: np.full_like(v, 1e-3) for k, v in small_params().items()}, FP32)
            header = m.PushHeader(session, before, 1, 1, "fp32", 0, b"", uuid.uuid4().hex)
            header.total_bytes, header.sha256 = len(payload), digest(payload)
            chunks = list(to_chunks(header, payload, 64))
            assert len(chunks) > 2
            cut = Held(client._calls["PushDelta"], chunks[:2], bearer(session))  # half a push, through the relay
            assert cut.sent.wait(30)
            relay.kill()  # at any moment: here with a push half sent
            assert cut.code(timeout=60) != grpc.StatusCode.OK
            cut.release.set()
            assert tls_ps.status().version == before  # nothing of the cut push was applied

            relay = relay_to(tls_ps, port)  # restarted on the same address; the site retries the same push id
            reply = client.push_delta(header, payload)
            assert reply.accepted and reply.version == before + 1
            again = client.push_delta(header, payload)
            assert again.duplicate and tls_ps.status().version == before + 1  # once, however often it is retried
    finally:
        assert relay.stop() == 0
    closed = [ln for ln in relay.lines if "INFO geofed_hpc: relay: 127.0.0.1:" in ln]  # one line per connection
    assert closed and all(f"-> 127.0.0.1:{tls_ps.port} closed" in ln for ln in closed), "".join(relay.lines)
    assert "Traceback" not in "".join(relay.lines)


def test_a_site_dialling_a_relay_without_ps_tls_name_is_told_to_set_it(tls_ps: EdgePS) -> None:
    port = free_port()
    relay = relay_to(tls_ps, port)
    try:
        with PSClient(tls_ps.config(retry_budget="0s"), f"{RELAY_HOST}:{port}") as client:
            with pytest.raises(UnavailableError) as info:
                client.connect(timedelta(seconds=30))
        assert "does not verify" in str(info.value) and "ps.tls_name=" in str(info.value)
    finally:
        relay.stop()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--to", "vm.example.org"], "--to: expected host:port"),
        (["--to", "127.0.0.1:1", "--listen", "0.0.0.0:70000"], "--listen: port 70000"),
        (["--to", "127.0.0.1:1", "--max-connections", "0"], "--max-connections: expected at least 1"),
        (["--to", "127.0.0.1:1", "--idle", "soon"], "--idle:"),
        ([], "--to HOST:PORT is missing"),
    ],
)
def test_a_relay_asked_wrongly_says_which_flag_and_exits_2(args: list[str], said: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "geofed_hpc.cli", "relay", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and said in done.stderr, done.stderr


def test_the_relay_bounds_its_connections_and_closes_idle_ones() -> None:
    async def scenario() -> tuple[bytes, bytes, bytes]:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(1024):
                writer.write(data)
                await writer.drain()
            writer.close()

        upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
        target = ("127.0.0.1", int(upstream.sockets[0].getsockname()[1]))
        relay = Relay(target, ("127.0.0.1", 0), max_connections=1, idle=timedelta(seconds=1))
        port = await relay.start()
        stop = asyncio.Event()
        serving = asyncio.create_task(relay.serve_forever(stop))
        first_r, first_w = await asyncio.open_connection("127.0.0.1", port)
        first_w.write(b"ping")
        echoed = await asyncio.wait_for(first_r.read(4), 10)
        second_r, second_w = await asyncio.open_connection("127.0.0.1", port)
        second_w.write(b"pong")  # never echoed: closed at once, one connection at most
        try:
            refused = await asyncio.wait_for(second_r.read(), 10)
        except ConnectionResetError:  # closed with the unread "pong" still queued
            refused = b""
        ended = await asyncio.wait_for(first_r.read(), 30)  # closed by the relay once idle
        stop.set()
        await serving
        upstream.close()
        return echoed, refused, ended

    assert asyncio.run(scenario()) == (b"ping", b"", b"")


def test_a_dry_run_with_a_relay_job_says_it_submits_the_relay_first(tmp_path: Path) -> None:
    args = ["launch", "site=osc", "ps.address=vm.example.org:50051", "site.egress=[relay]", "site.relay=job"]
    result = cli([*args, "site.relay_partition=gpu", "--dry-run", "--no-ps-check"], tmp_path, **login_env(tmp_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    said = "# relay job (site.relay=job): submitted first, on partition gpu for "
    assert said in out and "`geofed-hpc relay --to vm.example.org:50051`" in out, out
    assert "the site jobs depend on it (--dependency=after:RELAY_JOB_ID)" in out, out
    assert out.index(said) < out.index("# ---- osc-0")
    batch = out.split("# ---- osc-0", 1)[1]
    assert "#SBATCH --dependency=after:RELAY_JOB_ID" in batch, batch
