"""Three `geofed-hpc ps up` peers, two real sites each, on loopback: identical models at every version."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from geofed_hpc import codec
from geofed_hpc.errors import GeofedError
from geofed_hpc.metrics import read_jsonl
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from tests.conftest import bible_shards, ps_config
from tests.dist_util import free_pair
from tests.site_procs import Site, events, wait_for
from tests.test_site_client import site_cfg

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
SYNCS = 3
SITES_PER_PS = 2
PS_ARGS = ["train.sync_interval=60s", "train.max_local_steps=3", "ps.round_timeout=60s", "ps.peer_tick=100ms"]
READY = re.compile(r"^parameter server on ", re.M)  # what `ps up` prints once it serves


@pytest.fixture(scope="module")
def shards6(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bible_shards(tmp_path_factory, 3 * SITES_PER_PS, max_tokens=40000)


class Peers:
    """`ps up` processes of one group (logs in `folder`/ps-N.log); killed by PID when the test ends."""

    def __init__(self, folder: Path, n: int, extra: dict[int, list[str]] | None = None) -> None:
        self.ports = [free_pair() for _ in range(n)]  # port + 1: where the peer serves the store if it succeeds
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        rendezvous = f"127.0.0.1:{free_pair()}"
        self.logs = [folder / f"ps-{i}.log" for i in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.args: list[list[str]] = []
        for i, port in enumerate(self.ports):
            args = ["ps", "up", f"ps.port={port}", f"ps.peers=[{','.join(self.addresses)}]", f"ps.peer_rank={i}"]
            args += [f"ps.peer_rendezvous={rendezvous}", "ps.peer_secret=loopback-test", "ps.peer_timeout=60s"]
            args += [f"ps.state_dir={folder / f'ps-{i}'}", *PS_ARGS, *(extra or {}).get(i, [])]
            self.args.append(args)
            self.procs.append(self._start(i, "wb"))

    def _start(self, i: int, mode: str) -> subprocess.Popen[bytes]:
        with open(self.logs[i], mode) as log:
            cmd = [sys.executable, "-m", "geofed_hpc.cli", *self.args[i]]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)

    def restart(self, i: int) -> None:
        """`ps up` of peer `i` again, with the same arguments (its log goes on)."""
        assert self.procs[i].poll() is not None, f"peer {i} is still running"
        self.procs[i] = self._start(i, "ab")

    def output(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def ready(self) -> bool:
        for i, p in enumerate(self.procs):
            assert p.poll() is None, f"peer {i} exited:\n{self.output(i)[-3000:]}"
        return all(READY.search(self.output(i)) for i in range(len(self.procs)))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


@contextmanager
def peers(folder: Path, n: int = 3, extra: dict[int, list[str]] | None = None) -> Iterator[Peers]:
    group = Peers(folder, n, extra)
    try:
        yield group
    finally:
        group.close()


def rows_of(state: Path, kind: str) -> list[dict[str, Any]]:
    """The rows of one kind in a peer's group.jsonl."""
    return [r for r in read_jsonl(state / "group.jsonl") if r["kind"] == kind]


def pull_digest(address: str) -> tuple[int, str]:
    with PSClient(ps_config(connect_timeout="5s"), address) as client:
        client.connect()
        s = client.join(m.JoinRequest("reader")).session_id
        header, payload = client.pull_model(s)
        client.heartbeat(m.HeartbeatRequest(s, leaving=True))
    return header.version, codec.model_digest(codec.decode(payload)).hex()


def version_at(address: str) -> int:
    """The version of the model a PS serves now (-1 while it does not answer yet)."""
    try:
        return pull_digest(address)[0]
    except GeofedError:
        return -1


