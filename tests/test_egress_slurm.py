"""site.egress on the real single-node Slurm: `site check` probes the paths from a compute node through a submitit job
and saves what it found for the preflight; site.relay=job starts the relay as a Slurm job on another partition before
the site job, which reaches its PS through it and trains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from geofed_hpc.egress.relay import RELAY_FILE
from geofed_hpc.launch import slurm
from tests.test_slurm import PS_OVERRIDES, Watch, cli, events, launch, ps_view, tiny
from tests.test_slurm import cache as cache  # noqa: F401  (the fixtures of the Slurm tests)
from tests.test_slurm import cluster as cluster  # noqa: F401
from tests.test_slurm import ps as ps  # noqa: F401

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_site_check_probes_each_path_from_a_compute_node_and_saves_it(
    cluster: None,  # noqa: F811
    ps: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    args = [f"ps.address={ps.address}", f"run_dir={run_dir}", "site.egress=[direct,relay]", "site.relay=127.0.0.1:1"]
    done = cli(["site", "check", "site=slurm_local", "--demo", *PS_OVERRIDES, *args], tmp_path)
    out = done.stdout
    assert "probing the paths to" in out and "from a compute node (job " in out, out + done.stderr
    assert "direct   works: round trip" in out and "relay    does not work: " in out, out + done.stderr
    saved = json.loads((run_dir / "egress-check.json").read_text())
    assert [p["path"] for p in saved["paths"]] == ["direct", "relay"] and saved["paths"][0]["ok"], saved
    assert "jobs reach the PS by direct" in out, out  # the preflight read the saved result


def test_a_relay_job_starts_before_the_site_job_which_trains_through_it(
    cluster: None,  # noqa: F811
    cache: Path,  # noqa: F811
    ps: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    args = [*tiny(run_dir, cache, ps.address), *PS_OVERRIDES, "site.num_sites=1", "wandb_mode=disabled"]
    args += ["site.egress=[relay]", "site.relay=job", "site.relay_partition=high", "train.max_syncs=2"]
    jobs = launch(args, tmp_path)
    assert sorted(jobs) == ["slurm_local-0", "slurm_local-relay"], jobs
    watch = Watch(jobs)
    try:
        watch.until("the site's second push", lambda: ps_view(ps.address)[1].get("slurm_local-0", (0, 0))[0] >= 2)
        relay = json.loads((run_dir / RELAY_FILE).read_text())
        took = json.loads((run_dir / "sites" / "slurm_local-0" / "egress.json").read_text())
        assert took["path"] == "relay" and took["detail"].startswith(relay["listen"]), (took, relay)
        assert relay["job"] == jobs["slurm_local-relay"].job_id and relay["to"] == ps.address, relay
        ready = [e for e in events(run_dir, "slurm_local-0") if e["event"] == "ready"]
        assert ready, events(run_dir, "slurm_local-0")
        status = cli(["status", "site=slurm_local", *args], tmp_path)
        assert "slurm_local-0: reaches the parameter server by relay" in status.stdout, status.stdout + status.stderr
    finally:
        cli(["cancel", "site=slurm_local", *args], tmp_path)
        slurm.cancel_jobs([j.job_id for j in jobs.values()])
