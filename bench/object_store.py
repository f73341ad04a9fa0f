"""Object storage benchmark: a PS snapshot written and read, and a journaled delta, on S3 against local disk.

    python bench/object_store.py --json bench/results/object_store.json          # a 1 GB snapshot
    python bench/object_store.py --mb 64 --json /tmp/object_store.json            # quicker
    python bench/object_store.py --mb 256 --compare --json /tmp/object_store.json # + fsspec/s3fs, when installed

The S3 side is moto's standalone server on 127.0.0.1, started and ended here: it measures the client library's and
the S3 protocol's overhead (HTTP, multipart uploads, checksums, moto's own work), not a real network; on a real
store, add the link's bandwidth and round trips. Each operation is the PS's own code path:

- `snapshot write`: local disk: the snapshot file written (ckpt.save_tensors: write, fsync, rename); s3: that file
  uploaded and the manifest naming it committed (RemoteState.commit);
- `snapshot read`: local disk: the file read back; s3: downloaded into an empty working folder and its SHA-256
  checked against the manifest (RemoteState.pull);
- `snapshot write: s3, under the PS's lock`: what the PS's lock is held for on s3 (the upload runs off it);
- `site checkpoint mirror`: a site checkpoint of the same size mirrored (train.checkpoint_mirror): the upload until
  its manifest is up, what the training thread pays, and a purged site's restore;
- `journal per delta`: one admitted delta of `--delta-kb` made durable before its push is answered
  (RoundJournal.record; on s3 RemoteJournal.record: the same, then payload and header uploaded); seconds per delta.

`--compare` adds the raw operations (a snapshot's upload and download, one small put) through each candidate client
library, obstore (the one the project uses) and fsspec+s3fs (when installed), one after the other on the same
server: how the library was chosen.
Rows: {what, mb, seconds, mb_per_s}; the files are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from geofed_hpc.ckpt import save_tensors  # noqa: E402
from geofed_hpc.ckpt.mirror import CheckpointMirror, restore  # noqa: E402
from geofed_hpc.ckpt.objects import file_chunks, open_store  # noqa: E402
from geofed_hpc.ps.journal import RoundJournal  # noqa: E402
from geofed_hpc.ps.remote import RemoteState  # noqa: E402
from geofed_hpc.rpc import messages as m  # noqa: E402
from geofed_hpc.rpc.stream import digest  # noqa: E402
from geofed_hpc.testing.s3 import client_env, make_bucket, start_server, stop_server  # noqa: E402

NOTE = (
    "S3 side: moto's server on 127.0.0.1 - client library and S3 protocol overhead, not a real network; "
    "local disk: the same operation on this machine's disk, in the same run"
)


def row(what: str, nbytes: int, seconds: float) -> dict[str, Any]:
    mb = nbytes / 1e6
    return {"what": what, "mb": round(mb, 3), "seconds": round(seconds, 6), "mb_per_s": round(mb / seconds, 1)}


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def journal_rows(local: RoundJournal, remote: RoundJournal, work: Path, kb: int, n: int) -> list[dict[str, Any]]:
    payload = os.urandom(kb << 10)
    out = []
    for name, journal in (("local disk", local), ("s3", remote)):
        seconds = 0.0
        for i in range(n):
            staged = work / "staged"
            staged.write_bytes(payload)
            header = m.PushHeader("s", 0, 1, 1, "int8", len(payload), digest(payload), f"{name}-{i}")
            t0 = time.perf_counter()
            journal.record(staged, header, "bench", 0)
            seconds += time.perf_counter() - t0
        out.append(row(f"journal per delta: {name}", len(payload), seconds / n))
    return out


def mirror_rows(url: str, checkpoint: Path) -> list[dict[str, Any]]:
    """A site checkpoint of the snapshot's size mirrored (train.checkpoint_mirror): what the training thread pays
    (the hand-over) and the upload until its manifest is up, a push's record (each sync waits for it), then the
    restore of a purged site."""
    folder = checkpoint.parent / "site"
    folder.mkdir()
    path = folder / "site-000000001.gft"
    os.link(checkpoint, path)
    mirror = CheckpointMirror(url, "bench-0", folder)
    t0 = time.perf_counter()
    handed = timed(lambda: mirror.submit(path))
    mirror.settle(timedelta(hours=1))
    total = time.perf_counter() - t0
    size = path.stat().st_size
    records = [{"push_id": f"p{n}", "base_version": n, "draws": n, "syncs": n} for n in range(20)]
    logged = statistics.median(timed(lambda r=r: mirror.log_push(r)) for r in records)
    purged = checkpoint.parent / "purged"
    back = timed(lambda: restore(mirror, purged, "push.json", "pushes.json"))
    shutil.rmtree(purged, ignore_errors=True)
    return [
        row("site checkpoint mirror: s3 (upload + manifest)", size, total),
        row("site checkpoint mirror: s3, on the training thread", size, handed),
        row("site push record: s3, before each push (median of 20)", len(json.dumps(records[0])), logged),
        row("site checkpoint restore: s3 (download, sha256, push log)", size, back),
    ]


def library_rows(endpoint: str, url: str, snapshot: Path, kb: int, n: int) -> list[dict[str, Any]]:
    """The same raw operations through obstore (this project's client) and fsspec+s3fs, one after the other."""
    import s3fs  # type: ignore[import-not-found]

    fs = s3fs.S3FileSystem(endpoint_url=endpoint)
    store = open_store(url)
    root, size, small = url[len("s3://") :], snapshot.stat().st_size, os.urandom(kb << 10)
    back = snapshot.with_suffix(".back")
    ops: dict[str, dict[str, Callable[[], object]]] = {
        "obstore": {
            "upload": lambda: store.put("lib/obstore", file_chunks(snapshot)),
            "download": lambda: store.get_file("lib/obstore", back),
            "put": lambda: [store.put(f"lib/obstore-round/{i}", small) for i in range(n)],
        },
        "s3fs": {
            "upload": lambda: fs.put_file(str(snapshot), f"{root}/lib/s3fs"),
            "download": lambda: fs.get_file(f"{root}/lib/s3fs", str(back)),
            "put": lambda: [fs.pipe_file(f"{root}/lib/s3fs-round/{i}", small) for i in range(n)],
        },
    }
    rows = []
    for op, what, nbytes, per in (
        ("upload", "snapshot write", size, 1),
        ("download", "snapshot read", size, 1),
        ("put", "small object put", len(small), n),
    ):
        for library, table in ops.items():
            rows.append(row(f"{what}: s3 via {library} ({op})", nbytes, timed(table[op]) / per))
            back.unlink(missing_ok=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=1024, help="snapshot size in MB (default 1024: 1 GB)")
    parser.add_argument("--delta-kb", type=int, default=256, help="bytes of each journaled delta, in KiB")
    parser.add_argument("--deltas", type=int, default=50, help="journaled deltas timed per side")
    parser.add_argument("--compare", action="store_true", help="also time fsspec+s3fs (when installed)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="geofed-bench-store-"))
    server, endpoint = start_server(work / "moto.log")
    try:
        os.environ.update(client_env(endpoint))
        url = make_bucket(endpoint, "geofed-bench") + "/run"
        (work / "vm1").mkdir()
        tensors = {"param/w": np.random.default_rng(0).random((args.mb << 20) // 4, dtype=np.float32)}
        snapshot = work / "vm1" / "global-000000001.gft"
        t0 = time.perf_counter()
        save_tensors(snapshot, tensors, {})
        rows = [row("snapshot write: local disk", args.mb << 20, time.perf_counter() - t0)]
        del tensors
        size = snapshot.stat().st_size
        remote = RemoteState(open_store(url), work / "vm1")
        t0 = time.perf_counter()
        held = timed(lambda: remote.commit(snapshot, 1))  # what the PS's lock waits for: the hand-over
        remote.settle()
        rows.append(row("snapshot write: s3 (upload + manifest)", size, time.perf_counter() - t0))
        rows.append(row("snapshot write: s3, under the PS's lock", size, held))
        rows.append(row("snapshot read: local disk", size, timed(lambda: snapshot.read_bytes())))
        (work / "vm2").mkdir()
        fresh = RemoteState(open_store(url), work / "vm2")
        rows.append(row("snapshot read: s3 (download + sha256 check)", size, timed(fresh.pull)))
        shutil.rmtree(work / "vm2")
        local_journal = RoundJournal(work / "vm1" / "local-round")
        remote_journal = remote.journal(work / "vm1" / "round")
        rows += journal_rows(local_journal, remote_journal, work, args.delta_kb, args.deltas)
        rows += mirror_rows(url, snapshot)
        if args.compare:
            try:
                rows += library_rows(endpoint, url, snapshot, args.delta_kb, args.deltas)
            except ImportError:
                print("--compare: s3fs is not installed (pip install s3fs); its rows are left out")
    finally:
        stop_server(server)
        shutil.rmtree(work, ignore_errors=True)
    result = {"note": NOTE, "snapshot_mb": args.mb, "delta_kb": args.delta_kb, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(NOTE)
    print(f"{'what':<56}{'MB':>10}{'seconds':>12}{'MB/s':>10}")
    for r in rows:
        print(f"{r['what']:<56}{r['mb']:>10}{r['seconds']:>12}{r['mb_per_s']:>10}")


if __name__ == "__main__":
    main()
