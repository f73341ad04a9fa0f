"""Fixtures of a real S3-protocol server: moto's standalone server as its own process on 127.0.0.1, ended by PID."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from geofed_hpc.testing.s3 import CREDENTIALS, client_env, free_port, make_bucket, start_server, stop_server

__all__ = ["CREDENTIALS", "S3Server", "free_port", "s3_env", "s3_server"]


@dataclass
class S3Server:
    endpoint: str
    pid: int

    def env(self) -> dict[str, str]:
        """What a process needs to reach this server the way it would reach S3."""
        return client_env(self.endpoint)

    def make_bucket(self, name: str) -> str:
        return make_bucket(self.endpoint, name)


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    proc, endpoint = start_server(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield S3Server(endpoint, proc.pid)
    finally:
        stop_server(proc)


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """This process reaches the server as it would reach S3 (credentials and endpoint in the environment)."""
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(key, raising=False)
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return s3_server
