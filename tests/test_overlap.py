"""Overlapped syncs (train.overlap) with real site processes and a real PS over gRPC: every base a site moves onto is
the PS's model of its version bit for bit; a site killed while its background push is on the wire resumes with no
step lost or applied twice; a PS lost between an overlapped push and its pull is ridden out."""

from __future__ import annotations

import json
import os
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.client.checkpoints import PUSH_RECORD
from geofed_hpc.client.overlap import Overlap
from geofed_hpc.config import ParadigmConfig, PSConfig, RunConfig, TrainConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.rpc.client import PSClient
from tests.conftest import ps_config
from tests.dist_util import free_port
from tests.site_procs import Site, events
from tests.test_faults import ps_process
from tests.test_site_client import BATCH, MODEL, make_ps, shards, site_cfg
from tests.test_site_parts import lose, model_digest, site, site_status
from tests.test_site_resilience import site_cfg as outage_cfg
from tests.test_site_resilience import site_metrics

__all__ = ["shards", "site"]  # fixtures shared with test_site_client and test_site_parts


def test_a_paradigm_whose_rounds_are_tied_to_their_version_is_refused_with_overlap_naming_the_field() -> None:
    train = TrainConfig(overlap=True, max_local_steps=4)
    for name in ("zo", "split", "fsl_sage"):
        with pytest.raises(ConfigError, match=f"^train.overlap: paradigm={name} ties each round to the version"):
            RunConfig(train=train, paradigm=ParadigmConfig(name=name), ps=PSConfig(aggregation="sync"))
    assert RunConfig(train=train, paradigm=ParadigmConfig(name="lora")).train.overlap  # additive ones overlap


def _run(site: Site, timeout: float = 300) -> None:
    try:
        codes = site.wait(timeout=timeout)
    finally:
        site.close()
    assert codes == [0] * len(codes), site.output()


def _latest(site_dir: Path) -> dict[str, Any]:
    loaded = CheckpointStore(site_dir / "ckpt", prefix="site").load_latest()
    assert loaded is not None
    return loaded[1]


@pytest.mark.slow
def test_a_landing_moves_onto_the_new_version_and_keeps_the_steps_trained_since_the_push(site: Any) -> None:
    """A one-process site joined to a real PS over gRPC: two steps, the push handed to the sender, two more steps
    while it is out. Landing, the base is the PS's new model bit for bit, and the model is that model plus exactly
    what the two later steps changed: local <- new global + (local now - local at push)."""
    trainer, ps, client = site
    overlap = trainer.overlap = Overlap(trainer.sync)
    group = trainer.runtime.group
    for _ in range(2):
        group.step()
    flight = overlap.start(2, 1.0, 0.0, (trainer.runtime.sampler.draws, 0, 1))
    anchor = {k: v.copy() for k, v in flight.group.anchor.items()}
    for _ in range(2):
        group.step()  # training goes on while the push is out
    local = {k: np.array(v, copy=True) for k, v in group.model_arrays().items()}
    assert flight.finished.wait(120) and flight.error is None and flight.synced is not None
    overlap.land(2)
    header, payload = client.pull_model(trainer.sync.link.session_id, 0, timedelta(0))
    pulled = codec.decode(payload)
    assert header.version == trainer.sync.version == ps.logic.version == 1 and trainer.sync.replica.exact
    assert model_digest(trainer.sync.replica.base) == model_digest(pulled)  # the base: the PS's model, bit for bit
    now = group.model_arrays()
    for name, value in pulled.items():
        assert np.array_equal(now[name], value + (local[name] - anchor[name])), name
    assert any(not np.array_equal(now[k], v) for k, v in pulled.items())  # the later steps were kept, not dropped
    assert trainer.sync.uplink.work_id == ""  # work since the new base is new work: a new push id


