"""The Slurm launcher without a cluster: recorded sbatch previews, site validation, manifest, job states."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from geofed_hpc.cli import compose_config, config_groups
from geofed_hpc.config import SiteConfig
from geofed_hpc.errors import ConfigError, LaunchError
from geofed_hpc.launch import executor, manifest, slurm
from geofed_hpc.launch.jobs import error_cause, jobs_table, log_paths

DATA = Path(__file__).parent / "data" / "sbatch"
CLI = [sys.executable, "-m", "geofed_hpc.cli"]
# A login node's environment, fixed so that the recorded previews do not depend on who runs the tests.
LOGIN_ENV = {"HOME": "/home/alice", "USER": "alice", "SCRATCH": "/scratch/alice", "WORK": "/work/alice"}
# A login node of the shipped clusters has its own Slurm: sinfo and sacctmgr that know their partitions and accounts
# (shadowing whatever Slurm this machine runs, whose partitions are not theirs).
LOGIN_SLURM = ("gpu\\ngh\\n", "pas0000\\nabc23456\\n")
RECORD = os.environ.get("GEOFED_RECORD_SBATCH") == "1"  # rewrite tests/data/sbatch/*.sh instead of comparing


def slurm_sites() -> list[str]:
    return [s for s in config_groups()["site"] if compose_config([f"site={s}"])[0].site.executor == "slurm"]


def cli(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        CLI + args, cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )


def test_every_shipped_slurm_site_has_a_recorded_preview() -> None:
    sites = slurm_sites()
    assert {"osc", "uw_madison", "tacc", "iitm", "template", "slurm_local"} <= set(sites)
    recorded = {p.stem for p in DATA.glob("*.sh")}
    assert recorded == set(sites), "record with GEOFED_RECORD_SBATCH=1 pytest tests/test_launch_slurm.py"


@pytest.mark.parametrize("site", slurm_sites())
def test_sbatch_preview_matches_the_recorded_file(site: str) -> None:
    cfg, _ = compose_config([f"site={site}", "site.python=python", "run_dir=/shared/runs/geofed"])
    run_dir = executor.site_run_dir(cfg, environ=LOGIN_ENV)
    text = executor.sbatch_preview(cfg, 0, run_dir)
    path = DATA / f"{site}.sh"
    if RECORD:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs from the preview; rerun with GEOFED_RECORD_SBATCH=1 if intended"
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=USR2@" in text
    assert f"{run_dir}/jobs/{site}-0/%j" in text  # fixed folder: a requeued job finds its pickle and checkpoints


def test_gpu_request_follows_the_site_style() -> None:
    def gpus(**site: object) -> dict[str, object]:
        cfg, _ = compose_config(["site=template"])
        cfg = replace(cfg, site=replace(cfg.site, **site))
        params = executor.sbatch_parameters(cfg, 0)
        return {k: params[k] for k in ("gres", "gpus_per_node") if k in params}

    assert gpus(gpu_style="gres", gpus_per_node=4, gpu_type="a100") == {"gres": "gpu:a100:4"}
    assert gpus(gpu_style="gres", gpus_per_node=2, gpu_type="") == {"gres": "gpu:2"}
    assert gpus(gpu_style="gpus", gpus_per_node=4, gpu_type="h100") == {"gpus_per_node": "h100:4"}
    assert gpus(gpu_style="none", gpus_per_node=1, gpu_type="gh200") == {}


def test_setup_lines_proxy_and_extra_options() -> None:
    cfg, _ = compose_config(["site=iitm", "+site.sbatch_extra.reservation=ml"])
    text = executor.sbatch_preview(cfg, 0, Path("/shared/run"))
    assert "#SBATCH --reservation=ml" in text
    setup = text.split("# setup\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert setup[:3] == ["module load anaconda3", 'eval "$(conda shell.bash hook)"', "conda activate geofed"]
    assert setup[3].startswith("export https_proxy=http://proxy.example.iitm.ac.in:3128 ") and "grpc_proxy=" in setup[3]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["site=slurm_local", "site.partition="], "site.partition: a Slurm site needs a partition"),
        (["site=osc", "site.gpu_type=a1000"], "site.gpu_type: unknown GPU type 'a1000'; known: a10, a100"),
        (["site=osc", "site.gpu_style=mig"], "site.gpu_style: must be one of gres, gpus, none"),
        (["site=slurm_local", "site.embedded_ps=true"], "site.embedded_ps: Slurm jobs outlive `launch`"),
        (["site=slurm_local", "site.timeout=30s"], "site.timeout: Slurm time limits are whole minutes"),
        (["site=iitm", "site.proxy=proxy:3128"], "site.proxy: expected http://[USER:PASS@]host:port"),
        (["site=osc", "site.executor=pbs"], "site.executor: must be one of local, slurm"),
    ],
)
def test_bad_sites_are_refused_naming_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_time_limit_shorter_than_a_sync_plus_the_signal_delay_is_refused_with_the_arithmetic() -> None:
    cfg, _ = compose_config(["site=slurm_local", "site.timeout=2m", "train.sync_interval=5m"])
    with pytest.raises(ConfigError) as info:
        executor.check_slurm_site(cfg)
    assert str(info.value).startswith(
        "site.timeout: 2m is shorter than train.sync_interval (5m) + site.signal_delay (1m30s) = 6m30s"
    )
    cfg, _ = compose_config(["site=slurm_local", "site.timeout=2m", "train.sync_interval=30s"])
    executor.check_slurm_site(cfg)  # 2m >= 30s + 90s


def test_run_directory_on_a_node_local_filesystem_warns() -> None:
    mounts = (
        "overlay / overlay rw 0 0\n"
        "tmpfs /tmp tmpfs rw 0 0\n"
        "fs1:/scratch /scratch nfs4 rw 0 0\n"
        "lustre@o2ib:/fs /fs/ess lustre rw 0 0\n"
    )
    assert executor.shared_fs_warning(Path("/scratch/alice/runs/x"), mounts) is None
    assert executor.shared_fs_warning(Path("/fs/ess/PAS0000/runs"), mounts) is None
    warning = executor.shared_fs_warning(Path("/tmp/runs/x"), mounts)
    assert warning and "tmpfs (mounted at /tmp)" in warning and "site.run_dir" in warning
    assert "overlay (mounted at /)" in (executor.shared_fs_warning(Path("/home/alice/runs"), mounts) or "")


def test_site_run_dir_is_fixed_and_expands_the_login_environment() -> None:
    cfg, _ = compose_config(["site=tacc", "federation=exp1"])
    assert executor.site_run_dir(cfg, environ=LOGIN_ENV) == Path("/scratch/alice/geofed/runs/exp1")
    with pytest.raises(ConfigError, match=r"site.run_dir: '\$SCRATCH/geofed/runs' uses \$SCRATCH, which is not set"):
        executor.site_run_dir(cfg, environ={})
    assert str(executor.site_run_dir(cfg, environ={}, strict=False)) == "$SCRATCH/geofed/runs/exp1"
    local, _ = compose_config(["site=slurm_local", "run_dir=/shared/runs/exp1"])
    assert executor.site_run_dir(local, environ={}) == Path("/shared/runs/exp1")


def test_submission_environment_drops_inherited_slurm_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    inherited = {
        "SLURM_MEM_PER_CPU": "10", "SLURM_JOB_ID": "999", "SLURMD_NODENAME": "gpu007", "SRUN_DEBUG": "3",
        "SBATCH_MEM_BIND": "local", "SUBMITIT_EXECUTOR": "slurm", "MASTER_ADDR": "gpu007", "MASTER_PORT": "29500",
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
    }  # fmt: skip
    for key, value in {**inherited, "SLURM_CONF": "/etc/slurm/slurm.conf", "HOME": "/home/alice"}.items():
        monkeypatch.setenv(key, value)
    with slurm.submission_environment() as dropped:
        assert not set(inherited) & set(os.environ)
        assert os.environ["SLURM_CONF"] == "/etc/slurm/slurm.conf" and os.environ["HOME"] == "/home/alice"
        assert set(inherited) <= set(dropped) and "SLURM_CONF" not in dropped
    assert {key: os.environ[key] for key in inherited} == inherited
    assert os.environ["SLURM_CONF"] == "/etc/slurm/slurm.conf"
    with pytest.raises(RuntimeError, match="sbatch failed"), slurm.submission_environment():
        raise RuntimeError("sbatch failed")
    assert {key: os.environ[key] for key in inherited} == inherited  # restored after an error too


def test_missing_sbatch_names_the_command_and_why(tmp_path: Path) -> None:
    result = cli(
        ["launch", "site=slurm_local", "ps.address=127.0.0.1:9", f"run_dir={tmp_path / 'run'}"],
        tmp_path,
        PATH=str(tmp_path),
    )
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert "`sbatch` not found on PATH (site.executor=slurm: site 'slurm_local' submits its jobs with sbatch)" in line
    assert "Traceback" not in result.stderr
    with pytest.raises(LaunchError, match="`no-such-command-here` not found on PATH"):
        slurm.require("no-such-command-here", "a test")


def test_a_slurm_launch_needs_the_ps_address(tmp_path: Path) -> None:
    result = cli(["launch", "site=slurm_local", f"run_dir={tmp_path}"], tmp_path)
    assert result.returncode == 2 and "ps.address: Slurm site jobs dial the parameter server" in result.stderr


def login_env(tmp_path: Path) -> dict[str, str]:
    return {**LOGIN_ENV, **_fake_slurm(tmp_path / "login-bin", *LOGIN_SLURM)}


def test_dry_run_prints_one_batch_file_per_site_and_submits_nothing(tmp_path: Path) -> None:
    result = cli(
        ["launch", "site=osc,tacc", "ps.address=vm.example.org:50051", "--dry-run", "--no-ps-check"],
        tmp_path,
        **login_env(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    headers = [line for line in result.stdout.splitlines() if line.startswith("# ---- ")]
    assert [h.split(":")[0] for h in headers] == ["# ---- osc-0", "# ---- tacc-0"]
    assert result.stdout.count("#!/bin/bash") == 2 and "--partition=gh" in result.stdout
    assert not (tmp_path / "runs").exists()
    local = cli(["launch", "site=local", "--dry-run"], tmp_path)
    assert local.returncode == 0 and "no sbatch file" in local.stdout


def test_one_setup_line_given_as_a_string_is_one_line_of_the_batch_file(tmp_path: Path) -> None:
    result = cli(
        [
            "launch",
            "site=osc",
            "ps.address=vm.example.org:50051",
            "site.setup=module load cuda",
            "--dry-run",
            "--no-ps-check",
        ],
        tmp_path,
        **login_env(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("# setup\n", 1)[1].split("\n\n", 1)[0].splitlines() == ["module load cuda"]


def test_manifest_keeps_every_job_and_the_newest_per_site(tmp_path: Path) -> None:
    def job(site: str, job_id: str) -> manifest.JobRecord:
        return manifest.JobRecord(site, job_id, site.rsplit("-", 1)[0], "slurm", f"/l/{job_id}.out", f"/l/{job_id}.err")

    manifest.record_jobs(tmp_path, "fed", "vm:1", "osc", {"a": 1}, [job("osc-0", "11"), job("osc-1", "12")])
    manifest.record_jobs(tmp_path, "fed", "vm:2", "tacc", {"b": 2}, [job("tacc-0", "7")])
    manifest.record_jobs(tmp_path, "fed", "vm:2", "osc", {"a": 3}, [job("osc-0", "13")])
    loaded = manifest.load_manifest(tmp_path)
    assert loaded is not None and loaded.ps_address == "vm:2" and len(loaded.jobs) == 4
    assert {k: v.job_id for k, v in loaded.latest("osc").items()} == {"osc-0": "13", "osc-1": "12"}
    assert sorted(loaded.latest()) == ["osc-0", "osc-1", "tacc-0"] and loaded.configs["osc"] == {"a": 3}
    assert [label for label, _ in log_paths(loaded.latest("tacc"))] == ["tacc-0 job 7 stdout", "tacc-0 job 7 stderr"]
    (tmp_path / "launch.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable launch manifest"):
        manifest.load_manifest(tmp_path)
    assert manifest.load_manifest(tmp_path / "nothing-here") is None


def test_preempted_and_requeued_jobs_are_shown_as_transient() -> None:
    jobs = {
        "a-0": manifest.JobRecord("a-0", "5", "a", "slurm", "o", "e"),
        "a-1": manifest.JobRecord("a-1", "6", "a", "slurm", "o", "e"),
        "a-2": manifest.JobRecord("a-2", "7", "a", "slurm", "o", "e"),
    }
    states = {
        "5": slurm.JobState("5", "PREEMPTED", "squeue", "", "1:02"),
        "6": slurm.JobState("6", "REQUEUED", "sacct"),
        "7": slurm.JobState("7", "FAILED", "scontrol", "NonZeroExitCode"),
    }
    assert states["5"].active and states["6"].active and not states["7"].active
    table = jobs_table(jobs, states).splitlines()
    assert "PREEMPTED (preempted; Slurm requeues it and it resumes from its checkpoint)" in table[1]
    assert "REQUEUED (requeued; it resumes from its checkpoint)" in table[2]
    assert table[3].endswith("FAILED (NonZeroExitCode)")


def test_site_config_defaults_stay_local_and_valid() -> None:
    site = SiteConfig()
    assert site.executor == "local" and site.signal_delay == timedelta(seconds=90) and site.setup == []
    with pytest.raises(ConfigError, match="site.gpu_type: is set but site.gpus_per_node is 0"):
        SiteConfig(executor="slurm", partition="p", embedded_ps=False, gpu_type="a100")


def test_logs_follow_prints_what_the_logs_gain_until_the_jobs_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from geofed_hpc.launch import jobs as jobs_mod

    out_log, err_log = tmp_path / "9_0_log.out", tmp_path / "9_0_log.err"
    out_log.write_text("before follow\n")
    job = {"s-0": manifest.JobRecord("s-0", "9", "s", "slurm", str(out_log), str(err_log))}
    calls = []

    def states(jobs: dict[str, manifest.JobRecord]) -> dict[str, slurm.JobState]:
        calls.append(list(jobs))
        if len(calls) == 1:  # the job writes while it runs, then ends
            with open(out_log, "a") as f:
                f.write("step 1\n")
            err_log.write_text("requeued\n")
            return {"9": slurm.JobState("9", "RUNNING", "squeue")}
        return {"9": slurm.JobState("9", "COMPLETED", "squeue")}

    monkeypatch.setattr(jobs_mod, "FOLLOW_STATE_EVERY", timedelta(0))
    monkeypatch.setattr(jobs_mod, "FOLLOW_POLL", timedelta(0))
    buf = io.StringIO()
    jobs_mod.follow_logs(job, out=buf, states=states)
    text = buf.getvalue()
    assert "before follow" not in text  # only what is new
    assert "==> s-0 job 9 stdout <==\nstep 1\n==> s-0 job 9 stderr <==\nrequeued\n" in text
    assert text.endswith("all jobs ended (job 9)\n") and len(calls) == 2


def test_dry_run_shows_expanded_paths_and_the_federation_settings(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("a CA")
    args = ["launch", "site=tacc", "ps=cloud", "ps.address=vm.example.org:50051", f"ps.ca_file={ca}"]
    result = cli(
        [*args, "site.token=t0k", "model=tiny_llama", "codec=int4", "--dry-run", "--no-ps-check"],
        tmp_path,
        **login_env(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    head = result.stdout.split("#!/bin/bash", 1)[0]
    assert "$SCRATCH" not in result.stdout and "/scratch/alice/geofed/runs/geofed" in head
    assert "parameter server vm.example.org:50051, TLS, CA " + str(ca) + ", enrollment token set" in head
    assert "model tiny_llama (llama), paradigm identity, codec int4" in head
    assert "# preflight" in head and "ok       tls" not in head and "error" not in head


def test_dry_run_expands_user_from_the_system_and_names_a_variable_that_is_not_set(tmp_path: Path) -> None:
    import getpass

    env = {k: v for k, v in os.environ.items() if k not in ("USER", "LOGNAME", "SCRATCH")}
    env["PATH"] = login_env(tmp_path)["PATH"]
    result = subprocess.run(
        CLI + ["launch", "site=osc", "ps.address=vm.example.org:50051", "--dry-run", "--no-ps-check"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "$USER" not in result.stdout and f"/fs/scratch/PAS0000/{getpass.getuser()}/geofed/runs" in result.stdout
    tacc = subprocess.run(
        CLI + ["launch", "site=tacc", "ps.address=vm.example.org:50051", "--dry-run", "--no-ps-check"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert "$SCRATCH is not set here: `launch` refuses it until it is" in tacc.stdout


def _fake_slurm(folder: Path, partitions: str, accounts: str) -> dict[str, str]:
    """sinfo and sacctmgr that answer as a cluster would, first on PATH."""
    folder.mkdir(exist_ok=True)
    for name, out in (("sinfo", partitions), ("sacctmgr", accounts)):
        script = folder / name
        script.write_text(f"#!/bin/sh\nprintf '{out}'\n")
        script.chmod(0o755)
    return {"PATH": f"{folder}:{os.environ['PATH']}", "USER": "alice"}


def test_site_check_runs_the_preflight_alone_and_names_what_slurm_lacks(tmp_path: Path) -> None:
    env = _fake_slurm(tmp_path / "bin", "gpu*\\ndebug\\n", "pas1234\\n")
    ok = cli(
        ["site", "check", "site=osc", "site.account=PAS1234", "ps.address=127.0.0.1:9", "--no-ps-check"],
        tmp_path,
        **env,
    )
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert any(line.startswith("ok") and "partition gpu exists" in line for line in lines)
    assert any(line.startswith("ok") and "account PAS1234 is one of alice's" in line for line in lines)
    assert any(line.startswith("ok") and "127.0.0.1:9 (not probed: --no-ps-check)" in line for line in lines)
    assert lines[-1] == "site osc: ready to launch"
    dead = cli(["site", "check", "site=osc", "site.account=PAS1234", "ps.address=127.0.0.1:9"], tmp_path, **env)
    assert dead.returncode == 2 and "nothing answers at 127.0.0.1:9" in dead.stderr
    bad = cli(
        ["site", "check", "site=osc", "site.partition=gpux", "ps.address=127.0.0.1:9", "--no-ps-check"], tmp_path, **env
    )
    assert bad.returncode == 2 and "\n" not in bad.stderr.strip()
    assert "site.partition: 'gpux' is not a partition here; sinfo lists debug, gpu" in bad.stderr
    account = cli(
        ["site", "check", "site=osc", "ps.address=127.0.0.1:9", "--no-ps-check"], tmp_path, **env
    )  # osc's PAS0000
    assert account.returncode == 2 and "site.account: 'PAS0000' is not one of alice's accounts here: pas1234" in (
        account.stderr
    )
    assert "error    slurm" in account.stdout


def _prepared(folder: Path, shards: int) -> Path:
    """A shard folder's index as `data prepare` writes it (the preflight reads only the index)."""
    from geofed_hpc.data.shards import ShardFile, ShardIndex, write_index
    from geofed_hpc.data.tokenizer import load_tokenizer

    tok = load_tokenizer("gpt2")
    train = [ShardFile(f"train-{i}.bin", 1000, "0" * 64) for i in range(shards)]
    index = ShardIndex(
        "gpt2", tok.vocab_size, tok.eot_id, "<u2", 50000, "corpus", train, ShardFile("val.bin", 100, "0")
    )
    index.tokenizer_sha256 = tok.identity
    folder.mkdir(parents=True)
    write_index(folder, index)
    return folder


