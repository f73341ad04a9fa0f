"""Against a real single-node Slurm (slurm/): site jobs train, are preempted, signalled, requeued, time out, resume."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.cli import compose_config
from geofed_hpc.config import DataConfig
from geofed_hpc.launch import executor, slurm
from geofed_hpc.launch.manifest import JobRecord, load_manifest
from geofed_hpc.metrics import read_jsonl
from geofed_hpc.rpc.client import PSClient

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "geofed_hpc.cli"]
# A PS that applies each delta on arrival and accepts old ones: a requeued site's unpushed work must count.
PS_OVERRIDES = ["ps.aggregation=async", "ps.max_staleness=1000", "train.sync_interval=2s", "ps.round_timeout=30s"]
# As if `launch` ran inside an allocation: srun in the new job fails if these reach it.
INHERITED = {"SLURM_JOB_ID": "999999", "SLURM_MEM_PER_CPU": "10", "SLURM_NTASKS": "3", "SLURM_NPROCS": "3"}
WAIT_S = 240.0
T = TypeVar("T")


def _ping() -> bool:
    return (
        shutil.which("scontrol") is not None
        and subprocess.run(["scontrol", "ping"], capture_output=True).returncode == 0
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """The Slurm SLURM_CONF points at, else slurm/start.sh's (started here as root, stopped afterwards)."""
    if os.environ.get("SLURM_CONF") and _ping():
        yield
        return
    if os.geteuid() != 0:
        pytest.skip(
            "needs a real Slurm: run as root (`make test` starts slurm/), or export SLURM_CONF of a running one"
        )
    slurm_dir = Path(os.environ.get("GEOFED_SLURM_DIR", REPO / ".slurm")).resolve()
    running = subprocess.run([REPO / "slurm" / "status.sh"], capture_output=True).returncode == 0
    if not running:
        subprocess.run([REPO / "slurm" / "start.sh"], check=True, timeout=600)
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(slurm_dir / "run" / "etc" / "slurm.conf")
    try:
        assert _ping(), "slurmctld does not answer"
        yield
    finally:
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
        if not running:
            subprocess.run([REPO / "slurm" / "stop.sh"], timeout=300)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenize once here, so that site jobs starting together do not race to write the cache."""
    from geofed_hpc.data import load_tokens

    path = tmp_path_factory.mktemp("tokens")
    load_tokens(DataConfig(tokenizer="gpt2", cache_dir=str(path), max_tokens=60000, val_batches=2))
    return path


@pytest.fixture
def ps() -> Iterator[Any]:
    from geofed_hpc.ps.app import ParameterServer

    cfg, _ = compose_config(PS_OVERRIDES)
    server = ParameterServer(cfg)
    yield server
    server.stop()


def tiny(run_dir: Path, cache: Path, ps_address: str) -> list[str]:
    return [
        f"ps.address={ps_address}",
        f"run_dir={run_dir}",
        "train.sync_interval=2s",
        "train.max_syncs=0",
        "data.max_tokens=60000",
        "data.val_batches=2",
        f"data.cache_dir={cache}",
    ]


def cli(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        CLI + args,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "WANDB_SILENT": "true", **env},
    )


def launch(args: list[str], cwd: Path) -> dict[str, JobRecord]:
    result = cli(["launch", "site=slurm_local", "--demo", *args], cwd, **INHERITED)
    assert result.returncode == 0, result.stdout + result.stderr
    manifest = load_manifest(Path(next(a[8:] for a in args if a.startswith("run_dir="))))
    assert manifest is not None
    return manifest.latest()


def events(run_dir: Path, site: str) -> list[dict[str, Any]]:
    path = run_dir / "sites" / site / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def find(run_dir: Path, site: str, event: str, **match: Any) -> dict[str, Any] | None:
    for e in events(run_dir, site):
        if e["event"] == event and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def ps_view(address: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """(global version, site -> (pushes, tokens)) summed over each site's sessions."""
    cfg, _ = compose_config([f"ps.address={address}"])
    with PSClient(cfg.ps) as client:
        st = client.status()
    sites: dict[str, tuple[int, int]] = {}
    for s in st.sites:
        pushes, tokens = sites.get(s.site, (0, 0))
        sites[s.site] = (pushes + s.pushes, tokens + s.tokens)
    return st.version, sites