@pytest.mark.slow
@pytest.mark.parametrize("reaches_ps", [True, False], ids=["reply-lost", "push-lost"])
def test_a_flight_whose_push_goes_unanswered_gives_its_work_back_and_it_goes_out_once(
    site: Any, reaches_ps: bool
) -> None:
    """The sender's push gets no reply (after the PS applied it, or before it arrived): the flight comes back
    deferred, nothing moves, and its steps stay against the same base. The next flight asks the PS about the
    unanswered push and sends only what it does not hold: every step reaches the global model exactly once."""
    trainer, ps, client = site
    overlap = trainer.overlap = Overlap(trainer.sync)
    group, per_step, uplink = trainer.runtime.group, trainer.sync.tokens_per_step(), trainer.sync.uplink
    for _ in range(2):
        group.step()
    lose(client, reaches_ps)
    before = group.model_arrays()["wte.weight"].copy()
    flight = overlap.start(2, 1.0, 0.0, (trainer.runtime.sampler.draws, 0, 1))
    assert flight.finished.wait(120) and flight.error is None
    assert overlap.land(0).synced is None and flight.moves.deferred  # deferred: nothing moved
    assert np.array_equal(group.model_arrays()["wte.weight"], before) and trainer.sync.version == 0
    assert uplink.deferred.steps == 2 and uplink.deferred.attempt is not None
    for _ in range(2):
        group.step()  # trained on against the same base
    flight = overlap.start(4, 1.0, 0.0, (trainer.runtime.sampler.draws, 0, 1))
    assert flight.finished.wait(120) and flight.error is None and flight.synced is not None
    overlap.land(0)
    status = site_status(client)
    assert status.tokens == 4 * per_step and status.pushes == 1 + int(reaches_ps)  # each step once
    assert trainer.sync.version == ps.logic.version == 1 + int(reaches_ps)
    _, payload = client.pull_model(trainer.sync.link.session_id, 0, timedelta(0))
    assert model_digest(trainer.sync.replica.base) == model_digest(codec.decode(payload))


@pytest.mark.slow
def test_a_stop_while_the_pull_is_out_checkpoints_the_steps_since_the_push_and_the_restart_finishes(
    site: Any, tmp_path: Path, shards: Path
) -> None:
    """The PS confirmed the flight's push; its pull is held back. A stop now (SIGTERM at the next step boundary)
    makes the anchor the base at the version the push made and checkpoints the steps since the push as unpushed
    work against it. A real site process restarted from that checkpoint pushes those steps once and finishes."""
    trainer, ps, client = site
    overlap = trainer.overlap = Overlap(trainer.sync)
    group, per_step = trainer.runtime.group, trainer.sync.tokens_per_step()
    held, real = threading.Event(), client.pull_model

    def pull_model(*args: Any, **kwargs: Any) -> Any:
        held.wait(120)  # the version our push made is late
        return real(*args, **kwargs)

    client.pull_model = pull_model  # type: ignore[method-assign]
    record, uplink = threading.Event(), trainer.sync.uplink
    on_push = uplink.on_push
    assert on_push is not None
    uplink.on_push = lambda header: (record.wait(120), on_push(header))[1]  # its record waits for the steps below
    trainer.interval.begin()
    for _ in range(2):
        group.step()
    trainer.progress.tokens_seen = 2 * per_step
    flight = overlap.start(2, 1.0, 0.0, (trainer.runtime.sampler.draws, 2 * per_step, 1))
    trainer.interval.begin()
    for _ in range(3):
        group.step()  # the training thread trains on before the sender writes the push record
    trainer.progress.tokens_seen += 3 * per_step
    record.set()
    assert flight.moves.applied.wait(120)  # the push is in; its pull waits
    pushed = json.loads((trainer.ckpt.store.directory / PUSH_RECORD).read_text())
    assert pushed["draws"] == 2 and pushed["tokens_seen"] == 2 * per_step  # what was pushed, not trained since
    trainer.lifecycle.request(15)
    steps, loss_sum = trainer._settle_flight(3, 3.0)
    assert (steps, loss_sum) == (3, 3.0) and overlap.flight is None and trainer.progress.syncs == 1
    assert trainer.sync.version == 1 and not trainer.sync.replica.exact  # the anchor, at the version pushed to
    path = trainer.ckpt.save(pending=trainer.interval.pending(steps, loss_sum))
    held.set()
    client.pull_model = real  # type: ignore[method-assign]
    tensors, meta = CheckpointStore(path.parent, prefix="site").load_latest()[:2]  # type: ignore[index]
    assert meta["version"] == 1 and meta["pending"]["steps"] == 3 and not meta["base_global"]
    assert np.array_equal(tensors["base/wte.weight"], flight.group.anchor["wte.weight"])
    assert meta["sampler"]["draws"] == 5
    client.close()
    trainer.sync.link.client = None

    _run(Site(site_cfg(tmp_path, shards, max_syncs=2, sites=1, overlap=True), tmp_path, ps.address))
    with PSClient(ps_config(), ps.address) as again:
        status = site_status(again)
    meta = _latest(tmp_path / "run" / "sites" / "local-0")
    assert meta["syncs"] == 2 and meta["global_model"]
    assert status.tokens == meta["sampler"]["draws"] * per_step  # the 2 pushed, then the 3 after: each once
    assert status.pushes == 2


