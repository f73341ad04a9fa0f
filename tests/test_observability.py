"""Prometheus exporter, the Grafana dashboard's queries, the loss-curve report and `wandb sync`."""

from __future__ import annotations

import json
import re
import socket
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from geofed_hpc.errors import ConfigError, UnavailableError
from geofed_hpc.metrics import METRIC_HELP, Recorder
from geofed_hpc.metrics.prometheus import PrometheusExporter, prom_name
from geofed_hpc.metrics.report import write_report
from geofed_hpc.metrics.wandb_sync import offline_runs, sync_command, sync_offline_runs

REPO = Path(__file__).resolve().parents[1]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def sample_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


@pytest.fixture
def exporter():
    exp = PrometheusExporter()
    exp.serve("127.0.0.1", 0)
    yield exp
    exp.stop()


def test_metrics_endpoint_serves_every_name_per_site(exporter: PrometheusExporter) -> None:
    exporter.observe("osc", {name: 1.5 for name in METRIC_HELP})
    exporter.observe("osc", {"resume/source": "local", "unknown/key": 3})  # ignored, never an error
    exporter.rpc("PushDelta", "OK", 0.25)
    text = scrape(exporter.port)
    for name in METRIC_HELP:
        assert f'{prom_name(name)}{{site="osc"}} 1.5' in text
    assert 'geofed_rpc_requests_total{code="OK",method="PushDelta"} 1.0' in text
    assert 'geofed_rpc_latency_seconds_count{method="PushDelta"} 1.0' in text


def test_metrics_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(UnavailableError, match=rf"127\.0\.0\.1:{port}.*ps.metrics_port"):
            PrometheusExporter().serve("127.0.0.1", port)


def test_every_grafana_query_refers_to_an_exported_metric(exporter: PrometheusExporter) -> None:
    exporter.observe("site", {name: 1.0 for name in METRIC_HELP})
    exporter.rpc("Join", "OK", 0.01)
    exported = sample_names(scrape(exporter.port))
    dashboard = json.loads((REPO / "templates" / "grafana" / "dashboard.json").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(queries) >= 20
    used = {m for q in queries for m in re.findall(r"\bgeofed_[a-z0-9_]+", q)}
    assert used and used <= exported, f"not exported: {sorted(used - exported)}"
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("loss", "rtt", "bytes", "throughput", "compression", "contribution", "idle"):
        assert topic in titles


def write_fake_run(run_dir: Path) -> None:
    """Two sites' JSONL as a launch writes them (W&B disabled to keep this test fast)."""
    for site, offset in (("local-0", 0.0), ("local-1", 0.3)):
        with Recorder(run_dir / "metrics", site, job_type="site", group="g", wandb_mode="disabled") as rec:
            rec.log({"val/loss": 10.8, "sync/version": 0, "sync/index": 0})
            for i in range(1, 6):
                rec.log(
                    {
                        "sync/index": i,
                        "sync/version": i,
                        "train/loss": 10 - i - offset,
                        "val/loss": 10.5 - i,
                        "train/tokens": 512 * i,
                        "sync/bytes_sent": 1000,
                    }
                )
                time.sleep(0.01)


def test_report_writes_a_png_with_both_panels(tmp_path: Path) -> None:
    write_fake_run(tmp_path)
    path, text = write_report(tmp_path)
    assert path == tmp_path / "report.png" and path.stat().st_size > 10_000
    import matplotlib.image

    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert width >= 1000 and height >= 400
    ink = image[..., :3].mean(axis=2) < 0.5  # dark pixels: axes, lines, text
    assert ink[:, : width // 2].sum() > 2000 and ink[:, width // 2 :].sum() > 2000
    colour = np.abs(image[..., 0] - image[..., 2]) > 0.3  # the coloured per-site curves
    assert colour.sum() > 200
    assert "local-0" in text and "local-1" in text and "10.8000 -> 5.5000" in text


def test_report_without_metrics_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no metrics in .*run_dir"):
        write_report(tmp_path)


def test_wandb_sync_finds_offline_runs_and_builds_the_upload_command(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no offline W&B runs"):
        sync_offline_runs(tmp_path)
    run = tmp_path / "metrics" / "wandb" / "offline-run-20261202_101010-abc"
    run.mkdir(parents=True)
    assert offline_runs(tmp_path) == [run]
    assert sync_command([run]) == [
        sys.executable,
        "-m",
        "wandb",
        "sync",
        str(run),
    ]  # wandb 0.30 removed --include-offline
