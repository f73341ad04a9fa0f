"""The spool path: a site's calls as files in a shared folder, moved to a real `ps up` over TLS by `geofed-hpc relay
--spool` as its own process. A site through the spool and a site dialling directly train to the same versions; a relay
killed after the PS applied a push but before its answer was written loses and doubles nothing; a truncated or altered
request is set aside with one line and never applied; a spool others may write, or one the relay cannot write in, is
one line naming the folder."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from geofed_hpc import codec, faults
from geofed_hpc.config import PSConfig
from geofed_hpc.egress import spoolfile
from geofed_hpc.egress.spool import SpoolClient
from geofed_hpc.egress.spoolfile import REQUEST, Spool
from geofed_hpc.errors import ConfigError, UnavailableError
from geofed_hpc.metrics import read_jsonl
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc import serde
from geofed_hpc.rpc.client import PSClient
from geofed_hpc.rpc.guard import bearer
from geofed_hpc.rpc.stream import digest, to_chunks
from tests.conftest import ps_config, small_params
from tests.dist_util import free_port
from tests.site_procs import wait_for
from tests.test_ps_edge import FP32, EdgePS
from tests.test_tls import ps_init

REPO = Path(__file__).resolve().parents[1]
POLL = timedelta(milliseconds=50)


class SpoolRelayProc:
    """`geofed-hpc relay --spool` as its own process; its output collected line by line."""

    def __init__(self, ps: EdgePS, spool: Path, *args: str, faults: str = "") -> None:
        self.lines: list[str] = []
        env = {**os.environ, "GEOFED_FAULTS": faults} if faults else None
        argv = [sys.executable, "-m", "geofed_hpc.cli", "relay", "-v", "--spool", str(spool), "--poll", "50ms"]
        argv += ["--to", f"127.0.0.1:{ps.port}", "ps.insecure=false", f"ps.ca_file={ps.where / 'pki' / 'ca.crt'}"]
        self.proc = subprocess.Popen(
            [*argv, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def started(self) -> SpoolRelayProc:
        wait_for(
            lambda: any(ln.startswith("relay on spool") for ln in self.lines) or self.proc.poll() is not None,
            60,
            "relay",
        )
        assert self.proc.poll() is None, "".join(self.lines)
        return self

    def text(self) -> str:
        return "".join(self.lines)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout=60)


def spool_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "spool"
    folder.mkdir(mode=0o700)
    return folder


def spool_client(ps: EdgePS, folder: Path, **overrides: str) -> SpoolClient:
    return SpoolClient(ps.config(**{"retry_budget": "30s", **overrides}), folder, POLL)


def delta(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return codec.encode(
        {k: (rng.standard_normal(v.shape) * 1e-3).astype(v.dtype) for k, v in small_params().items()}, FP32
    )


def sync(client: PSClient, session: str, seed: int) -> tuple[m.PushReply, int, str]:
    """One sync as a site makes it: the version now, push a delta on it, pull the model at the version it made:
    (the push's reply, the version pulled, the pulled model's sha256)."""
    base = client.heartbeat(m.HeartbeatRequest(session)).version
    header = m.PushHeader(session, base, 1, 1, "fp32", 0, b"", uuid.uuid4().hex)
    reply = client.push_delta(header, delta(seed))
    got, model = client.pull_model(session, min_version=reply.version, wait=timedelta(seconds=10))
    return reply, got.version, hashlib.sha256(model).hexdigest()


def pushes(ps: EdgePS, site: str) -> int:
    return next(s.pushes for s in ps.status().sites if s.site == site)


def test_a_site_through_the_spool_trains_to_the_same_versions_as_a_direct_one(tls_ps: EdgePS, tmp_path: Path) -> None:
    folder = spool_dir(tmp_path)
    relay = SpoolRelayProc(tls_ps, folder).started()
    try:
        with tls_ps.client(retry_budget="30s") as direct, spool_client(tls_ps, folder) as spooled:
            spooled.connect(timedelta(seconds=30))
            assert spooled.health() == "SERVING"
            one = tls_ps.joined(direct, "osc-11").session_id
            two = tls_ps.joined(spooled, "tacc-11").session_id
            start = tls_ps.status().version
            seen: list[tuple[str, int, int, str]] = []
            for r in range(3):  # the two sites take turns, as an async federation's sites do
                for name, client, session in (("direct", direct, one), ("spool", spooled, two)):
                    reply, version, model = sync(client, session, seed=10 * r + len(seen))
                    assert reply.accepted and not reply.duplicate, reply
                    seen.append((name, reply.version, version, model))
            # every push made exactly the next version, through either path, and each pulled that version
            assert [s[1] for s in seen] == list(range(start + 1, start + 7))
            assert all(pushed == pulled for _, pushed, pulled, _ in seen)
            # the model the spool site pulled is the one a direct pull gets at that version (byte for byte)
            _, last = direct.pull_model(one, min_version=start + 6)
            assert hashlib.sha256(last).hexdigest() == seen[-1][3]
            assert pushes(tls_ps, "tacc-11") == 3 and pushes(tls_ps, "osc-11") == 3
            status = spooled.status(tls_ps.admin)
            assert status.version == start + 6
            spooled.heartbeat(m.HeartbeatRequest(two, status.version, leaving=True))
        assert not list(folder.glob("out/*")) and not list(folder.glob("in/*")) and not list(folder.glob("relay/*"))
        mode = os.stat(folder / "out").st_mode & 0o777
        assert mode == 0o700
    finally:
        assert relay.stop() == 0
    assert "Traceback" not in relay.text()
    assert "relay: PushDelta" in relay.text() and "OK" in relay.text()


def test_a_relay_killed_after_the_ps_applied_a_push_loses_and_doubles_nothing(tls_ps: EdgePS, tmp_path: Path) -> None:
    folder = spool_dir(tmp_path)
    relay = SpoolRelayProc(tls_ps, folder).started()
    with spool_client(tls_ps, folder, rpc_timeout="90s") as client:
        try:
            client.connect(timedelta(seconds=30))
            session = tls_ps.joined(client, "tacc-12").session_id
            before = client.heartbeat(m.HeartbeatRequest(session)).version
        finally:
            assert relay.stop() == 0
        # this relay dies as it writes its first answer: the PS has applied the push, the site has no answer
        killed = SpoolRelayProc(tls_ps, folder, faults="atomic.write[.ans]@1=kill").started()
        header = m.PushHeader(session, before, 1, 1, "fp32", 0, b"", uuid.uuid4().hex)
        result: list[m.PushReply] = []
        pushing = threading.Thread(target=lambda: result.append(client.push_delta(header, delta(1))))
        pushing.start()
        assert killed.proc.wait(timeout=60) == -9
        assert tls_ps.status().version == before + 1  # applied once ...
        taken = list(folder.glob("relay/*"))
        assert taken and not list(folder.glob("in/*.ans"))
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in taken)  # it carries the site's token
        again = SpoolRelayProc(tls_ps, folder).started()  # ... and the next relay sends what was taken once more
        try:
            pushing.join(timeout=90)
            assert result, "the push never got its answer"
            assert result[0].version == before + 1 and result[0].duplicate, result[0]
            assert tls_ps.status().version == before + 1 and pushes(tls_ps, "tacc-12") == 1
            reply, version, _ = sync(client, session, seed=2)  # and the site syncs on as before
            assert reply.accepted and version == before + 2
        finally:
            assert again.stop() == 0
    assert "sending it again" in again.text(), again.text()


def push_request(tls_ps: EdgePS, folder: Path, session: str, base: int) -> Path:
    """A whole push request, as a site writes it, in the spool's out folder."""
    payload = delta(3)
    header = m.PushHeader(session, base, 1, 1, "fp32", len(payload), digest(payload), uuid.uuid4().hex)
    frames = [serde.serializer(m.Chunk)(c) for c in to_chunks(header, payload, 4096)]
    ident = spoolfile.new_id()
    path = Spool(folder).prepare("site.spool").out / f"{ident}{REQUEST}"
    envelope = {"id": ident, "method": "PushDelta", "deadline": time.time() + 300, "metadata": list(bearer(session))}
    spoolfile.write(path, envelope, frames)
    return path


