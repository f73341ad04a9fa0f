"""Object storage on a site's side, against a real S3-protocol server process: checkpoints mirrored in the background
(a newer one supersedes a pending one, a manifest makes each visible), a real site process whose folder was purged
resuming from its mirror bit for bit with nothing applied twice, and `data prepare` and training reading from a
bucket."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zstandard

from geofed_hpc import faults
from geofed_hpc.ckpt.mirror import CheckpointMirror, restore
from geofed_hpc.ckpt.objects import open_store
from geofed_hpc.cli import compose_config, main
from geofed_hpc.commands.preflight import check_data
from geofed_hpc.config import DataConfig
from geofed_hpc.data.prepare import prepare_shards
from geofed_hpc.data.remote import publish_shards
from geofed_hpc.data.shards import read_index, site_tokens
from geofed_hpc.data.sources import bible_path
from geofed_hpc.errors import CheckpointError, StoreError
from tests.s3_server import CREDENTIALS, S3Server, s3_env, s3_server
from tests.site_procs import Site, events, wait_for
from tests.test_site_client import latest, make_ps, metrics, shards, site_cfg

__all__ = ["s3_env", "s3_server", "shards"]  # fixtures


@pytest.fixture
def no_faults() -> Any:
    yield
    faults.install("")


def _checkpoint(folder: Path, step: int, size: int) -> Path:
    path = folder / f"site-{step:09d}.gft"
    path.write_bytes(os.urandom(size))
    return path


def test_checkpoints_mirror_in_the_background_newest_first_each_visible_once_complete(
    s3_env: S3Server, tmp_path: Path, no_faults: Any
) -> None:
    url = s3_env.make_bucket("mirror-unit")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    mirror = CheckpointMirror(url, "osc-0", folder)
    first = _checkpoint(folder, 1, 48 << 20)  # its upload takes a while: the next ones wait, the newest wins
    mirror.submit(first)
    for step in (2, 3):
        mirror.submit(_checkpoint(folder, step, 1000))
    first.unlink()  # pruned locally while it waits or uploads: the mirror uploads its staged link
    mirror.push({"push_id": "p3", "base_version": 3, "draws": 12})
    for syncs in range(1, 21):  # the push log: written at once, the newest 16 kept past the next commit
        mirror.log_push({"push_id": f"q{syncs}", "base_version": syncs - 1, "draws": 3 * syncs, "syncs": syncs})
    assert mirror.settle()
    assert mirror.superseded >= 1 and mirror.uploaded + mirror.superseded == 3 and mirror.failed == 0
    manifest = json.loads(open_store(f"{url}/osc-0").get("mirror.json"))
    assert manifest["checkpoints"][0]["file"] == "site-000000003.gft"
    assert manifest["checkpoints"][0]["push"] == {"push_id": "p3", "base_version": 3, "draws": 12}
    assert not (folder / ".mirror").exists() or not any((folder / ".mirror").iterdir())  # staged links released
    named = {o["key"] for row in manifest["checkpoints"] for o in row["objects"]}
    assert set(open_store(f"{url}/osc-0").listing("ckpt/")) == named  # nothing else left there

    # the store refuses the next manifest: the objects are up, but the mirror still shows the previous checkpoint
    faults.install("store.put[mirror.json]@1=eio")
    mirror.submit(_checkpoint(folder, 4, 1000))
    assert mirror.settle() and mirror.failed == 1
    faults.install("")
    mirror.store.put("pushes/000000099.json", b"{not json")  # a damaged record: skipped, with one line
    restored = tmp_path / "purged"
    assert restore(CheckpointMirror(url, "osc-0", restored), restored, "push.json", "pushes.json") == (
        restored / "site-000000003.gft",
        "",
    )
    assert (restored / "site-000000003.gft").read_bytes() == (folder / "site-000000003.gft").read_bytes()
    assert json.loads((restored / "push.json").read_text())["push_id"] == "p3"
    logged = json.loads((restored / "pushes.json").read_text())
    assert [r["push_id"] for r in logged] == [f"q{n}" for n in range(6, 21)]  # the newest 16 keys, oldest first

    # a damaged newest object: the one before it is restored; none intact: one line, nothing started
    store = open_store(f"{url}/osc-0")
    newest, older = (row["objects"][0]["key"] for row in manifest["checkpoints"])
    store.put(newest, store.get(newest)[:-10])
    again = tmp_path / "again"
    assert restore(CheckpointMirror(url, "osc-0", again), again, "push.json", "pushes.json") is not None
    assert not (again / "site-000000003.gft").exists() and not (again / "push.json").exists()
    store.put(older, b"x")
    with pytest.raises(CheckpointError, match=rf"^{url}/osc-0/mirror.json names 2 checkpoint\(s\) and none is intact"):
        restore(CheckpointMirror(url, "osc-0", tmp_path / "c"), tmp_path / "c", "push.json", "pushes.json")
    with pytest.raises(StoreError, match=r"^cannot read s3://no-such-bucket-49/run/osc-0/mirror.json: the bucket"):
        CheckpointMirror("s3://no-such-bucket-49/run", "osc-0", tmp_path / "e").check()  # refused at start
    open_store(f"{url}/other-0").put("mirror.json", store.get("mirror.json"))  # copied from another site
    with pytest.raises(CheckpointError, match=r"mirrors site 'osc-0', not other-0: give each run its own"):
        restore(CheckpointMirror(url, "other-0", tmp_path / "d"), tmp_path / "d", "push.json", "pushes.json")


def _launch(cfg: dict[str, Any], folder: Path, address: str) -> Site:
    site = Site(cfg, folder, address)
    try:
        codes = site.wait(timeout=600)
    finally:
        site.close()
    assert codes == [0], site.output()
    return site


@pytest.mark.slow
def test_a_purged_site_resumes_from_its_mirror_bit_for_bit_reading_its_shards_from_the_bucket(
    s3_env: S3Server, tmp_path: Path, shards: Path
) -> None:
    """Real site processes and a real PS over gRPC; the site's data is a shard folder in the bucket. One run trains
    3 syncs straight; the other trains 2, loses its whole site folder (scratch purged), and trains on to 3."""
    bucket = s3_env.make_bucket("purged-site")
    publish_shards(shards, f"{bucket}/shards")
    runs = {}
    for name in ("straight", "purged"):
        folder = tmp_path / name
        ps = make_ps(folder)
        try:
            cfg = site_cfg(folder, shards, max_syncs=3)
            cfg["data"].update(source=f"{bucket}/shards", cache_dir=str(folder / "cache"))
            cfg["train"]["checkpoint_mirror"] = f"{bucket}/{name}"
            site_dir = folder / "run" / "sites" / "local-0"
            if name == "purged":
                _launch({**cfg, "train": {**cfg["train"], "max_syncs": 2}}, folder, ps.address)
                shutil.rmtree(site_dir)  # checkpoints, push record, rejoin token: all gone
            _launch(cfg, folder, ps.address)
            assert ps.logic.version == 3  # nothing applied twice, nothing lost
        finally:
            ps.stop()
        tensors, meta, _ = latest(folder)
        assert meta["syncs"] == 3 and meta["version"] == 3 and meta["sampler"]["draws"] == 9
        runs[name] = tensors
        ready = [e["source"] for e in events(site_dir) if e["event"] == "ready"]
        assert ready == (["local"] if name == "purged" else ["fresh"])  # the purged job went on from the mirror
        manifest = json.loads(open_store(f"{bucket}/{name}/local-0").get("mirror.json"))
        assert manifest["checkpoints"][0]["file"] == "site-000000003.gft"  # the last one, mirrored before exit
    assert list((tmp_path / "purged" / "cache" / "shards").iterdir())  # the shards came from the bucket
    straight, purged = runs["straight"], runs["purged"]
    assert straight.keys() == purged.keys() and any(k.startswith("model/") for k in straight)
    for key, value in straight.items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(purged[key])), key  # bit for bit


def test_a_push_record_the_store_refuses_pauses_the_log_until_an_upload_succeeds(
    s3_env: S3Server, tmp_path: Path, no_faults: Any, warnings_log: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    mirror = CheckpointMirror(s3_env.make_bucket("push-log"), "osc-0", folder)

    def record(syncs: int) -> dict[str, Any]:
        return {"push_id": f"p{syncs}", "base_version": syncs - 1, "draws": 3 * syncs, "syncs": syncs}

    mirror.log_push(record(1))
    faults.install("store.put[pushes/000000002]@1=eio")
    mirror.log_push(record(2))  # refused: the push goes out all the same
    mirror.log_push(record(3))  # not tried: a store that is down does not hold every sync
    assert sorted(mirror.store.listing("pushes/")) == ["pushes/000000001.json"]
    mirror.submit(_checkpoint(folder, 3, 1000))
    assert mirror.settle() and mirror.uploaded == 1  # the store takes uploads again: so the log
    assert "push records no longer reach the mirror" in warnings_log.text
    mirror.log_push(record(4))
    assert sorted(mirror.store.listing("pushes/")) == ["pushes/000000001.json", "pushes/000000004.json"]


@pytest.mark.slow
def test_a_purged_site_whose_mirror_lags_two_pushes_trains_neither_again(
    s3_env: S3Server, tmp_path: Path, shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store refuses the checkpoints after the first sync, so the mirror's newest checkpoint is two pushes
    behind when the site's folder is purged. The pushes' records reached the mirror before each push went out: the
    resumed site asks the PS, skips the batches of both applied pushes and goes on from the global model. Records
    that are not push records (cut, or of the wrong shape) are passed over."""
    bucket = s3_env.make_bucket("lagging-mirror")
    ps = make_ps(tmp_path)
    site_dir = tmp_path / "run" / "sites" / "local-0"
    cfg = site_cfg(tmp_path, shards, max_syncs=3)
    cfg["train"]["checkpoint_mirror"] = f"{bucket}/run"
    refused = [f"mirror.put[site-00000000{n}]@{k}=eio" for n in (2, 3) for k in (1, 2, 3, 4)]
    try:
        monkeypatch.setenv(faults.ENV, ",".join(refused))
        _launch(cfg, tmp_path, ps.address)
        monkeypatch.delenv(faults.ENV)
        assert ps.logic.version == 3
        manifest = json.loads(open_store(f"{bucket}/run/local-0").get("mirror.json"))
        assert manifest["checkpoints"][0]["file"] == "site-000000001.gft"  # two pushes behind
        shutil.rmtree(site_dir)  # scratch purged
        logged = open_store(f"{bucket}/run/local-0")  # beside the real records, ones the site must pass over
        shaped = {"push_id": "x", "base_version": 3, "tokens": 1, "tokens_seen": 1, "syncs": 9}
        junk = [b"{cut", b"[3, 4]", {**shaped, "push_id": 7, "draws": 99}, {**shaped, "draws": 99.5}]
        for n, record in enumerate(junk):
            logged.put(f"pushes/00000009{n}.json", record if isinstance(record, bytes) else json.dumps(record).encode())
        _launch({**cfg, "train": {**cfg["train"], "max_syncs": 5}}, tmp_path, ps.address)
        assert ps.logic.version == 5  # syncs 2 and 3 were not applied again
        _, meta, _ = latest(tmp_path)
        assert meta["syncs"] == 5 and meta["version"] == 5 and meta["sampler"]["draws"] == 15  # nothing trained twice
        asked = [e for e in events(site_dir) if e["event"] == "push_after_checkpoint"]
        assert [e["state"] for e in asked] == ["applied"]  # the newest logged push, applied: nothing older asked
    finally:
        ps.stop()


