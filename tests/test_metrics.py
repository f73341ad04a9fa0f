"""The metrics recorder: JSONL lines, read_jsonl's tolerance and real offline W&B runs."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geofed_hpc.errors import ConfigError
from geofed_hpc.metrics import METRIC_HELP, METRIC_NAMES, Recorder, read_jsonl


@pytest.fixture
def quiet_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No WANDB_MODE from the outside, no network, no writes to the real home directory."""
    for var in ("WANDB_MODE", "WANDB_DISABLED", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # any network attempt would fail fast


def _offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def _wait_for_bytes(path: Path, expected: tuple[bytes, ...], deadline_s: float = 120.0) -> bytes:
    """wandb's run.finish() returns before wandb-core has closed the run's .wandb file (it is complete at the
    latest when the process exits), so poll for the records instead of reading once."""
    end = time.monotonic() + deadline_s
    while True:
        data = path.read_bytes()
        if all(e in data for e in expected) or time.monotonic() > end:
            return data
        time.sleep(0.05)


def test_metric_names_are_documented_once() -> None:
    required = {
        "train/loss",
        "val/loss",
        "sync/bytes_sent",
        "sync/compression_ratio",
        "sync/version",
        "train/tokens",
        "train/tokens_per_s",
        "sync/push_seconds",
        "sync/pull_seconds",
        "sync/local_steps",
        "sync/staleness",
    }
    assert required <= set(METRIC_NAMES)
    assert len(set(METRIC_NAMES)) == len(METRIC_NAMES)
    assert all(METRIC_HELP[n] for n in METRIC_NAMES)


def test_jsonl_lines_are_flushed_before_close(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, "site-osc", job_type="client", group="fed", wandb_mode="disabled")
    rec.log({"train/loss": 2.5, "train/tokens": 4096, "phase": "warmup"}, step=10)
    rec.log({"sync/version": np.int64(3), "sync/compression_ratio": np.float32(4.0)})  # type: ignore[dict-item]
    lines = read_jsonl(tmp_path / "site-osc.metrics.jsonl")  # still open
    assert len(lines) == 2
    first, second = lines
    assert first["name"] == "site-osc" and first["step"] == 10 and isinstance(first["time"], float)
    assert first["train/loss"] == 2.5 and first["train/tokens"] == 4096 and first["phase"] == "warmup"
    assert "step" not in second
    assert second["sync/version"] == 3 and second["sync/compression_ratio"] == 4.0
    rec.close()
    rec.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        rec.log({"train/loss": 1.0})


def test_log_rejects_reserved_and_odd_values(tmp_path: Path) -> None:
    with Recorder(tmp_path, "r", job_type="client", group="g", wandb_mode="disabled") as rec:
        with pytest.raises(ValueError, match="reserved"):
            rec.log({"step": 1})
        with pytest.raises(TypeError, match="train/loss"):
            rec.log({"train/loss": [1.0]})  # type: ignore[dict-item]
    assert read_jsonl(tmp_path / "r.metrics.jsonl") == []


def test_bad_mode_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="wandb_mode"):
        Recorder(tmp_path, "r", job_type="client", group="g", wandb_mode="cloud")