@pytest.mark.parametrize("damage", ["truncated", "altered"])
def test_a_damaged_request_is_set_aside_with_one_line_and_never_applied(
    tls_ps: EdgePS, tmp_path: Path, damage: str
) -> None:
    folder = spool_dir(tmp_path)
    with tls_ps.client() as direct:
        session = tls_ps.joined(direct, "osc-13").session_id
        before = direct.heartbeat(m.HeartbeatRequest(session)).version
    path = push_request(tls_ps, folder, session, before)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]  # as a copy cut short would leave it
    else:
        data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    relay = SpoolRelayProc(tls_ps, folder, "--once")
    assert relay.proc.wait(timeout=90) == 0, relay.text()
    said = [ln for ln in relay.lines if path.name in ln and "set aside" in ln]
    expected = "is truncated" if damage == "truncated" else "fails its checksum"
    assert len(said) == 1 and expected in said[0] and "quarantine" in said[0], relay.text()
    assert (folder / "quarantine" / path.name).read_bytes() == bytes(data)  # kept for the operator, as it was
    answer = spoolfile.SpoolFile(folder / "in" / f"{path.stem}.ans", 1 << 20)
    assert answer.envelope["code"] == "UNAVAILABLE"  # the site is told at once, and sends it again
    answer.close()
    assert tls_ps.status().version == before and pushes(tls_ps, "osc-13") == 0
    assert "Traceback" not in relay.text()


