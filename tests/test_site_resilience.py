"""A site against a parameter server that goes away and comes back on the same port: retries under a time
budget, training on through the outage, one deferred push against the recorded base, sync-now hints."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.config import CodecConfig, DataConfig, RunConfig, SiteConfig, TrainConfig, to_dict
from geofed_hpc.data.prepare import prepare_shards
from geofed_hpc.errors import UnavailableError
from geofed_hpc.metrics import read_jsonl
from geofed_hpc.ps.app import ParameterServer
from geofed_hpc.rpc import client as rpc_client
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from geofed_hpc.rpc.retry import Backoff
from tests.conftest import ps_config, small_params
from tests.dist_util import free_port
from tests.site_procs import Site, events, wait_for
from tests.test_faults import ps_process
from tests.test_site_client import BATCH, MODEL

FP32 = CodecConfig(name="fp32")


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    cache = tmp_path_factory.mktemp("cache")
    prepare_shards(
        DataConfig(tokenizer="gpt2", source="bible", max_tokens=40000, val_fraction=0.05, cache_dir=str(cache)), out, 2
    )
    return out


def test_backoff_doubles_with_jitter_and_stops_at_the_budget() -> None:
    now = [0.0]
    backoff = Backoff(timedelta(seconds=20), clock=lambda: now[0], rng=random.Random(1))
    waits = []
    while (wait := backoff.next_wait()) is not None:
        waits.append(wait)
        now[0] += wait
    assert now[0] == pytest.approx(20.0)  # retried right up to the budget, never past it
    caps = [0.5, 1, 2, 4, 8, 8, 8, 8, 8, 8, 8, 8]
    assert all(cap / 2 <= w <= cap for w, cap in zip(waits[:-1], caps, strict=False))
    assert len(set(waits)) == len(waits)  # jittered, not a fixed schedule
    assert Backoff(timedelta(0)).next_wait() is None  # no budget: no retry


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "down"


def test_a_call_that_fails_over_tries_the_next_ps_at_once_and_restarts_its_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now, sleeps = [0.0], []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(rpc_client.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(rpc_client.time, "sleep", sleep)
    client = PSClient(ps_config(failover_after="1s", retry_budget="60s"), "127.0.0.1:1,127.0.0.1:2")
    attempts: list[tuple[str, int]] = []  # (address, sleeps before the attempt)

    def call() -> str:
        attempts.append((client.address, len(sleeps)))
        if client.address.endswith(":1") or sum(a.endswith(":2") for a, _ in attempts) < 3:
            raise Unavailable()
        return "answered"

    assert client._call("Status", call) == "answered"
    first = next(i for i, (address, _) in enumerate(attempts) if address.endswith(":2"))
    assert first >= 2 and attempts[first][1] == attempts[first - 1][1]  # the next PS at once, no wait before it
    grown, restarted = sleeps[attempts[first][1] - 1], sleeps[attempts[first][1]]
    assert grown > 0.5 >= restarted  # its retries start from the first wait again, not where the dead PS's were


def ps_run_config(folder: Path, port: int, **ps: Any) -> RunConfig:
    train = TrainConfig(sync_interval="60s", max_local_steps=3)
    cfg = ps_config(port=port, state_dir=str(folder / "ps"), **ps)
    return RunConfig(ps=cfg, train=train, codec=CodecConfig(name="int8"), wandb_mode="disabled")


def test_a_push_rides_out_an_outage_shorter_than_the_retry_budget(
    tmp_path: Path, warnings_log: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    cfg = ps_run_config(tmp_path, port, aggregation="async")
    ps = ParameterServer(cfg)
    restarted: list[ParameterServer] = []
    try:
        client_cfg = ps_config(port=port, retry_budget="60s")
        with PSClient(client_cfg, ps.address) as client:
            client.connect(timedelta(seconds=10))
            session = client.join(m.JoinRequest("site-a"))
            init = m.PushHeader(session.session_id, 0, 0, 0, "fp32", 0, b"", "", init=True)
            assert client.push_delta(init, codec.encode(small_params(), FP32)).accepted
            ps.stop()  # snapshot on the way down; nothing listens on the port now

            def failed_attempts() -> int:
                return sum(r.getMessage().startswith("PushDelta to ") for r in list(warnings_log.records))

            def restart() -> None:  # the outage lasts until the push failed twice, however long that takes
                wait_for(lambda: failed_attempts() >= 2, 60, "two failed attempts of the push")
                restarted.append(ParameterServer(cfg))

            thread = threading.Thread(target=restart)
            thread.start()
            step = {k: np.full_like(v, 0.01) for k, v in small_params().items()}
            header = m.PushHeader(session.session_id, 0, 1, 10, "fp32", 0, b"", "")
            reply = client.push_delta(header, codec.encode(step, FP32))  # retried until the PS is back
            thread.join()
            assert failed_attempts() >= 2  # it was retried while the PS was down
            assert reply.accepted and reply.version == 1 and not reply.duplicate
            assert restarted[0].logic.version == 1
            again = client.push_delta(header, codec.encode(step, FP32))  # same push id: not applied twice
            assert again.duplicate and restarted[0].logic.version == 1
        restarted[0].stop()
        short = ps_config(port=port, retry_budget="1s")
        with PSClient(short, f"127.0.0.1:{port}") as client, pytest.raises(UnavailableError, match="attempts in"):
            client.push_delta(header, codec.encode(step, FP32))
    finally:
        ps.stop()
        for server in restarted:
            server.stop()


def site_cfg(folder: Path, shards: Path, port: int, max_syncs: int, **train: Any) -> dict[str, Any]:
    cfg = RunConfig(
        federation="t",
        run_dir=str(folder / "run"),
        wandb_mode="disabled",
        site=SiteConfig(num_sites=2),
        model=MODEL,
        ps=ps_config(port=port, retry_budget="2s", heartbeat_interval="0.5s"),
        data=DataConfig(source=str(shards), val_batches=2),
        train=TrainConfig(batch_size=BATCH, sync_interval="60s", max_local_steps=3, max_syncs=max_syncs, **train),
    )
    return to_dict(cfg)


def site_metrics(folder: Path) -> list[dict[str, Any]]:
    path = folder / "run" / "metrics" / "local-0.metrics.jsonl"
    return read_jsonl(path) if path.exists() else []


def test_the_site_trains_through_an_outage_and_pushes_its_work_once(tmp_path: Path, shards: Path) -> None:
    port = free_port()
    cfg = ps_run_config(tmp_path, port, aggregation="async")
    site_dir = tmp_path / "run" / "sites" / "local-0"
    ps = ParameterServer(cfg)
    servers = [ps]
    site = Site(site_cfg(tmp_path, shards, port, max_syncs=4), tmp_path, ps.address)
    try:
        wait_for(lambda: any(r.get("sync/index") == 1 for r in site_metrics(tmp_path)), 240, "the first sync")
        ps.stop()
        before = ps.logic.version
        # far longer than the 2 s retry budget: the site trains on, interval after interval
        wait_for(lambda: sum(e["event"] == "push_deferred" for e in events(site_dir)) >= 3, 240, "3 deferred pushes")
        loaded = CheckpointStore(site_dir / "ckpt", prefix="site").load_latest()
        assert loaded is not None
        tensors, meta, _ = loaded
        held = meta["pending"]["deferred"]
        assert meta["version"] == before and not meta["global_model"] and held["intervals"] >= 1
        assert held["steps"] == meta["pending"]["steps"] >= 3 and held["attempt"]["push_id"]
        assert tensors["deferred/attempt"].nbytes > 0  # the bytes of the push that may have reached the PS
        assert {k[5:] for k in tensors if k.startswith("base/")} == {k[6:] for k in tensors if k.startswith("model/")}
        servers.append(ParameterServer(cfg))  # the same port and state directory: back at version `before`
        assert servers[-1].logic.version == before
        assert site.wait(timeout=300) == [0], site.output()
        with PSClient(ps_config(), servers[-1].address) as client:
            pushes = {s.site: s.pushes for s in client.status().sites}
        final = servers[-1].logic.version
    finally:
        site.close()
        for server in servers:
            server.stop()
    assert pushes["local-0"] == 4 and final == 4  # every delta applied once, no version skipped or repeated
    syncs = [r for r in site_metrics(tmp_path) if "train/loss" in r]
    assert [r["sync/version"] for r in syncs] == [1, 2, 3, 4]
    deferred = [r for r in syncs if r["sync/deferred_intervals"] > 0]
    assert len(deferred) == 1 and deferred[0]["sync/version"] == before + 1
    assert deferred[0]["sync/local_steps"] == 3 * (deferred[0]["sync/deferred_intervals"] + 1)
    assert deferred[0]["sync/offline_seconds"] > 2.0
    _, meta, _ = CheckpointStore(site_dir / "ckpt", prefix="site").load_latest() or ({}, {}, None)
    assert meta["sampler"]["draws"] == sum(r["sync/local_steps"] for r in syncs)  # no step lost or pushed twice
    names = [e["event"] for e in events(site_dir)]
    assert "deferred_pushed" in names and names.index("push_deferred") < names.index("deferred_pushed")


def test_a_requeue_during_the_outage_keeps_the_deferred_work(tmp_path: Path, shards: Path) -> None:
    port = free_port()
    cfg = ps_run_config(tmp_path, port, aggregation="async")
    site_dir = tmp_path / "run" / "sites" / "local-0"
    ps = ParameterServer(cfg)
    servers = [ps]
    site = Site(site_cfg(tmp_path, shards, port, max_syncs=3), tmp_path, ps.address)
    try:
        wait_for(lambda: any(r.get("sync/index") == 1 for r in site_metrics(tmp_path)), 240, "the first sync")
        ps.stop()
        before = ps.logic.version
        wait_for(lambda: sum(e["event"] == "push_deferred" for e in events(site_dir)) >= 2, 240, "2 deferred pushes")
        site.close()  # SIGKILL while offline: only the checkpoint on disk is left
        _, meta, _ = CheckpointStore(site_dir / "ckpt", prefix="site").load_latest() or ({}, {}, None)
        steps_on_disk = meta["pending"]["steps"]
        servers.append(ParameterServer(cfg))
        again = Site(site_cfg(tmp_path, shards, port, max_syncs=3), tmp_path, servers[-1].address)
        try:
            assert again.wait(timeout=300) == [0], again.output()
        finally:
            again.close()
        final = servers[-1].logic.version
    finally:
        site.close()
        for server in servers:
            server.stop()
    syncs = [r for r in site_metrics(tmp_path) if "train/loss" in r]
    assert [r["sync/version"] for r in syncs] == [1, 2, 3] and final == 3
    assert syncs[before]["sync/local_steps"] >= steps_on_disk + 1  # the deferred steps went out with the next
    _, meta, _ = CheckpointStore(site_dir / "ckpt", prefix="site").load_latest() or ({}, {}, None)
    assert meta["sampler"]["draws"] == sum(r["sync/local_steps"] for r in syncs)


def test_a_ps_back_without_its_state_is_reseeded_by_the_running_site_and_gets_its_work(
    tmp_path: Path, shards: Path
) -> None:
    """The PS dies while the site trains on (its push deferred) and a PS with an empty state directory comes up
    on the same port. The running site joins it again, re-seeds it with its base (the global model at the last
    version it pulled), pushes the deferred work against it, and finishes; no step is lost."""
    port = free_port()
    site_dir = tmp_path / "run" / "sites" / "local-0"
    ps = ParameterServer(ps_run_config(tmp_path / "first", port, aggregation="async"))
    servers = [ps]
    site = Site(site_cfg(tmp_path, shards, port, max_syncs=3), tmp_path, ps.address)
    try:
        wait_for(lambda: any(r.get("sync/index") == 1 for r in site_metrics(tmp_path)), 240, "the first sync")
        ps.stop()
        before = ps.logic.version
        wait_for(lambda: any(e["event"] == "push_deferred" for e in events(site_dir)), 240, "a deferred push")
        servers.append(ParameterServer(ps_run_config(tmp_path / "empty", port, aggregation="async")))
        assert not servers[-1].logic.initialized
        assert site.wait(timeout=300) == [0], site.output()
        logic = servers[-1].logic
        final, params = logic.version, {k: v.copy() for k, v in (logic.core.model.params or {}).items()}
    finally:
        site.close()
        for server in servers:
            server.stop()
    names = [e["event"] for e in events(site_dir)]
    assert names.index("push_deferred") < names.index("rejoin") < names.index("reseed") < names.index("deferred_pushed")
    assert [e["version"] for e in events(site_dir) if e["event"] == "reseed"] == [before]
    syncs = [r for r in site_metrics(tmp_path) if "train/loss" in r]
    assert [r["sync/version"] for r in syncs] == [1, 2, 3] and final == 3  # the federation went on from v1
    tensors, meta, _ = CheckpointStore(site_dir / "ckpt", prefix="site").load_latest() or ({}, {}, None)
    assert meta["version"] == 3 and meta["global_model"]
    assert all(tensors[f"model/{k}"].tobytes() == v.tobytes() for k, v in params.items())  # the PS's model
    assert meta["sampler"]["draws"] == sum(r["sync/local_steps"] for r in syncs)  # no step lost or pushed twice


def test_a_push_applied_but_unanswered_in_an_outage_loses_no_step_and_applies_none_twice(
    tmp_path: Path, shards: Path
) -> None:
    """A real `ps up` applies the site's second delta, snapshots it and is SIGKILLed before it answers; it stays
    down past the site's retry budget, so the site trains on. When a PS restarted from that snapshot answers, the
    site asks whether it holds the unanswered push: it does, so only the steps trained since go out, as their
    own push. Every step the site trained reaches the global model exactly once (the PS's token count says so).
    Before, the whole work went out under the old push id, was answered "duplicate", and the later steps were
    lost."""
    state, port = tmp_path / "state", free_port()
    address = f"127.0.0.1:{port}"
    quick = ("train.max_local_steps=3",)  # the run settings the PS hands out: 3 steps per interval
    site_dir = tmp_path / "run" / "sites" / "local-0"
    site = None
    try:
        # snapshot hits: 1 the site's init, 2 its first delta, 3 its second (killed before the reply)
        with ps_process(state, port, "ps.snapshot@3=kill", "async", *quick) as proc:
            site = Site(site_cfg(tmp_path, shards, port, max_syncs=3), tmp_path, address)
            assert proc.wait(timeout=240) == -9
        wait_for(lambda: any(e["event"] == "push_deferred" for e in events(site_dir)), 240, "a deferred push")
        with ps_process(state, port, "", "async", *quick) as proc, PSClient(ps_config(), address) as client:
            assert client.status().version == 2  # the unanswered delta is in the snapshot
            assert site.wait(timeout=300) == [0], site.output()
            status = client.status()
    finally:
        if site is not None:
            site.close()
    _, meta, _ = CheckpointStore(site_dir / "ckpt", prefix="site").load_latest() or ({}, {}, None)
    (site_status,) = status.sites
    assert site_status.tokens == meta["sampler"]["draws"] * BATCH * MODEL.context  # no step lost or applied twice
    assert site_status.pushes == 4 and status.version == 4
    syncs = [r for r in site_metrics(tmp_path) if "train/loss" in r]
    assert [r["sync/version"] for r in syncs] == [1, 3, 4]  # v2: the unanswered push, v3: the steps after it
    asked = [e for e in events(site_dir) if e["event"] == "unanswered_push"]
    assert [e["state"] for e in asked] == ["applied"]


def test_a_ps_lost_between_the_push_and_its_pull_is_reseeded_by_the_site_with_its_model(
    tmp_path: Path, shards: Path
) -> None:
    """A real `ps up` applies the site's first delta, answers it, and is SIGKILLed when the site pulls the new
    version. A PS with an empty state directory comes up on the same port while the pull still retries: it does
    not know the session. The site trains on from its local model (the delta is in it), joins again, re-seeds
    the PS with that model at the version its push made, and the federation goes on from there."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    site_dir = tmp_path / "run" / "sites" / "local-0"
    quick = ("train.max_local_steps=3",)
    cfg = site_cfg(tmp_path, shards, port, max_syncs=3)
    cfg["ps"]["retry_budget"] = "2m"  # the pull outlives the restart
    site = None
    try:
        with ps_process(tmp_path / "first", port, "ps.stream[1]@1=kill", "async", *quick) as proc:
            site = Site(cfg, tmp_path, address)
            assert proc.wait(timeout=240) == -9  # killed as the pull of version 1 arrived
        with ps_process(tmp_path / "empty", port, "", "async", *quick), PSClient(ps_config(), address) as client:
            assert site.wait(timeout=300) == [0], site.output()
            status = client.status()
    finally:
        if site is not None:
            site.close()
    names = [e["event"] for e in events(site_dir)]
    assert names.index("pull_failed") < names.index("rejoin") < names.index("reseed")
    (failed,) = [e for e in events(site_dir) if e["event"] == "pull_failed"]
    assert "unknown session" in failed["error"]  # the empty PS answered (not a spent retry budget)
    assert [e["version"] for e in events(site_dir) if e["event"] == "reseed"] == [1]  # the version its push made
    syncs = [r for r in site_metrics(tmp_path) if "train/loss" in r]
    assert [r["sync/version"] for r in syncs] == [1, 2, 3] and status.version == 3
    _, meta, _ = CheckpointStore(site_dir / "ckpt", prefix="site").load_latest() or ({}, {}, None)
    assert meta["version"] == 3 and meta["global_model"]
    assert meta["sampler"]["draws"] == sum(r["sync/local_steps"] for r in syncs)  # no step lost


def test_sync_now_ends_a_late_sites_interval_so_the_round_closes_early(tmp_path: Path, shards: Path) -> None:
    """Sync mode, a 10-minute interval and a 10-minute deadline: a fast site pushes at once, the slow (real)
    site hears "sync now" on its next heartbeat and pushes what it has; the round closes with both."""
    port = free_port()
    ps_cfg = ps_config(port=port, aggregation="sync", round_timeout="10m")
    cfg = RunConfig(ps=ps_cfg, train=TrainConfig(sync_interval="10m"), wandb_mode="disabled")
    ps = ParameterServer(replace(cfg, codec=CodecConfig(name="int8")))
    site_dir = tmp_path / "run" / "sites" / "local-0"
    plain = site_cfg(tmp_path, shards, port, max_syncs=1)
    plain["train"].update(sync_interval="10m", max_local_steps=0)
    site = Site(plain, tmp_path, ps.address)
    try:
        wait_for(lambda: any(e["event"] == "first_step" for e in events(site_dir)), 240, "the slow site training")
        with PSClient(ps_config(), ps.address) as fast:
            fast.connect(timedelta(seconds=10))
            other = fast.join(m.JoinRequest("fast"))
            header, payload = fast.pull_model(other.session_id)
            step = {k: np.full_like(v, 1e-3) for k, v in codec.decode(payload).items()}
            push = m.PushHeader(other.session_id, header.version, 1, 1, "fp32", 0, b"", "")
            assert fast.push_delta(push, codec.encode(step, FP32)).accepted  # the round now waits for the slow site
            new, _ = fast.pull_model(other.session_id, 1, timedelta(seconds=240))
        assert new.version == 1
        assert site.wait(timeout=120) == [0], site.output()
        with PSClient(ps_config(), ps.address) as client:
            pushes = {s.site: s.pushes for s in client.status().sites}
    finally:
        site.close()
        ps.stop()
    assert pushes == {"local-0": 1, "fast": 1}
    told = [e for e in events(site_dir) if e["event"] == "sync_now"]
    assert len(told) == 1 and told[0]["version"] == 0
    syncs = [r for r in site_metrics(tmp_path) if "train/loss" in r]
    assert len(syncs) == 1 and syncs[0]["sync/version"] == 1 and syncs[0]["sync/local_steps"] == told[0]["steps"]


def test_a_pull_lost_after_the_push_went_in_trains_on_from_the_local_model(tmp_path: Path, shards: Path) -> None:
    """Sync mode: the site's push is in and it waits for the round to close; the PS process is SIGKILLed
    there. The site trains on from its local model (the base for its next delta). The `ps up` back on the same
    port replays the open round from its journal (the accepted delta is not lost); the site's next push goes in
    and the pull after it brings the global model again."""
    port = free_port()
    log = tmp_path / "ps.log"

    def ps_up() -> subprocess.Popen:
        cmd = [sys.executable, "-m", "geofed_hpc.cli", "--quiet", "ps", "up", f"ps.port={port}"]
        cmd += ["ps.aggregation=sync", "ps.round_timeout=10m", f"ps.state_dir={tmp_path / 'ps'}"]
        cmd += ["train.sync_interval=60s", "train.max_local_steps=3", "wandb_mode=disabled"]
        with open(log, "a") as out:
            return subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)

    procs = [ps_up()]
    site_dir = tmp_path / "run" / "sites" / "local-0"
    site = None
    try:
        with PSClient(ps_config(), f"127.0.0.1:{port}") as waiter:
            waiter.connect(timedelta(seconds=60))
            late = waiter.join(m.JoinRequest("late")).session_id  # active, never pushes: the round waits
            site = Site(site_cfg(tmp_path, shards, port, max_syncs=2), tmp_path, f"127.0.0.1:{port}")

            def pushed() -> bool:
                return any(s.site == "local-0" and s.pushes == 1 for s in waiter.status().sites)

            wait_for(pushed, 240, "the site's first push")
            procs[0].kill()  # SIGKILL: the site is waiting for the round, inside its pull
            procs[0].wait(timeout=30)
            wait_for(lambda: any(e["event"] == "pull_failed" for e in events(site_dir)), 120, "the lost pull")
            # the site is held (SIGSTOP) until the late one left the restarted PS: its next push, however fast it
            # trains, goes into the next round, never into the replayed one
            site.signal(signal.SIGSTOP)
            procs.append(ps_up())
            waiter.connect(timedelta(seconds=60))
            waiter.heartbeat(m.HeartbeatRequest(late, leaving=True))  # the round no longer waits for it
            site.signal(signal.SIGCONT)
            assert site.wait(timeout=300) == [0], site.output() + log.read_text()
            sites = {s.site: s for s in waiter.status().sites}
            version = waiter.status().version
    finally:
        if site is not None:
            site.close()
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
    # the restarted PS replayed the open round (snapshot at version 0 + the journaled delta): once the late site
    # left it made version 1; the site's next delta made version 2
    assert version == 2 and sites["local-0"].pushes == 2
    assert "version 0, open round of 1 delta restored" in log.read_text()
    syncs = [r for r in site_metrics(tmp_path) if "train/loss" in r]
    assert [r["sync/version"] for r in syncs] == [0, 2]  # sync 1 ended on the local model, at the version pushed to
    _, meta, _ = CheckpointStore(site_dir / "ckpt", prefix="site").load_latest() or ({}, {}, None)
    assert meta["version"] == 2 and meta["global_model"] and meta["base_global"]  # the global model again
    assert meta["sampler"]["draws"] == sum(r["sync/local_steps"] for r in syncs)