@pytest.mark.slow
def test_every_base_a_site_moves_onto_is_the_ps_model_of_its_version_bit_for_bit(tmp_path: Path, shards: Path) -> None:
    """Two overlapped sites in sync mode: each pushes, trains on, and moves onto the version the round made while
    training (the steps since the push kept). An observer records the PS's model digest at every version; every
    base a site pulled (by the PS's updates, applied to its copy) has that digest, and no replica diverged. The
    PS's token count per site is what it trained: no step lost or applied twice."""
    ps = make_ps(tmp_path, aggregation="sync", min_sites=2, round_timeout="2m")  # both sites in every round
    core = ps.logic.core
    seen: dict[int, str] = {}
    stop = threading.Event()

    def observe() -> None:
        while not stop.wait(0.005):
            with core._cond:  # the version and its model, together
                if core.model.initialized:
                    seen.setdefault(core.model.version, core.model.digest().hex())

    observer = threading.Thread(target=observe, daemon=True)
    observer.start()
    sites = [
        Site(site_cfg(tmp_path, shards, max_syncs=4, sites=2, overlap=True, max_local_steps=4), tmp_path, ps.address,
             index=i)
        for i in range(2)
    ]  # fmt: skip
    try:
        for site in sites:
            _run(site)
        with PSClient(ps_config(), ps.address) as client:
            status = client.status()
    finally:
        stop.set()
        observer.join(10)
        for site in sites:
            site.close()
        ps.stop()
    assert status.version == 4
    for i in range(2):
        site_dir = tmp_path / "run" / "sites" / f"local-{i}"
        log = events(site_dir)
        assert not [e for e in log if e["event"] == "replica_diverged"]
        pulled = [e for e in log if e["event"] == "pulled"]
        assert [e["version"] for e in pulled] == [0, 1, 2, 3, 4]
        assert all(e["kind"] == "updates" for e in pulled[1:])  # applied to the site's copy, not sent whole
        assert all(e["digest"] == seen[e["version"]] for e in pulled), (pulled, seen)  # the PS's model, bit for bit
        landed = [e for e in log if e["event"] == "landed"]
        assert [e["version"] for e in landed] == [1, 2, 3, 4] and all(e["exact"] for e in landed)
        assert landed[-1]["steps_since_push"] == 0  # the last push is waited for: nothing trained after it
        meta = _latest(site_dir)
        assert meta["version"] == 4 and meta["global_model"] and meta["syncs"] == 4
        (mine,) = [s for s in status.sites if s.site == f"local-{i}"]
        assert mine.tokens == meta["sampler"]["draws"] * BATCH * MODEL.context  # every step applied exactly once
        assert mine.pushes == 4
    trained_on = [e["steps_since_push"] for i in range(2) for e in events(tmp_path / "run" / "sites" / f"local-{i}")
                  if e["event"] == "landed"]  # fmt: skip
    assert any(s > 0 for s in trained_on)  # the sites trained while their pushes were out


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_site_killed_while_its_background_push_is_on_the_wire_loses_no_step_and_applies_none_twice(
    tmp_path: Path, shards: Path, world: int
) -> None:
    """The site process is SIGKILLed from its sender thread as its second push's first chunk is on the wire (the
    training thread is training on). The latest checkpoint is the one taken when the first push's version arrived
    (with the steps trained since that push as unpushed work); beside it, the record of the second push. The
    restarted job asks the PS about that push, trains what is missing, and finishes: the PS's token count equals
    the batches the site drew."""
    ps = make_ps(tmp_path, aggregation="async")
    site_dir = tmp_path / "run" / "sites" / "local-0"
    cfg = site_cfg(tmp_path, shards, max_syncs=3, sites=1, overlap=True)
    try:
        os.environ["GEOFED_FAULTS"] = "rpc.push@3=kill"  # 1: the seed of the empty PS, 2: push 1, 3: push 2
        try:
            killed = Site(cfg, tmp_path, ps.address, world=world)
        finally:
            os.environ.pop("GEOFED_FAULTS", None)
        try:
            codes = killed.wait(timeout=300)
            assert codes[0] == -9 and all(c != 0 for c in codes), killed.output()  # a follower leaves with rank 0
        finally:
            killed.close()
        assert "fault injected: kill at rpc.push" in killed.output()
        assert ps.logic.version == 1  # push 2 never arrived whole
        first = [e for e in events(site_dir) if e["event"] == "landed"]
        assert [e["version"] for e in first] == [1]
        _run(Site(cfg, tmp_path, ps.address, world=world))
        with PSClient(ps_config(), ps.address) as client:
            status = client.status()
    finally:
        ps.stop()
    meta = _latest(site_dir)
    assert meta["syncs"] == 3 and meta["version"] == 3 and meta["global_model"]
    assert ("shards" in meta) == (world > 1)  # two ranks: each wrote its shard (DCP)
    (site,) = status.sites
    assert site.tokens == meta["sampler"]["draws"] * BATCH * MODEL.context  # nothing lost, nothing applied twice
    assert site.pushes == 3 and status.version == 3
    asked = [e for e in events(site_dir) if e["event"] == "push_after_checkpoint"]
    assert all(e["state"] == "not held" for e in asked)  # the broken stream was not applied
    ready = [e["source"] for e in events(site_dir) if e["event"] == "ready"]
    assert ready == ["fresh", "local"]  # the restart went on from the checkpoint taken at the landing


