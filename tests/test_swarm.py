"""Two hundred simulated sites against a real `ps up`: every site joins with its own token, pushes and pulls, some
leave and rejoin, and the PS applies each acknowledged push exactly once (bench/swarm.py)."""

from __future__ import annotations

import importlib.util
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc import serde
from geofed_hpc.rpc.client import PSClient
from tests.conftest import ps_config

ROOT = Path(__file__).resolve().parent.parent
SITES = 200


def swarm_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("swarm_bench", ROOT / "bench" / "swarm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["swarm_bench"] = module
    spec.loader.exec_module(module)
    return module


def test_two_hundred_sites_join_push_and_pull_and_nothing_is_lost_or_doubled(tmp_path: Path) -> None:
    bench = swarm_bench()
    args = bench.parse_args(
        ["--minutes", "0.25", "--warmup", "3", "--push-rate", "20", "--churn", "0.5", "--procs", "2"]
        + ["--work-dir", str(tmp_path)]
    )
    bench.raise_fd_limit(4 * SITES + 1024)
    row = bench.run_row("single", SITES, 2e4, "int8", args)
    detail = row.pop("_detail")
    assert set(row) == set(bench.KEYS)
    assert detail["ps_alive_at_end"], detail
    assert detail["joined"] == SITES and detail["failed_joins"] == 0, detail
    assert detail["pushed_sites"] == SITES, detail  # every site had a push acknowledged
    assert detail["pull_calls_in_window"] > 0 and detail["churned"] > 0, detail
    assert detail["pushes_acked"] == detail["pushes_applied"] > SITES, detail
    assert row["lost"] == 0 and row["doubled"] == 0, (row, detail)
    assert detail["stuck_threads"] == 0, detail


def test_a_call_grpc_refuses_for_the_calls_in_flight_is_retried_until_one_ends() -> None:
    """A burst beyond the server's maximum_concurrent_rpcs (a thousand sites leaving at once) is refused by gRPC itself,
    before any handler: the site waits it out with backoff, as it does UNAVAILABLE, instead of failing the call."""
    entered, release, calls = threading.Event(), threading.Event(), []

    def heartbeat(request: m.HeartbeatRequest, context: Any) -> m.HeartbeatReply:
        calls.append(request.session_id)
        if len(calls) == 1:  # the first call holds the server's only slot until released
            entered.set()
            release.wait(30)
        return m.HeartbeatReply(version=7)

    meth = next(x for x in serde.METHODS if x.name == "Heartbeat")
    service, name = meth.path.strip("/").rsplit("/", 1)
    handler = grpc.unary_unary_rpc_method_handler(
        heartbeat, serde.deserializer(m.HeartbeatRequest), serde.serializer(m.HeartbeatReply)
    )
    server = grpc.server(ThreadPoolExecutor(4), maximum_concurrent_rpcs=1)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {name: handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    timer = threading.Timer(1.0, release.set)
    try:
        with PSClient(ps_config(), f"127.0.0.1:{port}") as first, PSClient(ps_config(), f"127.0.0.1:{port}") as second:
            holder = threading.Thread(target=first.heartbeat, args=(m.HeartbeatRequest("first"),))
            holder.start()
            assert entered.wait(30)
            timer.start()  # the slot frees a second from now: the second site's call must outlast the refusals
            reply = second.heartbeat(m.HeartbeatRequest("second"))
            holder.join(30)
    finally:
        timer.cancel()
        release.set()
        server.stop(0)
    assert reply.version == 7 and calls == ["first", "second"]