def test_a_spool_others_may_write_is_refused_naming_the_folder(tls_ps: EdgePS, tmp_path: Path) -> None:
    folder = spool_dir(tmp_path)
    (folder / "out").mkdir()
    os.chmod(folder / "out", 0o777)
    with pytest.raises(ConfigError, match=r"site.spool: .*/spool/out is writable by other users \(mode 777\)"):
        spool_client(tls_ps, folder)
    relay = SpoolRelayProc(tls_ps, folder)
    assert relay.proc.wait(timeout=60) == 2
    assert "is writable by other users" in relay.text() and str(folder / "out") in relay.text()


def test_a_full_spool_is_one_line_naming_it_and_the_site_gets_its_answer_later(tls_ps: EdgePS, tmp_path: Path) -> None:
    folder = spool_dir(tmp_path)
    # the answers' folder is full for the relay's first three answers: the site asks again and gets the fourth
    relay = SpoolRelayProc(tls_ps, folder, faults="atomic.write[.ans]@1=enospc").started()
    try:
        with spool_client(tls_ps, folder, rpc_timeout="3s") as client:
            client.connect(timedelta(seconds=30))
            status = client.status(tls_ps.admin)
            faults.install("atomic.write[.req]@1=enospc")  # and the site's side is full for one request
            try:
                with pytest.raises(UnavailableError, match=f"cannot write a request into {folder / 'out'}: the disk"):
                    client._call("Status", lambda: client._calls["Status"](m.StatusRequest()), timedelta(0))
            finally:
                faults.install("")
            assert client.status(tls_ps.admin).version == status.version  # and the next call goes through
        assert status.version >= 1
    finally:
        assert relay.stop() == 0
    full = [ln for ln in relay.lines if "cannot write answers into" in ln]
    assert len(full) == 1 and str(folder / "in") in full[0] and "full" in full[0], relay.text()
    assert not list(folder.glob("in/*.ans")) and not list(folder.glob("out/*.req"))


def test_without_a_relay_the_site_is_told_what_to_start_and_leaves_no_request(tmp_path: Path) -> None:
    folder = spool_dir(tmp_path)
    with SpoolClient(PSConfig(insecure=False, ca_file=str(tmp_path / "ca.crt")), folder, POLL) as client:
        with pytest.raises(UnavailableError) as info:
            client.connect(timedelta(seconds=1))
    assert "no relay took the request" in str(info.value)
    assert f"geofed-hpc relay --spool {folder} --to PS_HOST:PORT" in str(info.value)
    assert not list(folder.glob("out/*"))  # given up on: gone, never sent later


TINY = [
    "model=tiny", "model.d_model=8", "model.n_heads=2", "model.n_layers=1", "model.d_ff=32", "model.context=32",
]  # fmt: skip
CLI = [sys.executable, "-m", "geofed_hpc.cli"]
QUIET = {**os.environ, "WANDB_MODE": "disabled", "GRPC_VERBOSITY": "ERROR", "PYTHONUNBUFFERED": "1"}