@pytest.mark.slow
def test_a_ps_lost_between_an_overlapped_push_and_its_pull_is_ridden_out(tmp_path: Path, shards: Path) -> None:
    """A real `ps up` applies the site's first overlapped push, answers it, and is SIGKILLed when the sender asks
    for the new version. An empty PS comes up on the same port while the pull still retries: the sender joins it
    again and re-seeds it with the anchor (the model its push was taken from) at the version the push made; the
    site, which trained on meanwhile, keeps those steps and the federation goes on from there."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    site_dir = tmp_path / "run" / "sites" / "local-0"
    quick = ("train.max_local_steps=3",)
    cfg = outage_cfg(tmp_path, shards, port, max_syncs=3, overlap=True)
    cfg["ps"]["retry_budget"] = "2m"  # the pull outlives the restart
    site = None
    try:
        with ps_process(tmp_path / "first", port, "ps.stream[1]@1=kill", "async", *quick) as proc:
            site = Site(cfg, tmp_path, address)
            assert proc.wait(timeout=240) == -9  # killed as the pull of version 1 arrived
        with ps_process(tmp_path / "empty", port, "", "async", *quick), PSClient(ps_config(), address) as client:
            _run(site)
            status = client.status()
    finally:
        if site is not None:
            site.close()
    names = [e["event"] for e in events(site_dir)]
    assert names.index("pull_failed") < names.index("rejoin") < names.index("reseed")
    assert [e["version"] for e in events(site_dir) if e["event"] == "reseed"] == [1]  # the version its push made
    syncs = [r for r in site_metrics(tmp_path) if "train/loss" in r]
    assert [r["sync/version"] for r in syncs] == [1, 2, 3] and status.version == 3
    meta = _latest(site_dir)
    assert meta["version"] == 3 and meta["global_model"]
    (mine,) = status.sites  # the empty PS saw every step since its re-seed once
    assert mine.tokens == (meta["sampler"]["draws"] - syncs[0]["sync/local_steps"]) * BATCH * MODEL.context


@pytest.mark.slow
def test_a_landing_reports_to_the_ps_beside_training_and_the_ps_gets_the_report(site: Any) -> None:
    """train.overlap: the heartbeat that tells the PS the global model's validation loss and the site's goodput at a
    landing goes out on its own thread. Held on the wire, it does not hold the training thread: telemetry returns,
    and a landing meanwhile does not wait for it (its report is dropped). Released, the PS has the report; the next
    landing's metrics show its round trip."""
    trainer, ps, client = site
    sync, observer = trainer.sync, ps.logic.core.observer
    entered, held, real = threading.Event(), threading.Event(), client.heartbeat

    def heartbeat(request: Any, **kwargs: Any) -> Any:
        entered.set()
        held.wait(120)
        return real(request, **kwargs)

    client.heartbeat = heartbeat  # type: ignore[method-assign]
    assert sync.replica.exact and sync.version == 0
    first = sync.telemetry(4.5, 100, 1.0, trainer.progress, 0.9, background=True)
    assert entered.wait(60) and not held.is_set()  # on the wire and held, and telemetry came back
    assert "net/rtt_ms" not in first  # no round trip known yet
    second = sync.telemetry(4.25, 100, 1.0, trainer.progress, 0.9, background=True)  # the first is still out
    assert "net/rtt_ms" not in second and observer.global_val_loss()[0] == -1  # nothing reached the PS yet
    held.set()
    sync.settle_report()
    assert observer.global_val_loss() == (0, 4.5)  # the held report arrived; the one beside it was dropped
    client.heartbeat = real  # type: ignore[method-assign]
    sync.telemetry(4.0, 100, 1.0, trainer.progress, 0.9, background=True)
    sync.settle_report()
    assert observer.global_val_loss() == (0, 4.0)
    assert sync.telemetry(3.5, 100, 1.0, trainer.progress, 0.9, background=True)["net/rtt_ms"] > 0  # the last one's
    sync.settle_report()
