"""Object storage against a real S3-protocol server process: the store layer's bad input, and a PS whose state is
on s3:// killed mid-snapshot or mid-journal, then continued by a new PS with an empty working folder, bit for bit."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geofed_hpc import codec, faults
from geofed_hpc.ckpt.objects import Retry, file_chunks, open_store
from geofed_hpc.config import CodecConfig
from geofed_hpc.errors import AuthError, CheckpointError, ConfigError, StoreError, UnavailableError
from geofed_hpc.ps.tokens import TokenFile
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from tests.conftest import ps_config, small_params
from tests.s3_server import CREDENTIALS, S3Server, free_port, s3_env, s3_server
from tests.test_ps_logic import full, init, joined, make, push

__all__ = ["s3_env", "s3_server"]  # fixtures
REPO = Path(__file__).resolve().parents[1]
FAST = Retry(
    attempts=1, first=timedelta(milliseconds=10), longest=timedelta(milliseconds=50), total=timedelta(seconds=5)
)


@pytest.fixture
def no_faults() -> Any:
    yield
    faults.install("")


@pytest.fixture
def url(s3_env: S3Server, request: pytest.FixtureRequest) -> str:
    """A fresh bucket per test, the state under a prefix of it."""
    tag = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:8]
    bucket = re.sub(r"[^a-z0-9-]+", "-", request.node.originalname.lower())[:40].strip("-") + f"-{tag}"
    return f"{s3_env.make_bucket(bucket)}/run"


def keys(url: str) -> dict[str, int]:
    return open_store(url).listing()


def test_the_store_round_trips_and_bad_input_is_one_line_naming_the_url(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(url)
    big = tmp_path / "big"
    big.write_bytes(os.urandom(9 << 20))  # two parts of an upload
    store.put("a/big", file_chunks(big))
    store.put("a/small", b"x" * 10)
    assert store.listing("a/") == {"a/big": 9 << 20, "a/small": 10}
    assert (
        store.get_file("a/big", tmp_path / "back") == 9 << 20 and (tmp_path / "back").read_bytes() == big.read_bytes()
    )
    store.delete("a/small")
    store.delete("a/small")  # gone already: no error
    with pytest.raises(StoreError, match=rf"^{re.escape(url)}/a/small: no such object$") as missing:
        store.get("a/small")
    assert missing.value.missing

    with pytest.raises(StoreError) as bucket:
        open_store("s3://no-such-bucket-here/run").put("k", b"x")
    assert str(bucket.value) == (
        "cannot write s3://no-such-bucket-here/run/k: the bucket no-such-bucket-here does not exist: create it "
        "(aws s3 mb s3://no-such-bucket-here) or fix the URL"
    )
    with pytest.raises(StoreError, match=r"^cannot list s3://no-such-bucket-here/run/: the bucket no-such-bucket-"):
        open_store("s3://no-such-bucket-here/run").listing()
    nobody = f"http://127.0.0.1:{free_port()}"  # a network error: nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", nobody)
    with pytest.raises(StoreError, match=rf"^cannot write {re.escape(url)}/k: .*check the endpoint") as down:
        open_store(url, FAST).put("k", b"x")
    assert "\n" not in str(down.value) and CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in str(down.value)
    for key in CREDENTIALS:
        monkeypatch.delenv(key)
    with pytest.raises(StoreError, match=rf"^{re.escape(url)}: no AWS credentials found: set AWS_ACCESS_KEY_ID"):
        open_store(url)
    monkeypatch.setitem(sys.modules, "obstore", None)  # the s3 extra is not installed
    with pytest.raises(
        ConfigError, match=r"^ps.state_dir: s3://\S+ needs the s3 extra: pip install 'geofed-hpc\[s3\]'$"
    ):
        open_store(url, setting="ps.state_dir")


def test_a_new_machine_continues_from_the_store_bit_for_bit(url: str, tmp_path: Path) -> None:
    kw = dict(snapshot_every=3, state_dir=url, state_cache=str(tmp_path / "vm1"))
    logic = make("async", **kw)
    (a,) = joined(logic, 1)
    params = init(logic, a)
    for i in range(5):
        push(logic, a, i, full(params, 0.1 * (i + 1)), push_id=f"s{i}")
    logic.core.persistence.settle()  # snapshots are uploaded off the PS's lock: the uploads are done
    manifest = json.loads(open_store(url).get("manifest.json"))
    assert [row["version"] for row in manifest["snapshots"]] == [3, 0]  # newest first, the two kept
    assert {k for k in keys(url) if k.startswith("snapshots/")} == {r["key"] for r in manifest["snapshots"]}
    assert len([k for k in keys(url) if k.startswith("round/") and k.endswith(".json")]) == 2  # versions 3 and 4
    # the machine is gone (no finish): a new one with an empty working folder takes over from the store
    restarted = make("async", **{**kw, "state_cache": str(tmp_path / "vm2")})
    assert restarted.version == 5 and restarted.model_hash() == logic.model_hash()
    (b,) = joined(restarted, 1)
    assert push(restarted, b, 4, full(params, 0.5), push_id="s4").duplicate  # applied once
    for i in (5, 6):
        push(restarted, b, i, full(params, 0.1 * (i + 1)), push_id=f"s{i}")  # a snapshot at 6, version 6 journaled
    restarted.core.persistence.settle()
    # the first machine comes back with its stale folder: the store wins, what it held alone is set aside
    again = make("async", **kw)
    assert again.version == 7 and again.model_hash() == restarted.model_hash()
    aside = {p.name for p in (tmp_path / "vm1" / "set-aside").iterdir()}
    assert "global-000000000.gft" in aside and len([n for n in aside if n.endswith(".json")]) == 2  # rounds 3, 4
    again.finish()


def test_token_records_issued_on_the_vm_reach_the_store_and_the_next_machine(url: str, tmp_path: Path) -> None:
    logic = make("async", state_dir=url, state_cache=str(tmp_path / "vm1"))
    token, _ = TokenFile(tmp_path / "vm1" / "tokens.json").issue("osc", timedelta(0))  # `token issue` on the VM
    logic.tick()  # the running PS uploads the records
    assert {"tokens.json", "auth.json"} <= set(keys(url))
    logic.finish()
    fresh = make("async", state_dir=url, state_cache=str(tmp_path / "vm2"))
    with pytest.raises(AuthError):
        fresh.join(m.JoinRequest("osc"))
    assert fresh.join(m.JoinRequest("osc", token)).session_id
    fresh.finish()


def test_a_push_whose_journal_put_fails_is_refused_and_applied_once_when_resent(
    url: str, tmp_path: Path, no_faults: Any
) -> None:
    kw = dict(state_dir=url, state_cache=str(tmp_path / "vm1"))
    logic = make("sync", **kw)
    a, b = joined(logic, 2)
    params = init(logic, a)
    faults.install("store.put[round/]@2=eio")  # the header of A's journal entry: the store refuses it
    with pytest.raises(UnavailableError, match="could not make the push durable"):
        push(logic, a, 0, full(params, 1.0), push_id="A")
    faults.install("")
    assert not [k for k in keys(url) if k.startswith("round/")]  # nothing half-written there, nothing local either
    assert not list((tmp_path / "vm1" / "round").glob("*.json"))
    assert push(logic, a, 0, full(params, 1.0), push_id="A").accepted  # the site's retry
    restarted = make("sync", **{**kw, "state_cache": str(tmp_path / "vm2")})
    assert restarted.rounds.count == 1  # A, once
    (c,) = joined(restarted, 1)
    assert push(restarted, c, 0, full(params, 1.0), push_id="A").duplicate
    restarted.finish()  # applies the open round: A's delta, once
    assert restarted.version == 1 and restarted.core.model.params is not None
    assert restarted.core.model.params["ln.bias"].tolist() == (params["ln.bias"] + 1.0).tolist()


def test_a_truncated_snapshot_or_one_of_another_run_is_refused_in_one_line(url: str, tmp_path: Path) -> None:
    logic = make("async", state_dir=url, state_cache=str(tmp_path / "vm1"))
    (a,) = joined(logic, 1)
    params = init(logic, a)
    push(logic, a, 0, full(params, 1.0), push_id="p0")
    logic.finish()
    store = open_store(url)
    manifest = json.loads(store.get("manifest.json"))
    newest, older = (row["key"] for row in manifest["snapshots"])
    store.put(newest, store.get(newest)[:-100])  # truncated: the older snapshot loads
    again = make("async", state_dir=url, state_cache=str(tmp_path / "vm2"))
    assert again.version == 0 and again.model_hash() != logic.model_hash()
    store.put(older, store.get(newest))  # none intact: the PS does not start
    with pytest.raises(CheckpointError) as bad:
        make("async", state_dir=url, state_cache=str(tmp_path / "vm3"))
    assert str(bad.value).startswith(f"{url}/manifest.json names 2 snapshot(s) and none is intact ({url}/{newest}")
    assert str(bad.value).endswith("restore them from a copy, or point ps.state_dir at a new URL to start afresh")
    other = url.replace("/run", "/copy")
    open_store(other).put("manifest.json", store.get("manifest.json"))  # another run's state, copied here
    with pytest.raises(CheckpointError, match=rf"^{re.escape(other)}/manifest.json was written for the state of"):
        make("async", state_dir=other, state_cache=str(tmp_path / "vm4"))


CHILD = """
import sys
import numpy as np
from geofed_hpc.ps.servicer import ParameterServerLogic
from geofed_hpc.rpc import messages as m
from tests.conftest import ps_config
from tests.test_ps_logic import push