class Watch:
    """Polls until a condition holds, recording every state Slurm reports for the jobs meanwhile."""

    def __init__(self, jobs: dict[str, JobRecord]) -> None:
        self.jobs = jobs
        self.seen: set[str] = set()

    def until(self, what: str, cond: Callable[[], T | None], timeout: float = WAIT_S) -> T:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.seen |= {s.state for s in slurm.job_states([j.job_id for j in self.jobs.values()]).values()}
            value = cond()
            if value:
                return value
            time.sleep(0.5)
        logs = "\n".join(f"--- {j.stderr}\n{Path(j.stderr).read_text()[-3000:]}" for j in self.jobs.values())
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{logs}")


def pushes_reach(address: str, site: str, n: int) -> Callable[[], bool]:
    return lambda: ps_view(address)[1].get(site, (0, 0))[0] >= n


def check_nothing_lost_or_applied_twice(run_dir: Path, address: str, sites: list[str], tokens_per_step: int) -> None:
    """Every trained token reached the PS once, or waits in the site's checkpoint as unpushed steps."""
    version, view = ps_view(address)
    for site in sites:
        loaded = CheckpointStore(run_dir / "sites" / site / "ckpt", prefix="site").load_latest()
        assert loaded is not None
        _, meta, _ = loaded
        pending = int((meta.get("pending") or {}).get("steps", 0))
        pushes, tokens = view[site]
        assert pushes == meta["syncs"], (site, pushes, meta)
        assert tokens == meta["tokens_seen"] - pending * tokens_per_step, (site, tokens, pending, meta)
    assert version == sum(p for p, _ in view.values())  # async: one version per applied delta, none twice


