"""What `status`, `cancel` and `logs` show about launched site jobs: a jobs table and their log files."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TextIO

from geofed_hpc.launch.manifest import JobRecord
from geofed_hpc.launch.slurm import JobState, job_states

FOLLOW_POLL = timedelta(seconds=0.5)
FOLLOW_STATE_EVERY = timedelta(seconds=5)


# The last line of a job's log that says why it failed: a Python exception (its module path dropped), a fatal
# error of the interpreter, or Slurm's own verdict (time limit, out of memory, node failure).
_CAUSE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*(?P<exc>[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failure)(?::\s.*)?)$"
    r"|^(?P<fatal>Fatal Python error: .*)$"
    r"|^slurmstepd: error: (?P<slurm>.*)$"
)


def error_cause(text: str) -> str | None:
    """Why a job failed, from its log or submitit's report: the last exception line (`AuthError: ...`), else None."""
    for line in reversed(text.splitlines()):
        match = _CAUSE.match(line.strip())
        if match:
            return next(g for g in match.groups() if g).strip(" *")
    return None


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
        print(text if text else "(empty so far)", file=out, flush=True)


def follow_logs(
    jobs: Mapping[str, JobRecord],
    out: TextIO = sys.stdout,
    states: Callable[[Sequence[str]], Mapping[str, JobState]] = job_states,
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
                now = states(ids)
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
                    print(new, end="" if new.endswith("\n") else "\n", file=out, flush=True)
            if ended:
                gone = f" ({', '.join(forgotten)}: no longer known to Slurm)" if forgotten else ""
                print(f"all jobs ended: {', '.join(ids)}{gone}", file=out, flush=True)
                return
            time.sleep(FOLLOW_POLL.total_seconds())
    except KeyboardInterrupt:
        return
