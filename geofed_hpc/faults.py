"""Fault injection at named points production code calls (GEOFED_FAULTS="point[label]@N=action,..."); off when unset."""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass

ENV = "GEOFED_FAULTS"
ACTIONS = ("kill", "enospc", "eio", "exit")
# Named points (where the code calls `fault()`):
#   atomic.chunk   ckpt/atomic.py, a chunk of the data was written to the temp file (a writer caught mid-write;
#                  label: the target file name)
#   atomic.write   ckpt/atomic.py, after the data is written to the temp file, before fsync and rename
#                  (label: the target file name, e.g. global-00000003.gft or site-00000002.gft)
#   ps.aggregate   ps/coordinator.py, a round's deltas are summed and the update is about to be applied
#   ps.snapshot    ps/persist.py, right after a snapshot file was written, before the pushes are answered
#   ps.journal     ps/journal.py, a delta of an open round is journaled, before its push is answered
#   ps.stream      ps/servicer.py, a pull (StreamModel) arrived, before anything is sent (label: its min_version)
#   split.snapshot ps/split/store.py, a snapshot of the split server part was written (label: why:n, why being
#                  version, align or stop, n its number)
#   rpc.push       rpc/client.py, a push's first chunk is on the wire and the rest is not
#   store.put      ckpt/objects.py, an object is about to be written to a store (label: its key, e.g.
#                  snapshots/global-000000003.gft, manifest.json, round/<entry>.push)
#   store.chunk    ckpt/objects.py, a part of an object streamed to S3 was handed over, the rest not (label: its key)
#   site.step      client/trainer.py, rank 0 finished a local step (label: the site's lifetime step count)
#                  and client/api.py, Site.step of a user's loop (label: its step count, site.steps)
#   site.ckpt_write client/checkpoints.py, the background writer took a staged checkpoint and is about to write it
#                  while the next interval trains (label: its file name, e.g. site-000000002.gft)
_SPEC = re.compile(r"^(?P<point>[a-z_.]+)(\[(?P<label>[^\]]*)\])?(@(?P<nth>\d+))?=(?P<action>[a-z]+)$")


@dataclass
class Fault:
    """Fire `action` at the `nth` hit of `point` whose label contains `label`."""

    point: str
    action: str
    nth: int = 1
    label: str = ""
    hits: int = 0


def parse(spec: str) -> list[Fault]:
    """`ps.aggregate@2=kill,atomic.write[site]@1=enospc` -> faults; ValueError naming a bad entry."""
    faults = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        match = _SPEC.match(entry)
        if not match or match["action"] not in ACTIONS:
            raise ValueError(f"{ENV}: bad fault {entry!r}; expected point[label]@N=action with action in {ACTIONS}")
        faults.append(Fault(match["point"], match["action"], int(match["nth"] or 1), match["label"] or ""))
    return faults


_PLAN: list[Fault] = parse(os.environ.get(ENV, ""))
_LOCK = threading.Lock()


def install(spec: str) -> None:
    """Replace this process's plan (tests that inject in-process; "" removes every fault)."""
    global _PLAN
    with _LOCK:
        _PLAN = parse(spec)


def fault(point: str, label: str = "") -> None:
    """Called at a named point: does nothing unless a planned fault matches this hit."""
    if not _PLAN:
        return
    with _LOCK:
        due = None
        for f in _PLAN:
            if f.point == point and f.label in label:
                f.hits += 1
                if f.hits == f.nth:
                    due = f
        if due is None:
            return
    print(f"fault injected: {due.action} at {point} [{label}] (hit {due.nth})", file=sys.stderr, flush=True)
    if due.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if due.action == "exit":
        os._exit(70)
    code = errno.ENOSPC if due.action == "enospc" else errno.EIO
    raise OSError(code, f"{os.strerror(code)} (injected at {point})")
