"""The PS's staging directory: under the state dir, else a private one for its lifetime, made again if it goes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.config import CodecConfig, RunConfig
from geofed_hpc.ps.app import ParameterServer
from geofed_hpc.ps.servicer import ParameterServerLogic
from geofed_hpc.ps.staging import Staging
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from tests.conftest import ps_config, small_params

FP32 = CodecConfig(name="fp32")


def test_a_ps_with_a_state_dir_stages_under_it(tmp_path: Path) -> None:
    logic = ParameterServerLogic(ps_config(state_dir=str(tmp_path / "state")), m.RunSettings())
    try:
        assert logic.staging.directory == tmp_path / "state" / "staging" and logic.staging.directory.is_dir()
    finally:
        logic.finish()


def test_a_staging_dir_removed_under_a_running_ps_is_made_again_and_pushes_apply() -> None:
    """A /tmp cleaner deletes the private staging dir twice while the PS serves over gRPC: the init push (staged
    whole) and a robust round (spooled deltas) still apply; a clean stop removes the directory."""
    cfg = ps_config(robust="median", round_timeout="300s")
    server = ParameterServer(replace(RunConfig(), ps=cfg))
    directory = server.logic.staging.directory
    try:
        assert directory.parent == Path(tempfile.gettempdir()) and directory.is_dir()
        params = small_params()
        with PSClient(ps_config(), server.address) as client:
            client.connect(timedelta(seconds=30))
            sessions = [client.join(m.JoinRequest(f"site-{i}")).session_id for i in range(3)]
            shutil.rmtree(directory)
            init = m.PushHeader(sessions[0], 0, 0, 0, "fp32", 0, b"", "", init=True)
            assert client.push_delta(init, codec.encode(params, FP32)).accepted
            assert server.logic.initialized and directory.is_dir()
            shutil.rmtree(directory)
            for sid, value in zip(sessions, (1.0, 2.0, 1000.0), strict=True):
                delta = {k: np.full_like(v, value) for k, v in params.items()}
                header = m.PushHeader(sid, 0, 4, 64, "fp32", 0, b"", "")
                reply = client.push_delta(header, codec.encode(delta, FP32))
                assert reply.accepted, reply.reason
        assert server.logic.version == 1  # the round of three closed on its last push (its timeout is 300 s)
        for k, v in params.items():
            np.testing.assert_allclose(server.logic.core.model.params[k], v + 2.0)  # the median of 1, 2, 1000
    finally:
        server.stop()
    assert not directory.exists()


def test_a_new_ps_removes_the_private_staging_dirs_of_processes_that_are_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PS killed before its clean stop leaves its private staging dir behind; the next PS on the machine removes
    it, and leaves alone the dirs of processes that still run and names it does not know."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    dead = tmp_path / f"geofed-ps-staging-{int(gone.stdout)}-abc"
    live = tmp_path / "geofed-ps-staging-1-abc"  # pid 1 always runs
    other = tmp_path / "geofed-ps-staging-notapid"
    for d in (dead, live, other):
        d.mkdir()
        (d / "push-1-00000001").write_bytes(b"x")
    staging = Staging(None)
    try:
        assert not dead.exists() and live.is_dir() and other.is_dir()
        assert staging.directory.parent == tmp_path and staging.directory.name.startswith(
            f"geofed-ps-staging-{os.getpid()}-"
        )
        again = Staging(None)  # a second PS in this process keeps the first one's dir
        assert staging.directory.is_dir()
        again.close()
    finally:
        staging.close()
    assert not staging.directory.exists()