def test_read_jsonl_skips_torn_last_line(tmp_path: Path, warnings_log: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "m.metrics.jsonl"
    path.write_bytes(b'{"time": 1.0, "name": "a", "train/loss": 1.0}\n{"time": 2.0, "name": "a"}\n{"time": 3.0, "na')
    records = read_jsonl(path)
    assert [r["time"] for r in records] == [1.0, 2.0]
    assert not [r for r in warnings_log.records if r.levelno >= logging.WARNING]


def test_torn_line_then_requeued_segment_appends_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "c.metrics.jsonl"
    path.write_bytes(b'{"time": 1.0, "name": "c", "step": 1}\n{"time": 2.0, "name": "c", "st\xc3')  # died mid-line
    with Recorder(tmp_path, "c", job_type="client", group="g", wandb_mode="disabled") as rec:
        rec.log({"train/loss": 0.5}, step=2)
    records = read_jsonl(path)
    assert [r.get("step") for r in records] == [1, 2]


def test_disabled_creates_no_wandb_dir(tmp_path: Path) -> None:
    with Recorder(tmp_path, "quiet", job_type="client", group="g", wandb_mode="disabled") as rec:
        rec.log({"train/loss": 1.0}, step=1)
        assert rec.wandb_run is None
    assert not (tmp_path / "wandb").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["quiet.metrics.jsonl"]


def test_offline_wandb_run_writes_under_run_dir(tmp_path: Path, quiet_wandb: None) -> None:
    run_dir = tmp_path / "run"
    config = {"model": "gpt2_tiny", "lr_outer": 0.7}
    with Recorder(run_dir, "site-osc-seg0", job_type="client", group="fed-test", config=config) as rec:
        assert rec.wandb_mode == "offline"
        rec.log({"train/loss": 3.25, "train/tokens": 512, "phase": "warmup"}, step=1)
        rec.log({"val/loss": 3.0}, step=2)
        assert len(read_jsonl(run_dir / "site-osc-seg0.metrics.jsonl")) == 2
    runs = _offline_runs(run_dir)
    assert len(runs) == 1
    files = list(runs[0].glob("*.wandb"))
    assert len(files) == 1
    wanted = (b"fed-test", b"site-osc-seg0", b"client", b"train/loss", b"val/loss", b"lr_outer")
    data = _wait_for_bytes(files[0], wanted)
    for expected in wanted:
        assert expected in data, expected
    assert b"phase" not in data  # strings stay in the JSONL only
    rec.close()  # again, after the context manager: still fine


def test_each_recorder_is_a_new_offline_run(tmp_path: Path, quiet_wandb: None) -> None:
    a = Recorder(tmp_path, "ps", job_type="ps", group="fed")
    b = Recorder(tmp_path, "site-a", job_type="client", group="fed")
    a.log({"sync/version": 1}, step=1)
    b.log({"train/loss": 1.0}, step=1)
    a.close()
    b.close()
    c = Recorder(tmp_path, "site-a", job_type="client", group="fed")  # a requeued segment: new run, same JSONL
    c.log({"train/loss": 0.9}, step=2)
    c.close()
    assert len(_offline_runs(tmp_path)) == 3
    assert [r["step"] for r in read_jsonl(tmp_path / "site-a.metrics.jsonl")] == [1, 2]


def test_online_failure_falls_back_to_offline(
    tmp_path: Path, quiet_wandb: None, monkeypatch: pytest.MonkeyPatch, warnings_log: pytest.LogCaptureFixture
) -> None:
    import wandb

    real_init = wandb.init
    modes: list[str] = []

    def fake_init(*args: Any, **kwargs: Any) -> Any:
        modes.append(kwargs["mode"])
        if kwargs["mode"] == "online":
            raise wandb.errors.UsageError("No API key configured.")
        return real_init(*args, **kwargs)

    monkeypatch.setattr(wandb, "init", fake_init)
    with Recorder(tmp_path, "ps", job_type="ps", group="fed", wandb_mode="online") as rec:
        assert rec.wandb_mode == "offline"
        rec.log({"sync/version": 4}, step=4)
    assert modes == ["online", "offline"]
    assert len(_offline_runs(tmp_path)) == 1
    assert any("No API key" in r.getMessage() for r in warnings_log.records if r.levelno == logging.WARNING)


def test_wandb_sync_runs_the_installed_cli_on_a_real_offline_run(
    tmp_path: Path, quiet_wandb: None, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real `wandb sync` of the installed wandb, on an offline run the recorder wrote: it takes our arguments
    (no option it removed), gets to the login, and that is what the one line says."""
    from geofed_hpc.errors import GeofedError
    from geofed_hpc.metrics.wandb_sync import offline_runs, sync_offline_runs

    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no login from this machine's ~/.netrc either
    run_dir = tmp_path / "run"
    with Recorder(run_dir / "metrics", "osc-0", job_type="site", group="fed") as rec:
        rec.log({"train/loss": 2.5}, step=1)
    assert len(offline_runs(run_dir)) == 1
    with pytest.raises(GeofedError) as info:
        sync_offline_runs(run_dir)
    text = str(info.value)
    assert text.startswith("wandb sync: not logged in to W&B (") and "run `wandb login`" in text, text
    assert "\n" not in text
    out = capsys.readouterr().out
    assert "removed" not in out and "No such option" not in out and "Usage:" not in out, out
    assert "Syncing 1 run" in out and "offline-run-" in out  # wandb read the run folder it was given


def test_wandb_sync_failures_name_the_network_or_wandbs_own_error() -> None:
    from geofed_hpc.metrics.wandb_sync import explain

    network = "wandb: Network error (ConnectionError), entering retry loop.\nError: HTTPConnectionPool: timed out"
    assert explain(network, 1).startswith("wandb sync: the W&B server does not answer from this host (")
    assert explain("Error: something else broke", 1) == "wandb sync failed: Error: something else broke"
