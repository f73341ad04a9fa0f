"""A site's life for operators: one JSON line per event (first steps, signals, stops, rejoins) in events.jsonl."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class EventLog:
    """Appends to sites/<name>/events.jsonl; every line carries the time, the Slurm job id and restart count."""

    def __init__(self, path: Path, environ: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if environ is None else environ
        self.path = path
        self.job_id = env.get("SLURM_JOB_ID", "")
        self.restarts = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
        self._once: set[str] = set()
        self.preemptions = preemptions(path, self.restarts)  # earlier segments only: read before this one writes

    def __call__(self, event: str, **fields: Any) -> None:
        record = {"time": time.time(), "event": event, "job_id": self.job_id, "restarts": self.restarts, **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def once(self, event: str, **fields: Any) -> None:
        """Record `event` only the first time this process reaches it (the first training step, say)."""
        if event not in self._once:
            self._once.add(event)
            self(event, **fields)


def preemptions(events: Path, slurm_restarts: int) -> int:
    """Earlier segments of this site that ended on a signal (a `stop` event in events.jsonl: preempted, timed
    out, cancelled for requeue); Slurm's restart count when that is higher (a segment killed before it wrote)."""
    stopped, in_segment_stop = 0, False
    try:
        lines = events.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            event = json.loads(line).get("event")
        except (json.JSONDecodeError, AttributeError):
            continue
        if event == "restored":
            stopped += in_segment_stop
            in_segment_stop = False
        elif event == "stop":
            in_segment_stop = True
    stopped += in_segment_stop
    return max(stopped, slurm_restarts)
