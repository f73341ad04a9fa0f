"""Checkpoints written in the background: one write in flight at a time, in order, its error raised in the training
thread; a real site process killed while the writer is busy resumes with no step lost or applied twice."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.client.checkpoints import BackgroundWriter
from geofed_hpc.client.sharded import ShardIndex, read_shards
from geofed_hpc.rpc.client import PSClient
from tests.conftest import ps_config
from tests.site_procs import Site, events
from tests.test_site_client import BATCH, MODEL, make_ps, metrics, shards, site_cfg

__all__ = ["shards"]  # the module-scoped token shards fixture, shared with test_site_client


def test_one_write_in_flight_at_a_time_in_order_and_its_error_raised_where_training_runs() -> None:
    writer = BackgroundWriter("site-x")
    release, order = threading.Event(), []

    def first() -> Path:
        release.wait(60)
        order.append("first")
        return Path("first.gft")

    writer.submit(first)
    assert writer.busy  # submit returned while the write is still running
    second = threading.Thread(target=writer.submit, args=(lambda: order.append("second") or Path("second.gft"),))
    second.start()
    second.join(0.2)
    assert second.is_alive() and order == []  # the second write waits for the first, it does not supersede it
    release.set()
    second.join(60)
    assert writer.wait() == Path("second.gft") and order == ["first", "second"] and writer.written == 2

    def full() -> Path:
        raise OSError(errno.ENOSPC, "No space left on device")

    writer.submit(full)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()  # the error reaches the training thread, as a synchronous write would have
    assert writer.wait() is None and not writer.busy


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_site_killed_while_its_checkpoint_is_written_in_the_background_loses_no_step_and_applies_none_twice(
    tmp_path: Path, shards: Path, world: int
) -> None:
    """The site's writer is killed (SIGKILL, the whole process: rank 0) as it starts writing the checkpoint after
    sync 2 while the site trains on (two ranks: while every rank's DCP async_save of its shards is under way): the
    previous complete checkpoint (sync 1) is the latest on disk, with the record of push 2 beside it. The restarted
    job learns the PS applied that push, skips its batches, and finishes; the PS's token count for the site equals
    the batches the site drew: nothing lost, nothing applied twice."""
    ps = make_ps(tmp_path, aggregation="async")
    site_dir = tmp_path / "run" / "sites" / "local-0"
    cfg = site_cfg(tmp_path, shards, max_syncs=3, sites=1)
    try:
        os.environ["GEOFED_FAULTS"] = "site.ckpt_write[site-000000002]=kill"
        try:
            killed = Site(cfg, tmp_path, ps.address, world=world)
        finally:
            os.environ.pop("GEOFED_FAULTS", None)
        try:
            codes = killed.wait(timeout=300)
            assert codes[0] == -9 and all(c != 0 for c in codes), killed.output()  # a follower leaves with rank 0
        finally:
            killed.close()
        assert "fault injected: kill at site.ckpt_write [site-000000002.gft]" in killed.output()
        store = CheckpointStore(site_dir / "ckpt", prefix="site")
        assert [step for step, _ in store.files()] == [1]  # the write in flight left no file, not even a part
        assert not [p for p in store.directory.iterdir() if p.name.startswith(".site-")]
        assert ps.logic.version == 2  # push 2 went in before its checkpoint was written

        again = Site(cfg, tmp_path, ps.address, world=world)
        try:
            assert again.wait(timeout=300) == [0] * world, again.output()
        finally:
            again.close()
        with PSClient(ps_config(), ps.address) as client:
            status = client.status()
    finally:
        ps.stop()
    loaded = CheckpointStore(site_dir / "ckpt", prefix="site").load_latest()
    assert loaded is not None
    _, meta, path = loaded
    assert meta["syncs"] == 3 and meta["version"] == 3 and meta["sampler"]["draws"] == 9
    if world > 1:  # its shards were written in the background, and are complete
        assert meta["shards"]["world_size"] == 2 and read_shards(path.parent / meta["shards"]["dir"])["model"]
        listed = {folder for folders in ShardIndex(path.parent).read().values() for folder in folders}
        assert {p.name for p in path.parent.glob("shards-*")} == listed  # no folder of the killed save is left
    (site,) = status.sites
    assert site.tokens == meta["sampler"]["draws"] * BATCH * MODEL.context  # every step applied exactly once
    assert site.pushes == 3 and status.version == 3
    asked = [e for e in events(site_dir) if e["event"] == "push_after_checkpoint"]
    assert [e["state"] for e in asked] == ["applied"]  # push 2's batches were skipped, not trained again
    goodput = [r["site/goodput"] for r in metrics(tmp_path) if "site/goodput" in r]
    assert len(goodput) == 3 and all(0 < g <= 1 for g in goodput)  # syncs 1, 2, then 3 after the restart
