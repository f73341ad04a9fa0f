"""Best-k checkpoints by evaluation loss, and the 0600 rejoin-token file."""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.ckpt.best import BestCheckpoints
from geofed_hpc.ckpt.secret import read_secret, write_secret
from geofed_hpc.errors import ConfigError


def test_keeps_the_k_lowest_losses_as_links(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", prefix="site", keep=2)
    best = BestCheckpoints(tmp_path / "ckpt" / "best", keep=3)
    losses = [5.0, 4.0, 6.0, 3.0, 4.5, math.nan, 2.0]
    kept = []
    for step, loss in enumerate(losses, start=1):
        path = store.save(step, {"w": np.full(4, step, dtype=np.float32)}, {"val_loss": loss})
        kept.append(best.offer(path, loss, step))
    assert kept == [True, True, True, True, True, False, True]  # 4.5 displaces 5.0; NaN is never kept
    entries = best.entries()
    assert [(e["step"], e["loss"]) for e in entries] == [(7, 2.0), (4, 3.0), (2, 4.0)]
    files = sorted(p.name for p in (tmp_path / "ckpt" / "best").glob("*.gft"))
    assert files == ["site-000000002.gft", "site-000000004.gft", "site-000000007.gft"]
    assert len(store.files()) == 2  # the keep-latest store prunes its own files; the best ones stay linked
    latest = store.path_for(7)
    assert os.stat(latest).st_ino == os.stat(tmp_path / "ckpt" / "best" / latest.name).st_ino
    with pytest.raises(ConfigError, match="train.keep_best"):
        BestCheckpoints(tmp_path, keep=-1)
    assert not BestCheckpoints(tmp_path / "off", keep=0).offer(latest, 1.0, 7)


def test_secret_file_is_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        write_secret(tmp_path / "rejoin.json", {"rejoin_token": "t0"})
        write_secret(tmp_path / "rejoin.json", {"rejoin_token": "t1"})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "rejoin.json").stat().st_mode) == 0o600
    assert read_secret(tmp_path / "rejoin.json") == {"rejoin_token": "t1"}
    assert read_secret(tmp_path / "missing.json") == {}
    assert [p.name for p in tmp_path.iterdir()] == ["rejoin.json"]


def test_would_keep_and_several_checkpoints_of_one_file_name(tmp_path: Path) -> None:
    """Evaluations every N steps offer the same rolling latest file under names of their own."""
    store = CheckpointStore(tmp_path / "ckpt", prefix="site", keep=1)
    best = BestCheckpoints(tmp_path / "ckpt" / "best", keep=2)
    assert best.would_keep(9.0) and not best.would_keep(math.nan)
    for draws, loss in ((2, 5.0), (4, 4.0), (6, 4.5), (8, 6.0)):
        path = store.save(0, {"w": np.full(4, draws, dtype=np.float32)}, {"draws": draws})
        if best.would_keep(loss):
            assert best.offer(path, loss, draws, name=f"{path.stem}-step{draws:09d}{path.suffix}")
    assert [(e["step"], e["loss"]) for e in best.entries()] == [(4, 4.0), (6, 4.5)]
    assert not best.would_keep(4.5) and best.would_keep(4.4)
    kept = sorted(p.name for p in (tmp_path / "ckpt" / "best").glob("*.gft"))
    assert kept == ["site-000000000-step000000004.gft", "site-000000000-step000000006.gft"]
    from geofed_hpc.ckpt.tensorfile import load_tensors

    tensors, meta = load_tensors(tmp_path / "ckpt" / "best" / kept[0])
    assert meta["draws"] == 4 and tensors["w"][0] == 4  # the link kept the file as it was then