def test_launch_trains_one_site_through_the_spool_beside_a_direct_one(tmp_path: Path) -> None:
    """Two `launch`ed sites of one federation, one with site.egress=[spool], over a real `ps up` with TLS."""
    pki, folder, port = tmp_path / "pki", spool_dir(tmp_path), free_port()
    assert ps_init(pki) == 0
    tls = ["ps.insecure=false", f"ps.ca_file={pki / 'ca.crt'}"]
    common = [*TINY, "codec=int8", "wandb_mode=disabled", *tls]
    ps_argv = [*CLI, "ps", "up", *common, "ps.host=127.0.0.1", f"ps.port={port}", "ps.aggregation=async"]
    ps_argv += [
        f"ps.cert_file={pki / 'server.crt'}",
        f"ps.key_file={pki / 'server.key'}",
        f"ps.state_dir={tmp_path}/ps",
    ]
    ps_log, relay_log = (tmp_path / "ps.log").open("w"), (tmp_path / "relay.log").open("w")
    ps = subprocess.Popen(ps_argv, cwd=tmp_path, stdout=ps_log, stderr=subprocess.STDOUT, env=QUIET)
    relay_argv = [*CLI, "relay", "-v", "--spool", str(folder), "--poll", "50ms", "--to", f"127.0.0.1:{port}", *tls]
    relay = subprocess.Popen(relay_argv, cwd=tmp_path, stdout=relay_log, stderr=subprocess.STDOUT, env=QUIET)
    sites: dict[str, subprocess.Popen[bytes]] = {}
    try:
        wait_for(lambda: "parameter server on" in (tmp_path / "ps.log").read_text() or ps.poll() is not None, 60, "ps")
        train = ["train.sync_interval=2s", "train.max_syncs=2", "train.batch_size=4", "data.max_tokens=20000"]
        train += ["data.val_batches=1", f"data.cache_dir={tmp_path / 'cache'}", "federation=spool"]
        paths = {"direct": ["site.egress=[direct]"], "spooled": ["site.egress=[spool]", f"site.spool={folder}"]}
        for shard, (name, egress) in enumerate(paths.items()):
            argv = [*CLI, "launch", "site=local", f"site.name={name}", "site.num_sites=1", "site.embedded_ps=false"]
            argv += [f"site.first_shard={shard}", "site.shard_count=2", f"ps.address=127.0.0.1:{port}"]
            argv += [*common, *train, *egress, "site.spool_poll=100ms", f"run_dir={tmp_path / name}"]
            with (tmp_path / f"{name}.log").open("w") as log:
                sites[name] = subprocess.Popen(argv, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=QUIET)
        codes = {name: proc.wait(timeout=150) for name, proc in sites.items()}
        logs = "".join((tmp_path / f"{n}.log").read_text()[-2000:] for n in sites)
        assert codes == {"direct": 0, "spooled": 0}, logs
        with PSClient(ps_config(insecure=False, ca_file=str(pki / "ca.crt")), f"127.0.0.1:{port}") as client:
            status = client.status()
    finally:
        for proc in [*sites.values(), relay, ps]:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
        ps_log.close()
        relay_log.close()
    finals = {}
    for name in sites:
        records = read_jsonl(tmp_path / name / "metrics" / f"{name}-0.metrics.jsonl")
        syncs = [r for r in records if "train/loss" in r]
        assert len(syncs) == 2, records
        finals[name] = syncs[-1]["sync/version"]
        chosen = json.loads((tmp_path / name / "sites" / f"{name}-0" / "egress.json").read_text())
        assert chosen["path"] == {"direct": "direct", "spooled": "spool"}[name]
    pushes = {s.site: s.pushes for s in status.sites}
    assert pushes == {"direct-0": 2, "spooled-0": 2}, pushes  # every push applied once, through either path
    assert status.version == 4 and max(finals.values()) == 4, (status.version, finals)
    text = (tmp_path / "relay.log").read_text()
    assert text.count("relay: PushDelta") >= 2 and "Traceback" not in text, text


def test_a_spool_the_relay_cannot_write_in_stops_it_with_one_line_naming_the_folder(
    tls_ps: EdgePS, tmp_path: Path
) -> None:
    folder = spool_dir(tmp_path)
    relay = SpoolRelayProc(tls_ps, folder, faults="atomic.write[.probe-]@1=enospc")  # out/ is full at its start
    assert relay.proc.wait(timeout=60) == 2
    said = [ln for ln in relay.lines if ln.startswith("geofed-hpc: error:")]
    assert said == [f"geofed-hpc: error: --spool: cannot write in {folder / 'out'}: the disk is full\n"], relay.text()