url, cache, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = ps_config(aggregation="async", state_dir=url, state_cache=cache, downlink_history=0)
logic = ParameterServerLogic(cfg, m.RunSettings(aggregation="async", codec="fp32"))
sid = logic.join(m.JoinRequest("writer")).session_id
push(logic, sid, 0, {"w": np.zeros(n, np.float32)}, init=True, push_id="init")
for _ in range(400):  # pushes go on while snapshots upload in the background, until the fault kills the PS
    reply = push(logic, sid, logic.version, {"w": np.ones(n, np.float32)}, push_id=f"v{logic.version}")
    print("acked", reply.version, flush=True)
"""


def _kill_points(seed: int = 49) -> list[tuple[str, int]]:
    """Faults that kill the PS at points drawn with a fixed seed (the test ids name them): mid-upload of a snapshot
    (on the upload thread, off the lock; the seed's snapshot, uploaded before the init is answered, is hits 1-3 of
    a 16 MiB model), between a snapshot's upload and its manifest, and mid-journal (a payload or a header)."""
    rng = random.Random(seed)
    return [
        *((f"store.chunk[snapshots/]@{rng.randint(4, 12)}=kill", 1 << 22) for _ in range(2)),
        *((f"store.put[manifest.json]@{rng.randint(2, 6)}=kill", 1 << 10) for _ in range(2)),
        *((f"store.put[round/]@{rng.randint(1, 40)}=kill", 1 << 10) for _ in range(2)),
    ]