def test_accounting_and_job_states_with_and_without_sacct(cluster: None, tmp_path: Path) -> None:
    job_id = subprocess.run(
        ["sbatch", "--parsable", "-o", str(tmp_path / "%j.out"), "--wrap", "true"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Watch({}).until("the job to complete", lambda: slurm.job_states([job_id])[job_id].state == "COMPLETED", 60)

    def recorded() -> str:  # slurmdbd hears of the job's start and end after the fact: PENDING may come first
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True)
        state = out.stdout.strip()
        return "" if state in ("", "PENDING", "RUNNING", "COMPLETING") else state

    sacct = Watch({}).until("sacct to record its end", recorded, 60)
    assert sacct == "COMPLETED"
    bare = tmp_path / "bin"  # a cluster without sacct: only squeue and scontrol
    bare.mkdir()
    for name in ("squeue", "scontrol"):
        (bare / name).symlink_to(shutil.which(name) or name)
    path = os.environ["PATH"]
    os.environ["PATH"] = str(bare)
    try:
        states = slurm.job_states([job_id, "987654"])
    finally:
        os.environ["PATH"] = path
    assert states[job_id].state == "COMPLETED" and not states[job_id].active
    assert states["987654"].state == "UNKNOWN"


def test_inherited_allocation_variables_break_srun_unless_cleared(
    cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --mem=100M\n#SBATCH -c 1\nsrun true && echo SRUN_OK\n")
    for key, value in INHERITED.items():
        monkeypatch.setenv(key, value)
    polluted = dict(os.environ)
    with slurm.submission_environment():
        cleared = dict(os.environ)
    outputs = {}
    for name, env in (("inherited", polluted), ("cleared", cleared)):
        out = tmp_path / f"{name}.out"
        job_id = subprocess.run(
            ["sbatch", "--parsable", "-o", str(out), str(script)], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        Watch({}).until(f"job {job_id} to end", lambda j=job_id: not slurm.job_states([j])[j].active, 60)
        outputs[name] = out.read_text()
    assert "mutually exclusive" in outputs["inherited"] and "SRUN_OK" not in outputs["inherited"]
    assert "SRUN_OK" in outputs["cleared"]


def test_two_sites_survive_preemption_usr2_requeue_and_cancel(
    cluster: None, cache: Path, ps: Any, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    args = tiny(run_dir, cache, ps.address)
    jobs = launch(args, tmp_path)
    assert sorted(jobs) == ["slurm_local-0", "slurm_local-1"]
    assert (run_dir / "jobs").stat().st_mode & 0o777 == 0o700  # the jobs' pickles hold the config, token included
    cfg, _ = compose_config(["site=slurm_local", *args])
    for index, (name, job) in enumerate(jobs.items()):  # what was submitted is exactly the preview
        submitted = Path(job.stdout).parent / f"{job.job_id}_submission.sh"
        assert submitted.read_text() == executor.sbatch_preview(cfg, index, run_dir), name
    tokens_per_step = cfg.train.batch_size * cfg.model.context
    address, watch, versions, delays = ps.address, Watch(jobs), [], {}

    for site in jobs:
        watch.until(f"{site} to push twice", pushes_reach(address, site, 2))
    versions.append(ps_view(address)[0])

    # 1. a job in the high partition needs a CPU: Slurm preempts one low job (USR2 at once), then requeues it
    high = subprocess.run(
        ["sbatch", "--parsable", "-p", "high", "-c", "1", "-o", str(tmp_path / "high-%j.out"), "--wrap", "sleep 3"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    hit = watch.until(
        "a preempted site",
        lambda: next((s for s in jobs if find(run_dir, s, "signal", signal="SIGUSR2", restarts=0)), None),
    )
    signal_at = find(run_dir, hit, "signal", signal="SIGUSR2", restarts=0)
    back = watch.until(f"{hit} to train again", lambda: find(run_dir, hit, "first_step", restarts=1))
    assert signal_at is not None
    delays["preemption"] = back["time"] - signal_at["time"]
    assert slurm.job_states([high])[high].state in ("RUNNING", "COMPLETING", "COMPLETED")
    before = ps_view(address)[1][hit][0]
    watch.until(f"{hit} to keep pushing", pushes_reach(address, hit, before + 2))
    sources = [
        r["resume/source"] for r in read_jsonl(run_dir / "metrics" / f"{hit}.metrics.jsonl") if "resume/source" in r
    ]
    assert sources == ["fresh", "global"]  # the other site pushed meanwhile: the live model was fresher
    versions.append(ps_view(address)[0])

    # 2. submitit's own preemption signal on one job, an external `scontrol requeue` (SIGTERM) on the other
    restarts = {s: max(e["restarts"] for e in events(run_dir, s)) for s in jobs}
    usr2, term = "slurm_local-0", "slurm_local-1"
    subprocess.run(["scancel", "--signal=USR2", jobs[usr2].job_id], check=True)
    subprocess.run(["scontrol", "requeue", jobs[term].job_id], check=True)
    for site, sig in ((usr2, "SIGUSR2"), (term, "SIGTERM")):
        got = watch.until(
            f"{site} to catch {sig}", lambda s=site, g=sig: find(run_dir, s, "signal", signal=g, restarts=restarts[s])
        )
        back = watch.until(
            f"{site} to train again", lambda s=site: find(run_dir, s, "first_step", restarts=restarts[s] + 1)
        )
        delays["scancel --signal=USR2" if sig == "SIGUSR2" else "scontrol requeue"] = back["time"] - got["time"]
    pushed = ps_view(address)[1]
    for site in jobs:
        watch.until(f"{site} to keep pushing", pushes_reach(address, site, pushed[site][0] + 2))
    versions.append(ps_view(address)[0])
    assert watch.seen <= slurm.TRANSIENT, f"a job looked failed on its way back: {watch.seen - slurm.TRANSIENT}"

    # 3. cancel: each job checkpoints on SIGTERM and ends for good
    cancelled = cli(["cancel", "site=slurm_local", *args], tmp_path)
    assert cancelled.returncode == 0, cancelled.stderr
    watch.until(
        "both jobs to end",
        lambda: not any(s.active for s in slurm.job_states([j.job_id for j in jobs.values()]).values()),
    )
    states = slurm.job_states([j.job_id for j in jobs.values()])
    assert {s.state for s in states.values()} == {"CANCELLED"}
    for site in jobs:
        assert find(run_dir, site, "stop", signal="SIGTERM") is not None
    assert versions == sorted(set(versions)), f"the global version must keep increasing: {versions}"
    check_nothing_lost_or_applied_twice(run_dir, address, list(jobs), tokens_per_step)

    status = cli(["status", "site=slurm_local", *args], tmp_path)
    assert status.returncode == 0, status.stderr
    assert status.stdout.count("CANCELLED") == 2 and "slurm_local-0" in status.stdout.split("version")[-1]
    logs = cli(["logs", "site=slurm_local", *args], tmp_path)
    assert logs.returncode == 0 and f"==> slurm_local-1 job {jobs['slurm_local-1'].job_id} stderr" in logs.stdout
    print("\nsignal -> first training step after requeue: " + ", ".join(f"{k} {v:.1f}s" for k, v in delays.items()))


def test_a_short_time_limit_requeues_and_the_job_resumes(cluster: None, cache: Path, ps: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # 3m with USR2 90s before the end: the signal comes 30-90 s in (Slurm may send it up to 60 s early)
    args = [*tiny(run_dir, cache, ps.address), "site.name=shortlimit", "site.num_sites=1", "site.timeout=3m"]
    jobs = launch(args, tmp_path)
    site, job = next(iter(jobs.items()))
    watch = Watch(jobs)
    watch.until("training", lambda: find(run_dir, site, "first_step", restarts=0), 180)
    signal_at = watch.until(
        "the time-limit signal", lambda: find(run_dir, site, "signal", signal="SIGUSR2", restarts=0)
    )
    back = watch.until("the job to train again", lambda: find(run_dir, site, "first_step", restarts=1))
    pushed = ps_view(ps.address)[1][site][0]
    watch.until("it to keep pushing", pushes_reach(ps.address, site, pushed + 1))
    assert "this job is timed-out" in Path(job.stderr).read_text() + Path(job.stdout).read_text()
    assert cli(["cancel", "site=slurm_local", *args], tmp_path).returncode == 0
    watch.until("the job to end", lambda: not slurm.job_states([job.job_id])[job.job_id].active)
    cfg, _ = compose_config(["site=slurm_local", *args])
    check_nothing_lost_or_applied_twice(run_dir, ps.address, [site], cfg.train.batch_size * cfg.model.context)
    print(f"\ntime limit: signal -> first training step after requeue {back['time'] - signal_at['time']:.1f}s")


def test_one_site_runs_as_two_tasks_of_one_job_and_resumes_from_its_shards(
    cluster: None, cache: Path, ps: Any, tmp_path: Path
) -> None:
    """site.tasks_per_node=2: srun starts two tasks of one job, one process each, that meet at the allocation's
    first node (gloo), shard the model (FSDP2), write DCP shards each, and come back from them after USR2."""
    run_dir = tmp_path / "run"
    extra = ["site.name=tasks", "site.num_sites=1", "site.tasks_per_node=2", "site.mem_gb=2"]
    args = [*tiny(run_dir, cache, ps.address), *extra]
    jobs = launch(args, tmp_path)
    site, job = next(iter(jobs.items()))
    submitted = Path(job.stdout).parent / f"{job.job_id}_submission.sh"
    text = submitted.read_text()
    assert "#SBATCH --ntasks-per-node=2" in text and "srun " in text
    watch = Watch(jobs)
    watch.until(f"{site} to push twice", pushes_reach(ps.address, site, 2))
    logs = [Path(job.stderr.replace("_0_log.err", f"_{t}_log.err")) for t in (0, 1)]
    texts = [log.read_text() for log in logs]
    assert "rank 0/2" in texts[0] and "gloo process group" in texts[0], texts[0][-3000:]
    assert "rank 1/2" in texts[1], texts[1][-3000:]
    store = CheckpointStore(run_dir / "sites" / site / "ckpt", prefix="site")
    loaded = watch.until("a checkpoint", store.load_latest)
    tensors, meta, path = loaded
    assert meta["shards"]["world_size"] == 2 and not any(k.startswith("model/") for k in tensors)
    assert (path.parent / meta["shards"]["dir"] / ".metadata").is_file()  # DCP: both ranks wrote their shard

    subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True)  # requeue: both tasks come back
    watch.until(f"{site} to catch USR2", lambda: find(run_dir, site, "signal", signal="SIGUSR2", restarts=0))
    watch.until(f"{site} to train again", lambda: find(run_dir, site, "first_step", restarts=1))
    pushed = ps_view(ps.address)[1][site][0]
    watch.until(f"{site} to keep pushing", pushes_reach(ps.address, site, pushed + 1))
    sources = [
        r["resume/source"] for r in read_jsonl(run_dir / "metrics" / f"{site}.metrics.jsonl") if "resume/source" in r
    ]
    assert sources[0] == "fresh" and sources[1] in ("local", "global")
    assert cli(["cancel", "site=slurm_local", *args], tmp_path).returncode == 0
    watch.until("the job to end", lambda: not slurm.job_states([job.job_id])[job.job_id].active)
    cfg, _ = compose_config(["site=slurm_local", *args])
    check_nothing_lost_or_applied_twice(run_dir, ps.address, [site], cfg.train.batch_size * cfg.model.context)


def test_a_users_script_job_is_requeued_by_slurm_and_resumes_with_nothing_lost_or_applied_twice(
    cluster: None, tmp_path: Path
) -> None:
    """`launch site=X script=train.py ARGS` submits the user's own loop (examples/torch_loop.py, federated by
    geofed_hpc.Site) as the site's Slurm job; `scancel --signal=USR2` (what a preemption sends) reaches the script,
    which checkpoints and exits; Slurm requeues the job, the script resumes where it stopped and finishes, and the PS
    holds every step's tokens once."""
    from geofed_hpc.ps.app import ParameterServer

    # a push every 1000 optimizer steps (the PS's cadence): 20 versions in all, and the run goes on for seconds after
    # the second, so the signal lands mid-run however slowly the test sees that version
    steps, every = 20_000, 1000
    cadence = [f"train.max_local_steps={every}", "train.sync_interval=10m"]  # steps alone, however slow a step
    cfg, _ = compose_config(["ps.aggregation=async", "ps.max_staleness=1000", *cadence])
    server = ParameterServer(cfg)
    try:
        run_dir, example = tmp_path / "run", REPO / "examples" / "torch_loop.py"
        args = [f"ps.address={server.address}", f"run_dir={run_dir}", "site.name=script", "site.num_sites=1"]
        jobs = launch([*args, "wandb_mode=disabled", f"script={example}", f"--steps={steps}"], tmp_path)
        site, job = next(iter(jobs.items()))
        assert site == "script-0"
        watch = Watch(jobs)
        watch.until("two syncs", lambda: find(run_dir, site, "pulled") and ps_view(server.address)[0] >= 2)
        subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True)
        stop = watch.until("the script to stop on USR2", lambda: find(run_dir, site, "stop", signal="SIGUSR2"))
        assert ps_view(server.address)[0] < steps // every, "the script finished before the signal: no requeue seen"
        watch.until("the requeued job to end", lambda: not slurm.job_states([job.job_id])[job.job_id].active)
        assert slurm.job_states([job.job_id])[job.job_id].state == "COMPLETED", Path(job.stderr).read_text()[-3000:]
        assert watch.seen <= slurm.TRANSIENT | {"COMPLETED"}, f"the job looked failed: {watch.seen}"
        ready = [e for e in events(run_dir, site) if e["event"] == "ready"]
        assert [e["source"] for e in ready] == ["fresh", "local"] and ready[1]["steps"] == stop["steps"], ready
        version, view = ps_view(server.address)
        assert version == steps // every  # async: one version per push, none applied twice
        assert view == {site: (steps // every, steps * 32 * 4)}  # every step's tokens (a batch of 32 x 4) once
    finally:
        server.stop()
