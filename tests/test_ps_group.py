"""A PS group on gloo over loopback: rendezvous refusals, the sync decision, identical models on every peer."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.cli import main
from geofed_hpc.config import CodecConfig, ModelConfig, RunConfig
from geofed_hpc.errors import AuthError, ConfigError, GeofedError, MismatchError, ProtocolError, UnavailableError
from geofed_hpc.ps.app import ParameterServer
from geofed_hpc.ps.group.membership import form
from geofed_hpc.ps.group.rendezvous import check_identities, identity
from geofed_hpc.ps.group.sync import SyncPoint, decide
from geofed_hpc.ps.tokens import TokenFile, tokens_path
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from tests.conftest import ps_config, small_params
from tests.dist_util import free_pair

FP32 = CodecConfig(name="fp32")
INT8 = CodecConfig(name="int8", block_size=64)


def point(version: int = 3, digest: str = "d", count: int = 0, complete: bool = True, **kw: Any) -> SyncPoint:
    return SyncPoint(kw.pop("initialized", True), version, digest, count, complete, kw.pop("timed_out", False), **kw)


def test_the_sync_decision() -> None:
    blank = point(0, "", initialized=False)
    assert decide([blank, blank]).action == "wait"
    seed = decide([blank, point(0, "", initialized=False, seeds=True), point(0, "", initialized=False, seeds=True)])
    assert (seed.action, seed.source, seed.peers) == ("seed", 1, [0, 2])
    adopt = decide([point(2), point(3), point(3), blank])  # a restarted peer, one behind: the lowest newest gives
    assert (adopt.action, adopt.source, adopt.peers) == ("adopt", 1, [0, 3])
    odd = decide([point(digest="a"), point(digest="b"), point(digest="a")])
    assert (odd.action, odd.source, odd.peers, odd.majority) == ("mismatch", 0, [1], "a")  # 1 takes 0's model
    odd = decide([point(digest="b"), point(digest="a"), point(digest="a")])
    assert (odd.source, odd.peers) == (1, [0])  # the majority's lowest peer gives, never the one that differs
    split = decide([point(digest="a"), point(digest="b")])
    assert (split.source, split.peers, split.majority) == (-1, [0, 1], "")  # no majority: both stop
    assert decide([point(count=2), point(count=0, complete=False)]).action == "wait"  # a peer's sites not in yet
    assert decide([point(count=2), point(count=0, complete=False, timed_out=True)]).action == "close"
    assert decide([point(count=2), point(count=0)]).action == "close"  # a peer without sites holds nothing
    assert decide([point(count=0), point(count=0)]).action == "wait"
    lost = [point(count=2, active=2, expect=6), point(count=2, active=2)]  # a lost peer's 2 sites are failing over
    assert decide(lost).action == "wait"
    assert decide([point(count=2, active=2, expect=6), point(count=3, active=3)]).action == "wait"  # one is back
    assert decide([point(count=2, active=2, expect=6), point(count=4, active=4)]).action == "close"  # both are
    assert decide([*lost[:1], point(count=2, active=2, timed_out=True)]).action == "close"  # or the deadline passed
    late = [point(count=2, active=2, min_sites=6), point(count=2, active=2, min_sites=6)]  # ps.min_sites=6
    assert decide(late).action == "wait"  # 4 of the group's sites are in: the late ones join this round
    assert decide([*late[:1], point(count=4, active=4, min_sites=6)]).action == "close"
    assert decide([*late[:1], point(count=2, active=2, min_sites=6, timed_out=True)]).action == "close"


def test_peer_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="ps.peer_rank"):
        ps_config(peers=["127.0.0.1:5000", "127.0.0.1:5002"], peer_rank=2)
    two = ["127.0.0.1:5000", "127.0.0.1:5002"]
    with pytest.raises(ConfigError, match=r"ps.peer_sync_interval: .*ps.aggregation=async .* set one"):
        ps_config(peers=two, peer_rank=0, aggregation="async")
    with pytest.raises(ConfigError, match=r"ps.peer_sync_interval: .*half of ps.rpc_timeout"):
        ps_config(peers=two, peer_rank=0, aggregation="buffered", peer_sync_interval="10m")
    with pytest.raises(ConfigError, match="ps.robust"):
        ps_config(peers=two, peer_rank=0, aggregation="buffered", peer_sync_interval="5s", robust="median")
    assert ps_config(peers=two, peer_rank=0, aggregation="async", peer_sync_interval="5s").grouped
    with pytest.raises(ConfigError, match="twice"):
        ps_config(peers=["127.0.0.1:5000", "127.0.0.1:5000"], peer_rank=0)


def peers(n: int) -> list[str]:
    return [f"127.0.0.1:{free_pair()}" for _ in range(n)]


def meet_all(cfgs: list[RunConfig]) -> list[Any]:
    """form() on every config at once (threads); each one's group or error."""
    out: list[Any] = [None] * len(cfgs)

    def run(i: int) -> None:
        try:
            out[i] = form(cfgs[i].ps, identity(cfgs[i]))
        except GeofedError as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cfgs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def group_cfg(addresses: list[str], rank: int, rendezvous: str, **ps: Any) -> RunConfig:
    _, port = addresses[rank].rsplit(":", 1)
    settings = {"peer_timeout": "20s", "peer_tick": "50ms", "peer_secret": "s3cret", "round_timeout": "30s", **ps}
    cfg = ps_config(port=int(port), peers=addresses, peer_rank=rank, peer_rendezvous=rendezvous, **settings)
    return replace(RunConfig(), ps=cfg)


