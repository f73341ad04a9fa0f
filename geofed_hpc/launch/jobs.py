"""What `status`, `cancel` and `logs` show about launched site jobs: a jobs table and their log files."""

from __future__ import annotations

import pickle
import re
import sys
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TextIO

from geofed_hpc.launch.manifest import JobRecord
from geofed_hpc.launch.slurm import JobState, job_states
from geofed_hpc.log import hide_passwords

FOLLOW_POLL = timedelta(seconds=0.5)
FOLLOW_STATE_EVERY = timedelta(seconds=5)


# The last line of a job's log that says why it failed: a Python exception (its module path dropped), a fatal
# error of the interpreter, or Slurm's own verdict (time limit, out of memory, node failure).
_CAUSE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*(?P<exc>[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failure)(?::\s.*)?)$"
    r"|^(?P<fatal>Fatal Python error: .*)$"
    r"|^slurmstepd: error: (?P<slurm>.*)$"
)


_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


def error_cause(text: str) -> str | None:
    """Why a job failed, from its log or submitit's report, in one line (`AuthError: ...`), else None: Slurm's own
    verdict when it gave one last; else the first exception of the last traceback, whose chained followers (an
    error while cleaning up after it) are consequences, not the cause."""
    lines = [line.strip() for line in text.splitlines()]
    start, previous = 0, ""
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)") and not previous.startswith(_CHAINED):
            start = i  # a new failure, not one chained to the traceback before it
        if line:
            previous = line
    matches = [m for m in map(_CAUSE.match, lines) if m]
    if matches and matches[-1]["slurm"]:
        return matches[-1]["slurm"].strip(" *")
    for match in (m for m in map(_CAUSE.match, lines[start:]) if m):
        return next(g for g in match.groups() if g).strip(" *")
    return None


def local_state(job: JobRecord) -> JobState:
    """A local site job (submitit's LocalExecutor; its id is its controller's pid): RUNNING while that process runs,
    else COMPLETED or FAILED as its result file says (UNKNOWN without one: it was killed)."""
    try:
        alive = "submitit" in Path(f"/proc/{int(job.job_id)}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError):
        alive = False
    if alive:
        return JobState(job.job_id, "RUNNING", "local")
    result = Path(job.stdout).parent / f"{job.job_id}_0_result.pkl"
    try:
        with open(result, "rb") as f:
            outcome = pickle.load(f)[0]  # our own job's file: ("success" | "error", ...)
    except (OSError, pickle.UnpicklingError, EOFError, IndexError, TypeError):
        return JobState(job.job_id, "UNKNOWN", "none", "ended without a result (killed?)")
    return JobState(job.job_id, "COMPLETED" if outcome == "success" else "FAILED", "local")


def states_of(jobs: Mapping[str, JobRecord]) -> dict[str, JobState]:
    """Each job's state: Slurm's for Slurm jobs, the process's for local ones."""
    local = {j.job_id: local_state(j) for j in jobs.values() if j.executor == "local"}
    return {**job_states([j.job_id for j in jobs.values() if j.executor != "local"]), **local}


def jobs_table(jobs: Mapping[str, JobRecord], states: Mapping[str, JobState]) -> str:
    """One line per site job: name, id, state (transient states say so), elapsed, where the state came from; a job
    that failed gets a line with its cause, from the end of its log."""
    lines = [f"{'site job':<20}{'job id':>10}  {'elapsed':>10}  {'from':<8}  state"]
    for name, job in jobs.items():
        st = states.get(job.job_id) or JobState(job.job_id, "UNKNOWN", "none")
        lines.append(f"{name:<20}{job.job_id:>10}  {st.elapsed or '-':>10}  {st.source:<8}  {st.describe()}")
        if st.failed:
            cause = error_cause(tail(Path(job.stderr), 400)) or "the log names no error"
            lines.append(f"{'':<20}{'':>10}  cause: {cause} (log: {job.stderr})")
    return "\n".join(lines)


def tail(path: Path, lines: int) -> str:
    """The last `lines` lines of a log file ('' when it does not exist yet)."""
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def log_paths(jobs: Mapping[str, JobRecord]) -> list[tuple[str, Path]]:
    """(label, path) of every job's stdout and stderr (a requeued job appends to the same files)."""
    return [
        (f"{name} job {job.job_id} {kind}", Path(path))
        for name, job in jobs.items()
        for kind, path in (("stdout", job.stdout), ("stderr", job.stderr))
    ]


def print_logs(jobs: Mapping[str, JobRecord], lines: int = 40, out: TextIO = sys.stdout) -> None:
    for label, path in log_paths(jobs):
        text = tail(path, lines)
        print(f"==> {label}: {path} <==", file=out)
        print(hide_passwords(text) if text else "(empty so far)", file=out, flush=True)


def follow_logs(
    jobs: Mapping[str, JobRecord],
    out: TextIO = sys.stdout,
    states: Callable[[Mapping[str, JobRecord]], Mapping[str, JobState]] = states_of,
) -> None:
    """Print what the logs gain, like `tail -f`, until every job has ended (or Ctrl-C)."""
    offsets = {path: path.stat().st_size if path.exists() else 0 for _, path in log_paths(jobs)}
    ids = [job.job_id for job in jobs.values()]
    last_label = ""
    next_check = 0.0
    try:
        while True:
            ended = False
            if time.monotonic() >= next_check:
                now = states(jobs)
                ended = not any(s.active for s in now.values())
                forgotten = [j for j, s in now.items() if s.source == "none"]
                next_check = time.monotonic() + FOLLOW_STATE_EVERY.total_seconds()
            for label, path in log_paths(jobs):
                if not path.exists():
                    continue
                with open(path, errors="replace") as f:
                    f.seek(offsets.get(path, 0))
                    new = f.read()
                    offsets[path] = f.tell()
                if new:
                    if label != last_label:
                        print(f"==> {label} <==", file=out)
                        last_label = label
                    print(hide_passwords(new), end="" if new.endswith("\n") else "\n", file=out, flush=True)
            if ended:
                gone = f"; {', '.join(forgotten)}: no longer known to Slurm" if forgotten else ""
                print(f"all jobs ended (job{'s' if len(ids) > 1 else ''} {', '.join(ids)}{gone})", file=out, flush=True)
                return
            time.sleep(FOLLOW_POLL.total_seconds())
    except KeyboardInterrupt:
        return