def test_a_stop_signal_during_push_retries_saves_the_work_and_leaves(tmp_path: Path, shards: Path) -> None:
    """A 10-minute retry budget, the PS gone: SIGTERM (Slurm's requeue) ends the retries, the unpushed work is
    checkpointed with its base, and the requeued job pushes it once the PS is back."""
    port = free_port()
    cfg = ps_run_config(tmp_path, port, aggregation="async")
    site_dir = tmp_path / "run" / "sites" / "local-0"
    servers = [ParameterServer(cfg)]
    plain = site_cfg(tmp_path, shards, port, max_syncs=3)
    plain["ps"]["retry_budget"] = "10m"
    site = Site(plain, tmp_path, servers[0].address)
    try:
        wait_for(lambda: any(r.get("sync/index") == 1 for r in site_metrics(tmp_path)), 240, "the first sync")
        servers[0].stop()
        before = servers[0].logic.version
        wait_for(lambda: "PushDelta to" in site.logs[0].read_text(), 120, "the push retrying")
        site.signal(signal.SIGTERM)
        assert site.wait(timeout=60) == [128 + signal.SIGTERM], site.output()
        _, meta, _ = CheckpointStore(site_dir / "ckpt", prefix="site").load_latest() or ({}, {}, None)
        assert meta["version"] == before and meta["pending"]["deferred"]["steps"] == meta["pending"]["steps"] == 3
        servers.append(ParameterServer(cfg))
        again = Site(plain, tmp_path, servers[-1].address)
        try:
            assert again.wait(timeout=300) == [0], again.output()
        finally:
            again.close()
        final = servers[-1].logic.version
    finally:
        site.close()
        for server in servers:
            server.stop()
    syncs = [r for r in site_metrics(tmp_path) if "train/loss" in r]
    assert [r["sync/version"] for r in syncs] == [1, 2, 3] and final == 3
    assert syncs[before]["sync/local_steps"] == 6  # the 3 checkpointed steps went out with the next 3
    _, meta, _ = CheckpointStore(site_dir / "ckpt", prefix="site").load_latest() or ({}, {}, None)
    assert meta["sampler"]["draws"] == sum(r["sync/local_steps"] for r in syncs)


