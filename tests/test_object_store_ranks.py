"""A two-rank site (DCP shards) whose folder was purged resumes from its checkpoint mirror on a real S3-protocol
server, with a real PS over gRPC: each rank reads the restored shards, nothing is applied twice."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from geofed_hpc.ckpt import CheckpointStore, load_tensors
from geofed_hpc.ckpt.objects import open_store
from tests.s3_server import S3Server, s3_env, s3_server
from tests.site_procs import Site, events
from tests.test_site_client import latest, make_ps, shards, site_cfg

__all__ = ["s3_env", "s3_server", "shards"]  # fixtures
pytestmark = pytest.mark.slow


def _launch(cfg: dict[str, Any], folder: Path, address: str) -> None:
    site = Site(cfg, folder, address, world=2)
    try:
        codes = site.wait(timeout=600)
    finally:
        site.close()
    assert codes == [0, 0], site.output()


def test_a_purged_two_rank_site_resumes_its_shards_from_the_mirror(
    s3_env: S3Server, tmp_path: Path, shards: Path
) -> None:
    bucket = s3_env.make_bucket("two-ranks")
    site_dir = tmp_path / "run" / "sites" / "local-0"
    ps = make_ps(tmp_path)
    try:
        cfg = site_cfg(tmp_path, shards, max_syncs=3)
        cfg["train"]["checkpoint_mirror"] = f"{bucket}/run"
        _launch({**cfg, "train": {**cfg["train"], "max_syncs": 2}}, tmp_path, ps.address)
        manifest = json.loads(open_store(f"{bucket}/run/local-0").get("mirror.json"))
        newest = manifest["checkpoints"][0]
        assert newest["file"] == "site-000000002.gft" and newest["shards"].startswith("shards-")
        assert len(newest["objects"]) > 1  # the file and its shard folder's files
        shutil.rmtree(site_dir)
        _launch(cfg, tmp_path, ps.address)
        assert ps.logic.version == 3  # the restored checkpoint's sync is not trained or pushed again
    finally:
        ps.stop()
    _, meta, _ = latest(tmp_path)
    assert meta["syncs"] == 3 and meta["sampler"]["draws"] == 9 and meta["shards"]["world_size"] == 2
    assert [e["source"] for e in events(site_dir) if e["event"] == "ready"] == ["local"]
    # the restored checkpoint is kept as the one before the newest, its shards with it (listed in shards.json)
    files = CheckpointStore(site_dir / "ckpt", prefix="site").files()
    assert [step for step, _ in files] == [2, 3]
    _, older = load_tensors(files[0][1])
    assert older["shards"]["dir"] == newest["shards"] and (site_dir / "ckpt" / newest["shards"]).is_dir()