@pytest.mark.parametrize(("fault", "n"), _kill_points())
def test_a_ps_killed_at_a_random_point_is_continued_elsewhere_bit_for_bit_nothing_lost_or_doubled(
    s3_env: S3Server, url: str, tmp_path: Path, fault: str, n: int
) -> None:
    env = {**os.environ, **s3_env.env(), "GEOFED_FAULTS": fault}
    argv = [sys.executable, "-c", CHILD, url, str(tmp_path / "vm1"), str(n)]
    child = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    assert f"fault injected: kill at {fault.split('[')[0]}" in child.stderr
    acked = int(([0] + re.findall(r"^acked (\d+)$", child.stdout, re.M))[-1])
    listing = keys(url)
    manifest = json.loads(open_store(url).get("manifest.json"))
    assert {k for k in listing if k.startswith("snapshots/")} >= {r["key"] for r in manifest["snapshots"]}
    assert all(listing[r["key"]] == r["bytes"] for r in manifest["snapshots"])  # nothing half-written visible
    restored = make("async", state_dir=url, state_cache=str(tmp_path / "vm2"), downlink_history=0)
    # every answered push is in, once; the one the kill interrupted was never answered (or its answer never
    # printed): in the model when it was journaled (its resend is then a duplicate), absent when not (applied)
    assert restored.version in (acked, acked + 1)
    assert restored.core.model.params is not None
    np.testing.assert_array_equal(restored.core.model.params["w"], np.full(n, restored.version, np.float32))
    durable = restored.version == acked + 1
    (sid,) = joined(restored, 1)
    reply = push(restored, sid, acked, {"w": np.ones(n, np.float32)}, push_id=f"v{acked}")
    assert reply.duplicate == durable and restored.version == acked + 1
    np.testing.assert_array_equal(restored.core.model.params["w"], np.full(n, acked + 1, np.float32))
    restored.core.persistence.settle()  # its own uploads (off the lock) and the removals after them are done
    assert not [
        k for k in keys(url) if k.startswith("round/") and k.endswith(".push") and k[:-5] + ".json" not in keys(url)
    ]
    restored.finish()