def test_a_site_restarted_while_the_ps_is_down_trains_from_its_checkpoint(tmp_path: Path, shards: Path) -> None:
    """The job starts (a requeue, say) while the PS is down: it trains on from its checkpoint instead of failing
    after ps.connect_timeout, and pushes that work once `ps up` is back on the same port."""
    port = free_port()
    cfg = ps_run_config(tmp_path, port, aggregation="async")
    site_dir = tmp_path / "run" / "sites" / "local-0"
    servers = [ParameterServer(cfg)]
    plain = site_cfg(tmp_path, shards, port, max_syncs=1)
    plain["ps"]["connect_timeout"] = "2s"
    first = Site(plain, tmp_path, servers[0].address)
    try:
        assert first.wait(timeout=300) == [0], first.output()
    finally:
        first.close()
    servers[0].stop()
    plain["train"]["max_syncs"] = 2
    again = Site(plain, tmp_path, f"127.0.0.1:{port}", index=0)
    try:
        wait_for(lambda: any(e["event"] == "push_deferred" for e in events(site_dir)), 240, "a deferred push")
        servers.append(ParameterServer(cfg))
        assert again.wait(timeout=300) == [0], again.output()
        with PSClient(ps_config(), servers[-1].address) as client:
            pushes = {s.site: s.pushes for s in client.status().sites}
        final = servers[-1].logic.version
    finally:
        again.close()
        for server in servers:
            server.stop()
    names = [e["event"] for e in events(site_dir)]
    assert "offline_start" in names and names.index("offline_start") < names.index("deferred_pushed")
    syncs = [r for r in site_metrics(tmp_path) if "train/loss" in r]
    assert [r["sync/version"] for r in syncs] == [1, 2] and final == 2 and pushes["local-0"] == 2
    _, meta, _ = CheckpointStore(site_dir / "ckpt", prefix="site").load_latest() or ({}, {}, None)
    assert meta["sampler"]["draws"] == sum(r["sync/local_steps"] for r in syncs)