def test_preflight_names_each_mistake_that_would_surface_only_on_the_compute_node(tmp_path: Path) -> None:
    from geofed_hpc.ckpt import CheckpointStore
    from geofed_hpc.commands.preflight import check_checkpoints, check_data, check_model, first_error
    from geofed_hpc.config.run import model_shape

    def error(found: list) -> str:
        err = first_error(found)
        return str(err) if err else ""

    cfg, _ = compose_config(["model=llama3_1b", f"model.init_from={tmp_path / 'Llama-3.2-1B'}"])
    assert error(check_model(cfg)).startswith(f"model.init_from: {tmp_path / 'Llama-3.2-1B'} does not exist")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "config.json").write_text('{"hidden_size": 1024}')
    cfg, _ = compose_config(["model=llama3_1b", f"model.init_from={folder}", "data.tokenizer=gpt2"])
    assert error(check_model(cfg)).startswith("model.d_model: is 2048 but the checkpoint's")

    data = _prepared(tmp_path / "data", shards=2)
    cfg, _ = compose_config([f"data.source={data}", "site.num_sites=3"])
    assert "site.num_sites: sites 0..2 of 3 need 3 train shards but" in error(check_data(cfg))
    assert error(check_data(compose_config([f"data.source={data}", "site.num_sites=2"])[0])) == ""

    run = tmp_path / "run"
    cfg, _ = compose_config([f"run_dir={run}"])
    other, _ = compose_config(["model.n_layers=3"])
    CheckpointStore(run / "sites" / "local-1" / "ckpt", prefix="site").save(
        2, {}, {"syncs": 2, "model": model_shape(other)}
    )
    assert "is of another model (model.n_layers=3, this run has 2)" in error(check_checkpoints(cfg, run))