def _corpus(n: int) -> list[str]:
    lines = bible_path().read_text().splitlines()[:n]
    return [json.loads(line)["text"] for line in lines]


def test_data_prepare_reads_a_corpus_from_the_bucket_and_sites_read_its_shards_there(
    s3_env: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    url = s3_env.make_bucket("corpus")
    texts = _corpus(1500)
    local = tmp_path / "local"
    local.mkdir()
    store = open_store(f"{url}/corpus")
    for i, part in enumerate((texts[:700], texts[700:])):
        raw = "".join(json.dumps({"text": t}) + "\n" for t in part).encode()
        (local / f"part-{i}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
        store.put(f"part-{i}.jsonl.zst", (local / f"part-{i}.jsonl.zst").read_bytes())
    store.put("notes.txt", b"not matched by the glob")
    pq.write_table(pa.table({"text": texts}), local / "all.parquet")
    open_store(f"{url}/tables").put("all.parquet", (local / "all.parquet").read_bytes())

    want = prepare_shards(DataConfig(source=str(local / "*.jsonl.zst"), tokenizer="gpt2"), tmp_path / "want", 2)
    run = tmp_path / "run"
    argv = ["data", "prepare", f"data.source={url}/corpus/*.jsonl.zst", f"data.shards_url={url}/shards"]
    assert main([*argv, f"run_dir={run}", "data.tokenizer=gpt2", "site.num_sites=2"]) == 0
    got = read_index(run / "data")
    assert [s.sha256 for s in got.train] == [s.sha256 for s in want.train] and got.val == want.val
    parquet = prepare_shards(DataConfig(source=f"{url}/tables/all.parquet", tokenizer="gpt2"), tmp_path / "pq", 2)
    assert sum(s.tokens for s in parquet.train) == sum(s.tokens for s in want.train)

    # every site reads its own shards from the bucket (fetched once into its cache, checked): the same tokens
    for site in (0, 1):
        cfg = DataConfig(source=f"{url}/shards", tokenizer="gpt2", cache_dir=str(tmp_path / f"cache{site}"))
        train, val = site_tokens(cfg, 50304, site, 2)
        here = site_tokens(DataConfig(source=str(tmp_path / "want"), tokenizer="gpt2"), 50304, site, 2)
        assert np.array_equal(train, here[0]) and np.array_equal(val, here[1])
    fetched = {p.name for p in (tmp_path / "cache1" / "shards").iterdir().__next__().iterdir()}
    assert fetched == {"index.json", "train-00001.bin", "val.bin"}  # the other site's shard stays in the bucket
    raw = site_tokens(DataConfig(source=f"{url}/corpus/*.jsonl.zst", tokenizer="gpt2", cache_dir=str(tmp_path / "c")),
                      50304, 0, 1)  # fmt: skip
    assert len(raw[0]) + len(raw[1]) == sum(s.tokens for s in want.train) + want.val.tokens  # type: ignore[union-attr]

    # launch's preflight tells the two apart, and names a bucket it cannot read
    def preflight(source: str) -> tuple[str, str]:
        (found,) = check_data(compose_config([f"data.source={source}"])[0])
        return found.level, found.message

    assert preflight(f"{url}/shards") == ("ok", f"{url}/shards: each site job fetches its own shards (SHA-256 checked)")
    assert preflight(f"{url}/corpus/*.jsonl.zst")[1].endswith("each site job downloads and tokenizes its part")
    level, message = preflight("s3://no-such-bucket-49/shards")
    assert level == "error" and "the bucket no-such-bucket-49 does not exist" in message, message

    # bad input: one line naming the URL and what to do, nothing written
    capsys.readouterr()
    for source in (f"{url}/corpus/*.parquet", "s3://no-such-bucket-49/corpus/*.jsonl.zst"):
        assert main(["data", "prepare", f"data.source={source}", f"run_dir={tmp_path / 'bad'}"]) == 2
    for key in CREDENTIALS:
        monkeypatch.delenv(key)
    assert main(["data", "prepare", f"data.source={url}/corpus/*.jsonl.zst", f"run_dir={tmp_path / 'bad'}"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("geofed-hpc: error:")]
    assert len(errors) == 3, errors
    assert f"data.source: no object matches {url}/corpus/*.parquet: check the bucket and prefix" in errors[0]
    assert "the bucket no-such-bucket-49 does not exist: create it (aws s3 mb s3://no-such-bucket-49)" in errors[1]
    assert f"{url}: no AWS credentials found: set AWS_ACCESS_KEY_ID" in errors[2]
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_a_site_stopped_mid_interval_then_purged_resumes_its_unpushed_work_from_the_mirror(
    s3_env: S3Server, tmp_path: Path, shards: Path
) -> None:
    """SIGTERM (a requeue, a drain) mid-interval: the stop's checkpoint (unpushed work) is mirrored before the process
    exits, though nothing on the stop path waits for the upload; the purged site resumes that work, nothing redone."""
    bucket = s3_env.make_bucket("stopped-site")
    ps = make_ps(tmp_path, interval="10s", steps=0)
    site_dir = tmp_path / "run" / "sites" / "local-0"
    cfg = site_cfg(tmp_path, shards, max_syncs=1)
    cfg["train"]["checkpoint_mirror"] = f"{bucket}/run"
    site = Site(cfg, tmp_path, ps.address)
    try:
        wait_for(lambda: any(e["event"] == "first_step" for e in events(site_dir)), 240, "the first step")
        site.signal(signal.SIGTERM)
        assert site.wait(timeout=120) == [128 + signal.SIGTERM], site.output()
        _, meta, _ = latest(tmp_path)
        pending = meta["pending"]
        assert pending and pending["steps"] >= 1 and meta["version"] == 0
        manifest = json.loads(open_store(f"{bucket}/run/local-0").get("mirror.json"))
        assert manifest["checkpoints"][0]["file"] == latest(tmp_path)[2].name  # the stop's checkpoint, mirrored
        shutil.rmtree(site_dir)  # scratch purged while the job waited in the queue
        again = Site(cfg, tmp_path, ps.address)
        try:
            assert again.wait(timeout=300) == [0], again.output()
        finally:
            again.close()
        _, meta2, _ = latest(tmp_path)
        steps = [r["sync/local_steps"] for r in metrics(tmp_path) if "train/loss" in r]
        assert meta2["syncs"] == 1 and meta2["version"] == 1 and ps.logic.version == 1 and len(steps) == 1
        assert steps[0] > pending["steps"] and meta2["sampler"]["draws"] == steps[0]  # continued, nothing redone
        assert [e["source"] for e in events(site_dir) if e["event"] == "ready"] == ["local"]
    finally:
        site.close()
        ps.stop()