@pytest.mark.slow
def test_a_ps_back_behind_the_sites_base_is_reseeded_by_it_and_gets_its_work_once(tmp_path: Path, shards: Path) -> None:
    """ps=cloud's case, with the journal lost: a real `ps up` (async, a snapshot every 10 versions) is SIGKILLed as the
    site pulls version 3 and comes back from its state directory without round/ (an older backup): at version 0,
    behind the site. The running site's work is refused as from the future; it re-seeds the PS with its own copy
    and the work goes in once. Killed again after the site finished, the PS comes back behind the site's checkpoint:
    the restarted site re-seeds it as it starts. The versions never go back, no step is lost or applied twice, and
    the site's log has a line per sync and per checkpoint."""
    import shutil

    port = free_port()
    address, state = f"127.0.0.1:{port}", tmp_path / "state"
    site_dir = tmp_path / "run" / "sites" / "local-0"
    ps_args = ("train.max_local_steps=3", "ps.snapshot_every=10")
    site = again = None
    try:
        with ps_process(state, port, "ps.stream[3]@1=kill", "async", *ps_args) as proc:
            site = Site(site_cfg(tmp_path, shards, port, max_syncs=5), tmp_path, address)
            assert proc.wait(timeout=240) == -9  # killed as the pull of version 3 arrived
        wait_for(lambda: any(e["event"] == "pull_failed" for e in events(site_dir)), 120, "the failed pull")
        shutil.rmtree(state / "round")
        with ps_process(state, port, "", "async", *ps_args):
            assert site.wait(timeout=300) == [0], site.output()
        shutil.rmtree(state / "round")  # killed on leaving the block: back at its last snapshot again
        with ps_process(state, port, "", "async", *ps_args), PSClient(ps_config(), address) as client:
            assert client.status().version < 5
            again = Site(site_cfg(tmp_path, shards, port, max_syncs=6), tmp_path, address)
            assert again.wait(timeout=300) == [0], again.output()
            status = client.status()
        log = site.logs[0].read_text()
    finally:
        for s in (site, again):
            if s is not None:
                s.close()
    reseeds = [e for e in events(site_dir) if e["event"] == "reseed"]
    assert [(e["ps_version"], e["version"]) for e in reseeds] == [(0, 3), (3, 5)]
    syncs = [r for r in site_metrics(tmp_path) if "train/loss" in r]
    assert [r["sync/version"] for r in syncs] == [1, 2, 3, 4, 5, 6] and status.version == 6
    assert {s.site: s.pushes for s in status.sites}["local-0"] == 1  # since the last re-seed: one push, once
    _, meta, _ = CheckpointStore(site_dir / "ckpt", prefix="site").load_latest() or ({}, {}, None)
    assert meta["version"] == 6 and meta["sampler"]["draws"] == sum(r["sync/local_steps"] for r in syncs)
    for n in range(1, 7):
        assert f"local-0: sync {n}: version {n}, " in log
    assert log.count("local-0: checkpoint ") >= 6