def test_preflight_warns_about_the_ps_with_the_settings_to_add(tmp_path: Path) -> None:
    from geofed_hpc.commands.preflight import check_ps

    cfg, _ = compose_config(["site=osc", "ps=cloud", f"ps.ca_file={tmp_path / 'ca.crt'}"])
    found = check_ps(cfg, "vm.example.org:50051")
    assert [(f.level, f.what) for f in found] == [("error", "tls"), ("warning", "token")]
    assert f"ps.ca_file: {tmp_path / 'ca.crt'} does not exist here" in found[0].message
    assert "token issue site=osc" in found[1].message and "site.token=" in found[1].message
    plain, _ = compose_config(["site=osc", "site.token=x"])
    assert check_ps(plain, "")[0].message.startswith("ps.address: Slurm site jobs dial the parameter server")
    assert check_ps(plain, "127.0.0.1:0")[0].message.startswith("ps.address: port 0 of '127.0.0.1:0' is out of range")
    loop = check_ps(plain, "127.0.0.1:9")
    assert loop[0].level == "warning" and "is the compute node itself" in loop[0].message
    assert loop[-1].level == "error" and "nothing answers at 127.0.0.1:9" in loop[-1].message
    assert "--no-ps-check" in loop[-1].message


def test_a_failed_job_shows_its_cause_from_its_log(tmp_path: Path) -> None:
    err = tmp_path / "8_0_log.err"
    err.write_text(
        '12:00:01 INFO geofed_hpc: osc-0: joining\nTraceback (most recent call last):\n  File "x.py", line 1\n'
        "geofed_hpc.errors.AuthError: Join refused by the parameter server: unknown enrollment token\n"
        "srun: error: node1: task 0: Exited with exit code 1\n"
    )
    jobs = {"osc-0": manifest.JobRecord("osc-0", "8", "osc", "slurm", "o", str(err))}
    table = jobs_table(jobs, {"8": slurm.JobState("8", "FAILED", "sacct")}).splitlines()
    assert table[1].endswith("FAILED")
    assert "cause: AuthError: Join refused by the parameter server: unknown enrollment token" in table[2]
    assert str(err) in table[2]
    timeout = tmp_path / "9_0_log.err"
    timeout.write_text("slurmstepd: error: *** JOB 9 ON node1 CANCELLED AT 2025-01-01T00:00:00 DUE TO TIME LIMIT ***\n")
    jobs = {"osc-1": manifest.JobRecord("osc-1", "9", "osc", "slurm", "o", str(timeout))}
    assert "cause: JOB 9 ON node1 CANCELLED AT 2025-01-01T00:00:00 DUE TO TIME LIMIT" in jobs_table(
        jobs, {"9": slurm.JobState("9", "TIMEOUT", "sacct")}
    )
    running = jobs_table(jobs, {"9": slurm.JobState("9", "RUNNING", "squeue")})
    assert "cause" not in running


