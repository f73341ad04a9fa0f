"""Real gRPC over loopback: join -> init -> pull -> push -> new version; errors and limits."""

from __future__ import annotations

import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.config import CodecConfig
from geofed_hpc.errors import StaleError, UnavailableError
from geofed_hpc.ps.servicer import ParameterServerLogic
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc import serde
from geofed_hpc.rpc.client import PSClient
from geofed_hpc.rpc.server import start_server
from tests.conftest import ps_config, small_params

REPO = Path(__file__).resolve().parents[1]


def test_round_trip_join_pull_push_new_version(live_ps) -> None:
    with PSClient(ps_config(), live_ps.address) as client:
        client.connect(timedelta(seconds=5))
        a = client.join(m.JoinRequest("site-a"))
        b = client.join(m.JoinRequest("site-b"))
        assert not a.initialized and a.version == 0 and a.settings.aggregation == "sync"
        params = small_params()
        init = codec.encode(params, CodecConfig(name="fp32"))
        reply = client.push_delta(m.PushHeader(a.session_id, 0, 0, 0, "fp32", 0, b"", "", init=True), init)
        assert reply.accepted
        header, payload = client.pull_model(b.session_id)
        assert header.version == 0 and header.total_bytes == len(payload) > 4096  # several chunks
        got = codec.decode(payload)
        for k in params:
            np.testing.assert_array_equal(got[k], params[k])
        delta = {k: np.full_like(v, 0.01) for k, v in params.items()}
        enc = codec.encode(delta, CodecConfig(name="int8", block_size=64))
        for sid in (a.session_id, b.session_id):
            r = client.push_delta(m.PushHeader(sid, 0, 5, 320, "int8", 0, b"", "", train_loss=3.0), enc)
            assert r.accepted
        header, payload = client.pull_model(a.session_id, min_version=1, wait=timedelta(seconds=5))
        assert header.version == 1
        np.testing.assert_allclose(codec.decode(payload)["ln.bias"], 0.01, atol=1e-6)
        status = client.status()
        assert status.version == 1 and status.num_params == sum(v.size for v in params.values())
        assert sorted(s.site for s in status.sites) == ["site-a", "site-b"]
        assert all(s.pushes == 1 and s.tokens == 320 for s in status.sites)


def test_errors_cross_the_wire_as_the_same_family(live_ps) -> None:
    with PSClient(ps_config(), live_ps.address) as client:
        a = client.join(m.JoinRequest("site-a"))
        with pytest.raises(StaleError, match="not initialized"):
            client.pull_model(a.session_id)


def test_retransmitted_push_applies_once(live_ps) -> None:
    live_ps.logic.settings.aggregation = "async"
    with PSClient(ps_config(), live_ps.address) as client:
        a = client.join(m.JoinRequest("site-a"))
        params = small_params()
        client.push_delta(
            m.PushHeader(a.session_id, 0, 0, 0, "fp32", 0, b"", "", init=True),
            codec.encode(params, CodecConfig(name="fp32")),
        )
        enc = codec.encode({k: np.ones_like(v) for k, v in params.items()}, CodecConfig(name="fp32"))
        header = m.PushHeader(a.session_id, 0, 1, 1, "fp32", 0, b"", "fixed-id")
        assert not client.push_delta(header, enc).duplicate
        again = client.push_delta(header, enc)
        assert again.duplicate and again.version == 1


def test_unreachable_ps_names_address_and_what_to_check() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with PSClient(ps_config(), f"127.0.0.1:{port}") as client:
        with pytest.raises(UnavailableError, match=rf"127\.0\.0\.1:{port}.*ps up"):
            client.connect(timedelta(seconds=1))


def test_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(UnavailableError, match=rf"127\.0\.0\.1:{port}.*in use"):
            start_server(ParameterServerLogic(ps_config(), m.RunSettings()), ps_config(port=port))


def test_serde_methods_match_the_proto_service() -> None:
    assert [meth.name for meth in serde.METHODS] == serde.service_descriptor_methods()
    chunk = m.Chunk(data=b"xyz", push=m.PushHeader("s", 1, 2, 3, "int8", 3, b"h", "id", train_loss=1.5))
    assert serde.deserializer(m.Chunk)(serde.serializer(m.Chunk)(chunk)) == chunk
    reply = m.StatusReply(3, True, "sync", sites=[m.SiteStatus("a", "b", pushes=2)])
    assert serde.deserializer(m.StatusReply)(serde.serializer(m.StatusReply)(reply)) == reply


def test_generated_stubs_have_no_drift(tmp_path: Path) -> None:
    """The committed *_pb2 files equal what `make proto` generates from geofed.proto."""
    out = tmp_path / "gen"
    (out / "geofed_hpc" / "rpc").mkdir(parents=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Igeofed_hpc/rpc=geofed_hpc/rpc",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            "geofed_hpc/rpc/geofed.proto",
        ],
        cwd=REPO,
        check=True,
    )
    for name in ("geofed_pb2.py", "geofed_pb2.pyi", "geofed_pb2_grpc.py"):
        committed = (REPO / "geofed_hpc" / "rpc" / name).read_text()
        assert (out / "geofed_hpc" / "rpc" / name).read_text() == committed, f"{name} drifted: run `make proto`"