def test_three_peers_with_two_sites_each_hold_identical_models_while_the_loss_falls(
    tmp_path: Path, shards6: Path
) -> None:
    cfg: dict[str, Any] = site_cfg(tmp_path, shards6, max_syncs=SYNCS, sites=3 * SITES_PER_PS)
    cfg["ps"]["retry_budget"] = "120s"
    sites: list[Site] = []
    rounds = ["ps.min_sites=6", "ps.round_timeout=10m"]  # rounds of all six sites, however late one starts
    with peers(tmp_path, extra={i: rounds for i in range(3)}) as group:
        wait_for(group.ready, 120, "three peers serving")
        try:
            for i in range(3 * SITES_PER_PS):
                sites.append(Site(cfg, tmp_path, group.addresses[i // SITES_PER_PS], index=i))
            for site in sites:
                assert site.wait(timeout=600) == [0], site.output()
            finals = [pull_digest(a) for a in group.addresses]
        finally:
            for site in sites:
                site.close()
    assert len(set(finals)) == 1 and finals[0][0] == SYNCS, finals  # one model, bit for bit, on every peer
    compared = [rows_of(tmp_path / f"ps-{i}", "compared") for i in range(3)]
    for i, rows in enumerate(compared):  # every version compared on every peer, each identical on all three
        assert [r["version"] for r in rows] == list(range(SYNCS + 1)), rows
        assert all(r["peers"] == 3 for r in rows), rows
        assert not rows_of(tmp_path / f"ps-{i}", "mismatch")
    prints = {r["version"]: r["digest"] for r in compared[0]}
    assert all({r["version"]: r["digest"] for r in rows} == prints for rows in compared)
    for i in range(len(sites)):  # every replica any site held is the group's model of that version, bit for bit
        pulls = [e for e in events(tmp_path / "run" / "sites" / f"local-{i}") if e["event"] == "pulled"]
        assert pulls and all(e["digest"] == prints[e["version"]] for e in pulls), pulls
    first, last = [], []
    for i in range(len(sites)):
        losses = [
            r["train/loss"]
            for r in read_jsonl(tmp_path / "run" / "metrics" / f"local-{i}.metrics.jsonl")
            if "train/loss" in r
        ]
        assert len(losses) == SYNCS
        first.append(losses[0])
        last.append(losses[-1])
    assert sum(last) < sum(first)


def test_a_peer_with_another_model_is_refused_at_rendezvous(tmp_path: Path) -> None:
    with peers(tmp_path, 2, extra={1: ["model=tiny_llama"]}) as group:
        codes = [p.wait(timeout=120) for p in group.procs]
        logs = [group.output(i) for i in range(2)]
    assert codes[0] != 0 and codes[1] != 0, logs
    for log in logs:
        assert "refused at the PS group's rendezvous" in log and "model" in log, log
    assert '"name": "tiny_llama"' in logs[0] and '"name": "tiny"' in logs[0], logs[0]


@pytest.mark.parametrize("killed", [2, 0])  # peer 0 serves the group's store: the lowest peer left succeeds it
def test_a_killed_peers_sites_fail_over_nothing_is_lost_or_doubled_and_it_rejoins_bit_for_bit(
    tmp_path: Path, shards6: Path, killed: int
) -> None:
    cfg: dict[str, Any] = site_cfg(tmp_path, shards6, max_syncs=SYNCS, sites=3 * SITES_PER_PS)
    cfg["ps"].update(retry_budget="120s", failover_after="3s")
    sites: list[Site] = []
    alive = [i for i in range(3) if i != killed]
    # ps.min_sites=6: rounds of all six sites, so none finishes before the last one started and the kill
    with peers(tmp_path, extra={i: ["ps.peer_timeout=10s", "ps.min_sites=6"] for i in range(3)}) as group:
        wait_for(group.ready, 120, "three peers serving")
        try:
            for i in range(3 * SITES_PER_PS):
                p = i // SITES_PER_PS
                nearest_first = f"{group.addresses[p]},{group.addresses[(p + 1) % 3]}"
                sites.append(Site(cfg, tmp_path, nearest_first, index=i))
            wait_for(
                lambda: (
                    any(rows_of(tmp_path / "ps-1", "applied"))
                    if (tmp_path / "ps-1" / "group.jsonl").exists()
                    else False
                ),
                300,
                "a first round",
            )
            # and every site joined (the killed peer's own sites hold sessions there: a slow starter that found
            # it gone already would join the next peer fresh, not fail over)
            site_dirs = [tmp_path / "run" / "sites" / f"local-{i}" for i in range(len(sites))]
            joined = lambda: all(any(e["event"] == "ready" for e in events(d)) for d in site_dirs)  # noqa: E731
            wait_for(joined, 300, "every site joined")
            group.procs[killed].kill()  # SIGKILL: its sites' pushes in flight die with it
            group.procs[killed].wait(timeout=30)
            for site in sites:
                assert site.wait(timeout=600) == [0], site.output()
            finals = [pull_digest(group.addresses[i]) for i in alive]
            before = len(group.output(killed))
            group.restart(killed)  # `ps up` again: taken back at the next sync point, with a live peer's state
            wait_for(lambda: READY.search(group.output(killed)[before:]) is not None, 120, "the peer serving again")
            at_version = lambda: version_at(group.addresses[killed]) == finals[0][0]  # noqa: E731
            wait_for(at_version, 120, "the peer at the group's version")
            back = pull_digest(group.addresses[killed])
        finally:
            for site in sites:
                site.close()
    assert finals[0] == finals[1] == back, (finals, back)  # the rejoined peer holds the group's model bit for bit
    assert rows_of(tmp_path / f"ps-{killed}", "compared")[-1]["peers"] == 3  # back in the group, compared with both
    applied = rows_of(tmp_path / "ps-1", "applied")
    ids = [p for r in applied for p in r["push_ids"]]
    assert len(ids) == len(set(ids)), ids  # no push applied twice
    assert sum(r["count"] for r in applied) == len(ids) == SYNCS * len(sites)  # and none lost
    assert applied[-1]["peers"] == 2 and applied[0]["peers"] == 3
    orphans = [killed * SITES_PER_PS + k for k in range(SITES_PER_PS)]
    moved = [e for i in orphans for e in events(tmp_path / "run" / "sites" / f"local-{i}") if e["event"] == "rejoin"]
    assert moved, "the killed peer's sites joined the next peer"
    if killed == 0:  # peer 1 served the group's store after peer 0, and peer 0 came back to it
        assert "this PS (peer 1) serves the store on" in group.output(1)
        assert re.search(r"re-formed \(generation \d+\): peers \[0, 1, 2\]; back: \[0\]", group.output(1))