@pytest.mark.parametrize("fault", ["store.put[manifest.json]@3=kill", "store.put[round/]@7=kill"])
def test_ps_up_on_a_url_fails_over_to_a_new_machine_over_grpc(
    s3_env: S3Server, url: str, tmp_path: Path, fault: str
) -> None:
    """Two real `geofed-hpc ps up` processes on the same URL with their own working folders: the first is killed
    between a snapshot's upload and its manifest (on its upload thread, while pushes go on), or mid-journal; a
    site over gRPC finds the second at the same versions and model, bit for bit, nothing lost or applied twice."""

    def ps_up(cache: str, faults_spec: str = "") -> tuple[subprocess.Popen[str], str]:
        env = {**os.environ, **s3_env.env(), "GEOFED_FAULTS": faults_spec}
        argv = [sys.executable, "-m", "geofed_hpc.cli", "ps", "up", "ps.port=0", f"ps.state_dir={url}"]
        argv += [f"ps.state_cache={tmp_path / cache}", "codec=fp32", "ps.aggregation=async"]
        proc = subprocess.Popen(
            argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for _ in range(50):
            line = proc.stdout.readline()
            port = re.search(r"^parameter server on [^ ]+:(\d+) \((.*)\)", line)
            if port or not line:
                break
        assert port, line
        return proc, port[1]

    params = small_params()
    ones = codec.encode({k: np.ones_like(v) for k, v in params.items()}, CodecConfig("fp32"))
    first, port = ps_up("vm1", fault)
    acked = 0
    try:
        with PSClient(ps_config(retry_budget="2s"), f"127.0.0.1:{port}") as client:
            a = client.join(m.JoinRequest("site-a")).session_id
            client.push_delta(
                m.PushHeader(a, 0, 0, 0, "fp32", 0, b"", "", init=True), codec.encode(params, CodecConfig("fp32"))
            )
            with pytest.raises(UnavailableError):  # pushes go on until the PS dies before it answers one
                for _ in range(200):
                    header = m.PushHeader(a, acked, 1, 8, "fp32", 0, b"", f"p{acked}")
                    assert client.push_delta(header, ones).version == acked + 1
                    acked += 1
        assert first.wait(timeout=30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    second, port = ps_up("vm2")
    try:
        with PSClient(ps_config(retry_budget="2s"), f"127.0.0.1:{port}") as client:
            b = client.join(m.JoinRequest("site-a")).session_id
            # the push the kill left unanswered, sent again: a duplicate when it was journaled, else applied now
            resent = client.push_delta(m.PushHeader(b, acked, 1, 8, "fp32", 0, b"", f"p{acked}"), ones)
            assert resent.version == acked + 1 and (resent.duplicate or resent.accepted)
            header, model = client.pull_model(b)
            assert header.version == acked + 1
            got = codec.decode(model)
            want = {k: v.copy() for k, v in params.items()}
            for _ in range(acked + 1):
                want = {k: v + 1 for k, v in want.items()}  # each update applied once, in the same float order
            assert all(got[k].tobytes() == want[k].tobytes() for k in params)
    finally:
        second.send_signal(signal.SIGTERM)
        out, _ = second.communicate(timeout=60)
    assert second.returncode == 0, out
    assert f"snapshot of version {acked + 1} in {url}" in out