def test_a_peer_with_another_model_or_secret_or_peer_list_is_refused_naming_both() -> None:
    addresses, rdv = peers(3), f"127.0.0.1:{free_pair()}"
    cfgs = [group_cfg(addresses, r, rdv) for r in range(3)]
    cfgs[2] = replace(cfgs[2], model=ModelConfig(name="other", d_model=64))
    errors = meet_all(cfgs)
    assert all(isinstance(e, MismatchError) for e in errors), errors
    assert "peer 2" in str(errors[0]) and '"name": "other"' in str(errors[0]) and "this PS (peer 0" in str(errors[0])
    assert '"name": "tiny"' in str(errors[0])  # both models named

    addresses, rdv = peers(2), f"127.0.0.1:{free_pair()}"
    cfgs = [group_cfg(addresses, 0, rdv), group_cfg(addresses, 1, rdv, peer_secret="wrong")]
    errors = meet_all(cfgs)
    assert all(isinstance(e, MismatchError) and "shared secret" in str(e) for e in errors), errors

    addresses, rdv = peers(2), f"127.0.0.1:{free_pair()}"
    other = [addresses[0], f"127.0.0.1:{free_pair()}"]
    cfgs = [group_cfg(addresses, 0, rdv), replace(group_cfg(other, 1, rdv))]
    errors = meet_all(cfgs)
    assert all(isinstance(e, MismatchError) and "peers" in str(e) for e in errors), errors


def test_a_peer_that_never_arrives_times_out_naming_it(tmp_path: Path) -> None:
    addresses, rdv = peers(3), f"127.0.0.1:{free_pair()}"
    secret = tmp_path / "secret"
    secret.write_text("from-a-file\n")
    cfgs = [
        group_cfg(addresses, r, rdv, peer_timeout="1s", peer_secret="", peer_secret_file=str(secret)) for r in (0, 1)
    ]
    errors = meet_all(cfgs)
    assert all(isinstance(e, UnavailableError) for e in errors), errors
    assert "peer 2 (" + addresses[2] + ") did not arrive" in str(errors[0]) and "ps.peer_timeout" in str(errors[0])