def test_a_ps_that_dies_at_the_sites_first_pull_is_failed_over_and_the_next_one_joined(
    tmp_path: Path, shards: Path
) -> None:
    """The site joins the first PS of its ps.address list, which dies (SIGKILL) as the site's first pull arrives (as
    a peer of a group may, while its sites start); the site fails over to the second PS, which never saw its
    session: it joins there, seeds it and trains to the end."""
    a, b = free_port(), free_port()
    cfg = site_cfg(tmp_path, shards, a, max_syncs=2)
    cfg["ps"].update(retry_budget="60s", failover_after="2s")
    cadence = ("train.sync_interval=60s", "train.max_local_steps=3")
    with (
        ps_process(tmp_path / "a", a, "ps.stream@1=kill", "async", *cadence) as first,
        ps_process(tmp_path / "b", b, "", "async", *cadence),
    ):
        site = Site(cfg, tmp_path, f"127.0.0.1:{a},127.0.0.1:{b}")
        try:
            assert site.wait(timeout=300) == [0], site.output()
        finally:
            site.close()
        assert first.wait(timeout=30) == -signal.SIGKILL  # it died at the pull, as planned
        with PSClient(ps_config(), f"127.0.0.1:{b}") as client:
            status = client.status()
    assert status.version == 2 and {s.site: s.pushes for s in status.sites} == {"local-0": 2}
    rejoined = [e for e in events(tmp_path / "run" / "sites" / "local-0") if e["event"] == "rejoin"]
    assert len(rejoined) == 1 and "unknown session" in rejoined[0]["error"], rejoined