def test_logs_follow_ends_when_slurm_no_longer_knows_the_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import threading

    from geofed_hpc.launch import jobs as jobs_mod

    job = {"s-0": manifest.JobRecord("s-0", "77", "s", "slurm", str(tmp_path / "o"), str(tmp_path / "e"))}
    gone = slurm.JobState("77", "UNKNOWN", "none", "no longer known to squeue, sacct or scontrol")
    monkeypatch.setattr(jobs_mod, "FOLLOW_POLL", timedelta(0))
    buf = io.StringIO()
    thread = threading.Thread(target=jobs_mod.follow_logs, args=(job, buf, lambda jobs: {"77": gone}), daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "follow_logs kept waiting for a job Slurm forgot"
    assert buf.getvalue() == "all jobs ended (job 77; 77: no longer known to Slurm)\n"


def test_without_slurm_commands_the_host_is_named_not_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match=r"no Slurm command here \(squeue, sacct, scontrol are not on PATH\)"):
        slurm.job_states(["5"])
    record = manifest.JobRecord("slurm_local-0", "5", "slurm_local", "slurm", "o", "e")
    manifest.record_jobs(tmp_path, "geofed", "", "slurm_local", {}, [record])
    follow = cli(["logs", "site=slurm_local", f"run_dir={tmp_path}", "--follow"], tmp_path, PATH=str(tmp_path))
    assert follow.returncode == 2 and "no Slurm command here" in follow.stderr and "Traceback" not in follow.stderr
    status = cli(["status", f"run_dir={tmp_path}", "ps.address=127.0.0.1:9", "ps.connect_timeout=1s"], tmp_path,
                 PATH=str(tmp_path))  # fmt: skip
    assert "site jobs slurm_local-0: state unknown: no Slurm command here" in status.stdout