@contextmanager
def group_of(n: int, **ps: Any) -> Iterator[list[ParameterServer]]:
    addresses, rdv = peers(n), f"127.0.0.1:{free_pair()}"
    servers: list[Any] = [None] * n

    def start(i: int) -> None:
        own = {"state_dir": f"{ps['state_dir']}/{i}"} if "state_dir" in ps else {}
        servers[i] = ParameterServer(group_cfg(addresses, i, rdv, **{**ps, **own}))

    threads = [threading.Thread(target=start, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert all(isinstance(s, ParameterServer) for s in servers), servers
        yield servers
    finally:
        for s in servers:
            if isinstance(s, ParameterServer):
                s.stop(timedelta(seconds=1))


def wait_for(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def client(ps: ParameterServer) -> PSClient:
    c = PSClient(ps_config(), ps.address)
    c.connect(timedelta(seconds=5))
    return c


def join_and_seed(
    servers: list[ParameterServer], clients: list[PSClient], params: dict[str, np.ndarray], via: int = 0
) -> list[str]:
    """Site `site-i` joins peer i; the group is seeded with `params` through peer `via`. The sessions."""
    sessions = [c.join(m.JoinRequest(f"site-{i}")).session_id for i, c in enumerate(clients)]
    init = m.PushHeader(sessions[via], 0, 0, 0, "fp32", 0, b"", "seed", init=True)
    assert clients[via].push_delta(init, codec.encode(params, FP32)).accepted
    wait_for(lambda: all(s.logic.initialized for s in servers), "every peer to hold the seed")
    return sessions


@pytest.mark.parametrize("peer_codec", ["int8", "fp32"])
def test_three_peers_apply_identical_updates_and_know_each_others_pushes(peer_codec: str) -> None:
    params = small_params()
    with group_of(3, peer_codec=peer_codec) as servers:
        clients = [client(s) for s in servers]
        try:
            sessions = join_and_seed(servers, clients, params, via=1)
            # the peers that took the seed from peer 1 still count their site active: the first round waits for it
            assert [len(s.logic.core.sessions.active()) for s in servers] == [1, 1, 1]
            late = m.PushHeader(sessions[2], 0, 0, 0, "fp32", 0, b"", "late", init=True)
            assert not clients[2].push_delta(late, codec.encode(small_params(seed=5), FP32)).accepted
            hashes = {s.logic.core.model_hash() for s in servers}
            assert len(hashes) == 1
            for version in range(3):
                pushes = []
                for i in range(3):
                    delta = {k: np.full_like(v, 0.01 * (i + 1) * (version + 1)) for k, v in params.items()}
                    header = m.PushHeader(sessions[i], version, 2, 10, "int8", 0, b"", f"p{version}-{i}")
                    pushes.append((header, codec.encode(delta, INT8)))
                replies = concurrently(clients, pushes)  # each answered once the group applied its round
                assert all(r.accepted and r.version == version + 1 for r in replies), replies
                wait_for(lambda v=version: all(s.logic.version == v + 1 for s in servers), f"version {version + 1}")
                hashes = {s.logic.core.model_hash() for s in servers}
                assert len(hashes) == 1, hashes
            moved = servers[0].logic.core.model.params
            assert moved is not None and not np.array_equal(moved["blocks.0.w"], params["blocks.0.w"])
            # a push applied through peer 0, resent to peer 2 (its site failed over): answered, not applied twice
            again = m.PushHeader(sessions[2], 2, 2, 10, "int8", 0, b"", "p2-0")
            delta = {k: np.full_like(v, 0.03) for k, v in params.items()}
            reply = clients[2].push_delta(again, codec.encode(delta, INT8))
            assert reply.duplicate and reply.accepted
            assert servers[2].logic.rounds.count == 0
            group = servers[0].group
            assert group is not None and group.failed is None
            wait_for(lambda: group.stats.versions == [0, 1, 2, 3], "every version compared", 10)
            assert group.stats.identical == group.stats.compared == 4
            # what `geofed-hpc status` shows of the group, as peer 2's last sync point saw it (it may compare the
            # last version a moment after peer 0)
            wait_for(lambda: [p.version for p in clients[2].status().peers] == [3] * 3, "peer 2 to compare version 3")
            st = clients[2].status()
            assert [p.member for p in st.peers] == [True] * 3 and [p.version for p in st.peers] == [3] * 3
            assert len({p.digest for p in st.peers}) == 1 and st.identical_versions == 4 and st.allreduce_bytes > 0
        finally:
            for c in clients:
                c.close()


def concurrently(clients: list[PSClient], pushes: list[tuple[m.PushHeader, bytes]]) -> list[m.PushReply]:
    """Every client pushes its (header, payload) at once (a grouped PS answers when the round is applied)."""
    with ThreadPoolExecutor(len(pushes)) as pool:
        futures = [pool.submit(c.push_delta, h, p) for c, (h, p) in zip(clients, pushes, strict=True)]
        return [f.result(timeout=60) for f in futures]


def push_round(clients: list[PSClient], sessions: list[str], version: int, params: dict[str, np.ndarray]) -> None:
    pushes = []
    for i, s in enumerate(sessions):
        delta = {k: np.full_like(v, 0.01 * (i + 1)) for k, v in params.items()}
        pushes.append(
            (m.PushHeader(s, version, 2, 10, "int8", 0, b"", f"v{version}-{i}-{s[:6]}"), codec.encode(delta, INT8))
        )
    assert all(r.accepted for r in concurrently(clients, pushes))


@pytest.mark.parametrize("stopped", [2, 0])  # peer 0 serves the group's store: peer 1 serves a new one
def test_a_stopped_peer_shrinks_the_group_and_rejoins_from_a_live_peer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], stopped: int
) -> None:
    params = small_params()
    with group_of(3, peer_timeout="8s", state_dir=str(tmp_path / "ps")) as servers:
        clients = [client(s) for s in servers]
        try:
            sessions = join_and_seed(servers, clients, params)
            push_round(clients, sessions, 0, params)
            wait_for(lambda: all(s.logic.version == 1 for s in servers), "version 1")
            live = [i for i in range(3) if i != stopped]
            gone_cfg = servers[stopped].cfg
            clients[stopped].close()
            servers[stopped].stop(timedelta(seconds=1))  # leaves: the other two re-form and go on alone
            wait_for(lambda: all(servers[i].group.stats.members == live for i in live), "shrink")
            for version in (1, 2):
                push_round([clients[i] for i in live], [sessions[i] for i in live], version, params)
                wait_for(
                    lambda v=version: all(servers[i].logic.version == v + 1 for i in live), f"version {version + 1}"
                )
            assert all(servers[i].group is not None and servers[i].group.failed is None for i in live)
            assert main(["status", f"ps.address={servers[live[0]].address}"]) == 0
            shown = capsys.readouterr().out
            assert "PS group generation 1: 2 of 3 peers" in shown and f"{gone_cfg.ps.peers[stopped]:<24}gone" in shown
            servers[stopped] = ParameterServer(gone_cfg)  # back on its port: taken back at the next sync point
            back = servers[stopped]
            wait_for(lambda: back.logic.initialized and back.logic.version == 3, "the rejoined peer at version 3")
            assert len({s.logic.core.model_hash() for s in servers}) == 1  # bit for bit, optimizer state too
            assert (
                back.group is not None
                and back.group.stats.adopted_from == live[0]
                and back.group.joined.generation == 2
            )
            assert back.group.joined.server == live[0]  # peer 0 stopped: peer 1 serves the store, peer 0 found it there
            assert back.logic.core.ledger.knows("v2-0-" + sessions[live[0]][:6])  # the push ids came with the model
            clients[stopped] = client(back)  # its site comes back to it: its session was in the PS's snapshot
            push_round(clients, sessions, 3, params)
            wait_for(lambda: all(s.logic.version == 4 for s in servers), "version 4 with all three")
            assert len({s.logic.core.model_hash() for s in servers}) == 1
        finally:
            for c in clients:
                c.close()


def test_a_site_fails_over_to_the_next_peer_and_its_push_is_applied_once() -> None:
    params = small_params()
    with group_of(2, peer_timeout="8s", peer_codec="fp32") as servers:
        near, far = servers[1], servers[0]  # the site's nearest PS is peer 1; peer 0 is the next on its list
        site = PSClient(ps_config(failover_after="1s", retry_budget="60s"), f"{near.address},{far.address}")
        other = client(far)
        try:
            site.connect(timedelta(seconds=5))
            assert site.address == near.address
            mine = site.join(m.JoinRequest("site-a")).session_id
            theirs = other.join(m.JoinRequest("site-b")).session_id
            init = m.PushHeader(theirs, 0, 0, 0, "fp32", 0, b"", "seed", init=True)
            assert other.push_delta(init, codec.encode(params, FP32)).accepted
            wait_for(lambda: all(s.logic.initialized for s in servers), "the seed on both peers")
            ones = codec.encode({k: np.ones_like(v) for k, v in params.items()}, FP32)
            with ThreadPoolExecutor(1) as pool:  # our push waits in the open round: peer 0's site has not pushed
                pending = pool.submit(site.push_delta, m.PushHeader(mine, 0, 2, 10, "fp32", 0, b"", "A"), ones)
                wait_for(lambda: near.logic.rounds.count == 1, "our delta in peer 1's round")
                near.stop(timedelta(seconds=1))  # our PS goes before the group applied the round
                with pytest.raises(AuthError):  # the retry reached peer 0, which does not know our session
                    pending.result(timeout=60)
            assert site.address == far.address
            mine = site.join(m.JoinRequest("site-a")).session_id  # the site joins peer 0 and pushes again
            threes = codec.encode({k: np.full_like(v, 3.0) for k, v in params.items()}, FP32)
            replies = concurrently(
                [site, other],
                [
                    (m.PushHeader(mine, 0, 2, 10, "fp32", 0, b"", "A"), ones),
                    (m.PushHeader(theirs, 0, 2, 10, "fp32", 0, b"", "B"), threes),
                ],
            )
            assert all(r.accepted and not r.duplicate and r.version == 1 for r in replies), replies
            again = site.push_delta(m.PushHeader(mine, 0, 2, 10, "fp32", 0, b"", "A"), ones)
            assert again.duplicate and far.logic.version == 1  # answered, not applied twice
            model = far.logic.core.model.params
            assert model is not None
            for k, v in params.items():  # the mean of A and B applied once: nothing lost, nothing doubled
                np.testing.assert_array_equal(model[k], v + np.float32(2.0))
        finally:
            site.close()
            other.close()


def test_a_peer_whose_model_differs_takes_the_majoritys_and_keeps_its_open_round(tmp_path: Path) -> None:
    params = small_params()
    with group_of(3, peer_codec="fp32", state_dir=str(tmp_path / "ps")) as servers:
        clients = [client(s) for s in servers]
        pool = ThreadPoolExecutor(1)  # peer 2's site pushes while the round waits for the other two sites
        try:
            sessions = join_and_seed(servers, clients, params)
            ones = {k: np.ones_like(v) for k, v in params.items()}
            pushes = [
                (m.PushHeader(s, 0, 2, 10, "fp32", 0, b"", f"r0-{i}"), codec.encode(ones, FP32))
                for i, s in enumerate(sessions)
            ]
            assert all(r.accepted for r in concurrently(clients, pushes))
            wait_for(lambda: all(s.logic.version == 1 for s in servers), "version 1")
            bad = servers[2].logic.core
            threes = codec.encode({k: np.full_like(v, 3.0) for k, v in params.items()}, FP32)
            pending = pool.submit(
                clients[2].push_delta, m.PushHeader(sessions[2], 1, 2, 10, "fp32", 0, b"", "x"), threes
            )
            wait_for(lambda: servers[2].logic.rounds.count == 1, "the delta in peer 2's open round")
            with bad._cond:  # a bit flip in peer 2's memory, seen at the next sync point
                assert bad.model.params is not None
                bad.model.params["blocks.0.w"][0, 0] += 5.0
                bad.model._digest = None
            wait_for(lambda: len({s.logic.core.model_hash() for s in servers}) == 1, "peer 2 repaired", 30)
            assert servers[2].logic.rounds.count == 1  # its open round kept
            zeros = codec.encode({k: np.zeros_like(v) for k, v in params.items()}, FP32)
            pushes = [(m.PushHeader(sessions[i], 1, 2, 10, "fp32", 0, b"", f"r1-{i}"), zeros) for i in (0, 1)]
            assert all(r.accepted for r in concurrently(clients[:2], pushes))
            reply = pending.result(timeout=60)
            assert reply.accepted and not reply.duplicate and reply.version == 2, reply
            wait_for(lambda: all(s.logic.version == 2 for s in servers), "version 2")
            assert len({s.logic.core.model_hash() for s in servers}) == 1
            model = servers[2].logic.core.model.params
            assert model is not None
            for k, v in params.items():  # 1 at version 1, then (3 + 0 + 0) / 3: peer 2's delta counted, the flip gone
                np.testing.assert_allclose(model[k], v + np.float32(2.0), rtol=0, atol=1e-6)
            assert all(s.group is not None and s.group.failed is None for s in servers)
            rows = [json.loads(line) for line in (tmp_path / "ps" / "2" / "group.jsonl").read_text().splitlines()]
            assert [r["version"] for r in rows if r["kind"] == "mismatch"] == [1]
            repaired = [r for r in rows if r["kind"] == "repaired"]
            assert len(repaired) == 1 and repaired[0]["source"].startswith("peer 0 (")
        finally:
            for c in clients:
                c.close()  # a push still waiting ends with its channel
            pool.shutdown(cancel_futures=True)


def test_a_token_issued_or_revoked_on_one_peer_holds_on_every_peer(tmp_path: Path) -> None:
    with group_of(3, state_dir=str(tmp_path / "ps")) as servers:
        files = [TokenFile(tokens_path(str(tmp_path / "ps" / str(i)))) for i in range(3)]
        token, record = files[0].issue("osc", timedelta(days=1))  # `geofed-hpc token issue` beside peer 0
        wait_for(lambda: all(any(r.id == record.id for r in f.read()) for f in files), "the token on every peer")
        far = client(servers[2])  # a site of peer 0 failing over to peer 2 enrolls with the same token
        try:
            assert far.join(m.JoinRequest("osc-0", token=token)).session_id
            with pytest.raises(AuthError, match="Join needs a token"):  # a token file now guards every peer
                far.join(m.JoinRequest("osc-1"))
        finally:
            far.close()
        files[1].revoke(token_id=record.id)  # revoked beside peer 1: refused by peer 0 too
        wait_for(lambda: all(r.revoked for f in files for r in f.read()), "the revocation on every peer")
        near = client(servers[0])
        try:
            with pytest.raises(AuthError, match=f"token {record.id} is revoked"):
                near.join(m.JoinRequest("osc-0", token=token))
        finally:
            near.close()
        files[2].path.write_text("{not json")  # a token file mangled beside peer 2: the others go on sharing
        _, second = files[1].issue("tacc", timedelta(days=1))
        wait_for(lambda: any(r.id == second.id for r in files[0].read()), "the new token on peer 0")
        time.sleep(0.5)  # several sync points with peer 2's file unreadable
        assert files[2].path.read_text() == "{not json"  # left for its owner to mend, never overwritten
        assert all(s.group is not None and s.group.failed is None for s in servers)


def test_async_peers_pool_their_sites_deltas_and_apply_them_together_every_interval() -> None:
    params = small_params()
    with group_of(2, aggregation="async", peer_sync_interval="3s", peer_codec="fp32") as servers:
        clients = [client(s) for s in servers]
        try:
            sessions = join_and_seed(servers, clients, params)
            full = {
                k: codec.encode({k2: np.full_like(v2, x) for k2, v2 in params.items()}, FP32)
                for k, x in (("one", 1.0), ("two", 2.0), ("four", 4.0))
            }
            # peer 0's site alone: applied at the interval, without waiting for peer 1's site (async)
            started = time.monotonic()
            alone = clients[0].push_delta(m.PushHeader(sessions[0], 0, 2, 10, "fp32", 0, b"", "a"), full["one"])
            assert alone.accepted and alone.version == 1 and time.monotonic() - started < 20, alone
            # both sites within one interval, one of them a version stale: pooled into one version
            replies = concurrently(
                clients,
                [
                    (m.PushHeader(sessions[0], 1, 2, 10, "fp32", 0, b"", "b"), full["two"]),
                    (m.PushHeader(sessions[1], 0, 2, 10, "fp32", 0, b"", "c"), full["four"]),
                ],
            )
            assert all(r.accepted and r.version == 2 for r in replies), replies
            assert replies[1].staleness == 1
            wait_for(lambda: all(s.logic.version == 2 for s in servers), "version 2 on both peers")
            assert len({s.logic.core.model_hash() for s in servers}) == 1
            model = servers[1].logic.core.model.params
            assert model is not None
            pooled = (2.0 + 4.0 / np.sqrt(2.0)) / 2  # the mean of both, the stale one discounted by 1/sqrt(1+1)
            for k, v in params.items():
                np.testing.assert_allclose(model[k], v + 1.0 + pooled, rtol=0, atol=1e-5)
        finally:
            for c in clients:
                c.close()


def test_a_peer_of_another_build_is_refused_at_rendezvous_or_at_its_first_sync_point() -> None:
    cfg = group_cfg(peers(2), 0, f"127.0.0.1:{free_pair()}")
    mine = identity(cfg)
    older = {**mine, "geofed_hpc": "0.0.9"}
    with pytest.raises(MismatchError, match=r'peer 1 .* has geofed_hpc "0.0.9", this PS .* has geofed_hpc "'):
        check_identities(cfg.ps, mine, {1: older})
    p = point(digest="a", joiners=[2])
    assert SyncPoint.unpack(p.pack()) == p
    newer = json.dumps({**json.loads(p.pack()), "quorum": 2}).encode()  # a field this build does not know
    with pytest.raises(ProtocolError, match=r"unknown fields \['quorum'\].*same geofed-hpc"):
        SyncPoint.unpack(newer)
