"""An S3-protocol server for tests and benchmarks: moto's standalone server, its own process on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

# moto is the S3-protocol server that installs from PyPI (no S3 server ships in Debian); it runs as its own process
# and the project reaches it through the same client library and code path as real S3, via AWS_ENDPOINT_URL
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing-key", "AWS_SECRET_ACCESS_KEY": "testing-secret"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def client_env(endpoint: str) -> dict[str, str]:
    """What a process needs to reach the server at `endpoint` the way it would reach S3 (nothing of ~/.aws)."""
    return {
        **CREDENTIALS,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }


def start_server(log: Path, wait: timedelta = timedelta(seconds=30)) -> tuple[subprocess.Popen[bytes], str]:
    """moto's server on a free port of 127.0.0.1, once it answers: (its process, its endpoint URL)."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out
        )
    deadline = time.monotonic() + wait.total_seconds()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    stop_server(proc)
    raise RuntimeError(f"moto server did not answer on port {port} within {wait}")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """End the server by its PID (SIGTERM, then SIGKILL after 10 s)."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def make_bucket(endpoint: str, name: str) -> str:
    """Create bucket `name` on the server; its s3:// URL."""
    import boto3

    keys = {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    }
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **keys).create_bucket(Bucket=name)
    return f"s3://{name}"