def test_the_preflight_never_loads_torch_on_the_login_node(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom pathlib import Path\nfrom geofed_hpc.cli import compose_config\n"
        "from geofed_hpc.commands.preflight import preflight\n"
        "cfg, _ = compose_config(['site=osc', 'ps.address=127.0.0.1:9', 'model=llama3_1b', 'data.tokenizer=gpt2',"
        f" 'model.init_from={tmp_path}'])\n"
        f"found = preflight(cfg, Path({str(tmp_path)!r}), cfg.ps.address)\n"
        "print([f.what for f in found if f.level == 'error' and f.what != 'disk'], 'torch' in sys.modules)"
    )
    env = {**os.environ, "PATH": login_env(tmp_path)["PATH"]}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env=env
    ).stdout
    # init_from (no safetensors) and the PS (none) checked, no torch; the disk's verdict depends on this machine's room
    assert out.strip() == "['model', 'ps'] False"


def test_a_failed_job_shows_the_first_error_not_what_failed_while_cleaning_up() -> None:
    log = (
        'Traceback (most recent call last):\n  File "sync.py", line 9\n'
        "geofed_hpc.errors.UnavailableError: cannot reach the parameter server at vm:50051 after 30s\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        'Traceback (most recent call last):\n  File "link.py", line 3\n'
        "ValueError: Cannot invoke RPC: Channel closed!\n"
    )
    assert error_cause(log) == "UnavailableError: cannot reach the parameter server at vm:50051 after 30s"
    later = log + "\nrequeued\nTraceback (most recent call last):\n  File \"x.py\"\nKeyError: 'step'\n"
    assert error_cause(later) == "KeyError: 'step'"  # a new failure after the first one: the newest


@pytest.mark.skipif(shutil.which("squeue") is None, reason="needs Slurm's commands (slurm/install.sh)")
def test_a_slurm_that_does_not_answer_is_named_not_reported_as_jobs_that_ended(tmp_path: Path) -> None:
    """squeue with no SLURM_CONF (Slurm installed, not configured) reaches no controller: `logs --follow` and `cancel`
    say so in one line instead of "all jobs ended"."""
    from geofed_hpc.launch.manifest import JobRecord, record_jobs

    out = tmp_path / "run" / "jobs" / "slurm_local-0"
    out.mkdir(parents=True)
    (out / "5_0_log.out").write_text("step 1\n")
    job = JobRecord("slurm_local-0", "5", "slurm_local", "slurm", str(out / "5_0_log.out"), str(out / "5_0_log.err"))
    record_jobs(tmp_path / "run", "geofed", "127.0.0.1:9", "slurm_local", {}, [job])
    unset = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    missing = {**unset, "SLURM_CONF": str(tmp_path / "nowhere" / "slurm.conf")}
    for env, args in ((unset, ["logs", "--follow"]), (missing, ["cancel"]), (unset, ["cancel"])):
        result = subprocess.run(
            CLI + [*args, "site=slurm_local", f"run_dir={tmp_path / 'run'}"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert result.returncode == 2, result.stdout + result.stderr
        assert "Slurm does not answer here" in result.stderr and "SLURM_CONF" in result.stderr
        assert "all jobs ended" not in result.stdout and "Traceback" not in result.stderr
