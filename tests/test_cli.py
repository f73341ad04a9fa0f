"""The `geofed-hpc` command as users run it: help, errors, ps up + status, and the installed wheel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_util import free_port

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "geofed_hpc.cli"]


def run(args: list[str], cwd: Path | None = None, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        CLI + args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env}
    )


def test_help_lists_commands_groups_and_options(tmp_path: Path) -> None:
    out = run(["--help"], cwd=tmp_path).stdout
    for text in (
        "launch",
        "ps up",
        "status",
        "report",
        "site ",
        "local",
        "osc",
        "model ",
        "tiny",
        "llama3_1b",
        "cloud",
        "--cfg",
        "+key=value",
    ):
        assert text in out


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["launch", "model=tinyy"],
            "unknown model option 'tinyy'; did you mean model=tiny? valid choices: gpt2_medium",
        ),
        (["lunch"], "unknown command 'lunch'"),
        (["status", "ps.port=x"], "ps.port: expected an integer"),
        (["status", "ps.aggregation=fast"], "ps.aggregation: must be one of sync, async, buffered; got 'fast'"),
        (["launch", "ps.prot=1"], "unknown key ps.prot; did you mean ps.port?"),
        (["launch", "ps.zzz=1"], "unknown key ps.zzz; valid keys in ps: address, aggregation,"),
        (["launch", "site=osx"], "unknown site option 'osx'; did you mean site=osc?"),
        (["stop", "site=osc"], "unknown command 'stop'; did you mean `geofed-hpc cancel`?"),
        (["report", "/nonexistent/run"], "no metrics in /nonexistent/run/metrics"),
        (["wandb", "sync", "/nonexistent/run"], "no offline W&B runs under /nonexistent/run"),
    ],
)
def test_errors_are_one_line_and_nonzero(args: list[str], message: str, tmp_path: Path) -> None:
    result = run(args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_launch_without_reachable_ps_fails_clearly(tmp_path: Path) -> None:
    port = free_port()
    result = run(
        [
            "launch",
            "site.embedded_ps=false",
            f"ps.address=127.0.0.1:{port}",
            "ps.connect_timeout=1s",
            f"run_dir={tmp_path}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert f"cannot reach the parameter server at 127.0.0.1:{port}" in last and "ps up" in last
    assert "Traceback" not in result.stderr


def test_ps_up_status_and_port_in_use(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        CLI + ["ps", "up", f"ps.port={port}", f"ps.state_dir={tmp_path / 'state'}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and "parameter server on" not in line:
            line = proc.stdout.readline()
        assert f":{port}" in line
        status = run(["status", f"ps.address=127.0.0.1:{port}"], cwd=tmp_path)
        assert status.returncode == 0, status.stderr
        assert "version 0" in status.stdout and "initialized False" in status.stdout
        clash = run(["ps", "up", f"ps.port={port}"], cwd=tmp_path)
        assert clash.returncode == 2 and f"127.0.0.1:{port}" in clash.stderr and "in use" in clash.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_installed_wheel_finds_its_config_from_any_directory(tmp_path: Path) -> None:
    """Build a real wheel, install it (non-editable) into a folder, and run its console script elsewhere."""
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("geofed_hpc-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run(
        [sys.executable, "-c", "import geofed_hpc.cli as c; print(c.__file__, c.conf_dir())"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(target)) and str(REPO) not in where
    script = target / "bin" / "geofed-hpc"
    result = subprocess.run(
        [str(script), "launch", "ps=cloud", "--cfg"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "port: 50051" in result.stdout and "name: tiny" in result.stdout
    help_text = subprocess.run([str(script), "--help"], cwd=elsewhere, env=env, capture_output=True, text=True).stdout
    assert "cloud, local" in help_text


def test_site_configs_launched_together_get_disjoint_data_shards(tmp_path: Path) -> None:
    out = run(["launch", "site=osc,tacc", "site.num_sites=2", "--cfg"], cwd=tmp_path).stdout
    firsts = [line.split()[-1] for line in out.splitlines() if line.strip().startswith("first_shard:")]
    counts = {line.split()[-1] for line in out.splitlines() if line.strip().startswith("shard_count:")}
    assert firsts == ["0", "2"] and counts == {"4"}


# Every command that writes somewhere, pointed at a file where a folder must be, and at a folder no one may write in.
NOT_PERMITTED = "/sys/geofed-hpc-test"  # sysfs refuses new entries, also to root


@pytest.mark.parametrize(
    "args, setting",
    [
        (["launch", "run_dir={file}"], "run_dir"),
        (["launch", f"run_dir={NOT_PERMITTED}"], "run_dir"),
        (["launch", "site=slurm_local", "ps.address=127.0.0.1:9", "run_dir={file}/run"], "run_dir"),
        (["ps", "up", "ps.state_dir={file}"], "ps.state_dir"),
        (["ps", "up", f"ps.state_dir={NOT_PERMITTED}"], "ps.state_dir"),
        (["ps", "up", "ps.state_dir={tmp}/state", "ps.staging_dir={file}"], "ps.staging_dir"),
        (["ps", "init", "ps.ca_file={file}/ca.crt"], "ps.ca_file"),
        (["token", "issue", "site=osc", "ps.state_dir={file}"], "ps.state_dir"),
        (["data", "prepare", "run_dir={file}"], "run_dir"),
        (["export", "hf", "{tmp}", "{file}/out"], "export hf OUT"),
        (["site", "new", "mine", "--config-dir={tmp}/conf-as-file"], "site new"),
    ],
)
def test_every_path_a_command_writes_is_refused_in_one_line_naming_its_setting(
    args: list[str], setting: str, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("in the way")
    (tmp_path / "conf-as-file").mkdir()
    (tmp_path / "conf-as-file" / "site").write_text("a file where the site folder goes")
    filled = [a.format(file=tmp_path / "a-file", tmp=tmp_path) for a in args]
    result = run(filled, cwd=tmp_path, XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in result.stderr
    assert line.startswith(f"geofed-hpc: error: {setting}: cannot write in ")
    assert "a file is in the way" in line or "not permitted" in line or "permission denied" in line


def test_a_file_system_error_anywhere_else_is_one_line_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A path no early check covers (here: the report's picture) ends in one line naming it, not a traceback."""
    from geofed_hpc import cli
    from geofed_hpc.metrics import report

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(tmp_path / "report.png"))

    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "local-0.metrics.jsonl").write_text('{"sync/index": 1, "train/loss": 1.0, "time": 1}\n')
    monkeypatch.setattr(report, "write_report", refuse)
    import io
    from contextlib import redirect_stderr

    err = io.StringIO()
    with redirect_stderr(err):
        assert cli.main(["report", str(tmp_path)]) == 2
    assert (
        err.getvalue()
        == f"geofed-hpc: error: cannot use {tmp_path / 'report.png'}: permission denied: choose a folder you own\n"
    )


def test_a_malformed_site_file_is_one_line_naming_the_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "broken.yaml").write_text("name: broken\nexecutor: slurm\n  partition: [gpu\n")
    result = run(["launch", "site=broken", f"--config-dir={tmp_path}", "--cfg"], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"geofed-hpc: error: {tmp_path}/site/broken.yaml:3:12: not valid YAML (mapping values are not allowed here); "
        "fix that line of the file"
    )


@pytest.mark.parametrize(
    "text, where, problem",
    [
        ("name: mine\npartition gpu\naccount: x\n", "2:1", "could not find expected ':'"),  # not line 3
        ("name: 'mine\npartition: gpu\n", "1:7", "found unexpected end of stream"),  # where the quote opened
    ],
)
def test_a_yaml_error_names_the_line_that_holds_it(text: str, where: str, problem: str, tmp_path: Path) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "mine.yaml").write_text(text)
    result = run(["launch", "site=mine", f"--config-dir={tmp_path}", "--cfg"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(f"geofed-hpc: error: {tmp_path}/site/mine.yaml:{where}: not valid YAML ({problem})")


def test_a_list_item_indented_under_the_one_above_is_refused_not_merged(tmp_path: Path) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "mine.yaml").write_text(
        "name: mine\nexecutor: slurm\nembedded_ps: false\npartition: p\nsetup:\n  - module load cuda\n"
        "   - source ~/venv/bin/activate\n"
    )
    result = run(["launch", "site=mine", f"--config-dir={tmp_path}", "--cfg"], cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert f"{tmp_path}/site/mine.yaml:7: this `- ...` item is indented deeper than the one above it" in result.stderr
    assert "'module load cuda - source ~/venv/bin/activate'" in result.stderr


def test_run_dir_on_the_command_line_beats_the_site_files_root(tmp_path: Path) -> None:
    """osc's site file names a scratch root (site.run_dir); `run_dir=` typed on the command line wins over it, as the
    refusals that say "give a new run_dir=..." promise."""
    env = {"SCRATCH": str(tmp_path / "scratch"), "USER": "alice"}
    args = ["launch", "site=osc", "ps.address=vm.example.org:50051", "--dry-run", "--no-ps-check"]
    mine = run([*args, f"run_dir={tmp_path / 'mine'}"], cwd=tmp_path, **env)
    assert f"run directory {tmp_path / 'mine'}" in mine.stdout, mine.stdout + mine.stderr
    both = run([*args, f"run_dir={tmp_path / 'mine'}", f"site.run_dir={tmp_path / 'root'}"], cwd=tmp_path, **env)
    assert f"run directory {tmp_path / 'root'}/" in both.stdout, both.stdout + both.stderr  # site.run_dir typed too


def test_user_site_files_come_before_the_shipped_ones(tmp_path: Path) -> None:
    xdg, given = tmp_path / "xdg", tmp_path / "given"
    for root, partition in ((xdg / "geofed-hpc", "from-user-dir"), (given, "from-config-dir")):
        (root / "site").mkdir(parents=True)
        (root / "site" / "osc.yaml").write_text(
            f"name: osc\nexecutor: slurm\nembedded_ps: false\npartition: {partition}\n"
        )
    (xdg / "geofed-hpc" / "site" / "mine.yaml").write_text(
        "name: mine\nexecutor: slurm\nembedded_ps: false\npartition: p\n"
    )

    def partition(*args: str) -> str:
        out = run(["launch", *args, "--cfg"], cwd=tmp_path, XDG_CONFIG_HOME=str(xdg))
        assert out.returncode == 0, out.stderr
        return next(line.split()[-1] for line in out.stdout.splitlines() if line.strip().startswith("partition:"))

    assert partition("site=osc") == "from-user-dir"  # ~/.config/geofed-hpc/site/osc.yaml before the shipped osc
    assert partition("site=osc", f"--config-dir={given}") == "from-config-dir"  # --config-dir before both
    assert partition("site=mine") == "p" and partition("site=tacc") != "p"  # new sites, and the shipped ones still
    help_text = run(["--help"], cwd=tmp_path, XDG_CONFIG_HOME=str(xdg)).stdout
    groups = help_text.split("config groups", 1)[1]
    site_line = next(line for line in groups.splitlines() if line.startswith("  site "))
    assert "mine," in site_line.split()
    assert f"site=mine: {xdg}/geofed-hpc/site/mine.yaml" in help_text


def test_site_new_writes_a_site_file_that_launch_finds(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    made = run(["site", "new", "mycluster"], cwd=tmp_path, **env)
    assert made.returncode == 0, made.stderr
    path = tmp_path / "xdg" / "geofed-hpc" / "site" / "mycluster.yaml"
    assert f"wrote {path} (from " in made.stdout and "geofed-hpc site check site=mycluster" in made.stdout
    assert "name: mycluster" in path.read_text() and "partition: gpu" in path.read_text()
    cfg = run(["launch", "site=mycluster", "--cfg"], cwd=tmp_path, **env)
    assert cfg.returncode == 0 and "name: mycluster" in cfg.stdout and "executor: slurm" in cfg.stdout
    again = run(["site", "new", "mycluster"], cwd=tmp_path, **env)
    assert again.returncode == 2 and "exists; edit it, or pass --force" in again.stderr
    copy = run(["site", "new", "osc"], cwd=tmp_path, **env)  # a shipped site's name: a copy of it to edit
    assert copy.returncode == 0 and "account: PAS0000" in (path.parent / "osc.yaml").read_text()


def test_status_without_a_ps_address_says_so_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    from geofed_hpc.cli import main
    from geofed_hpc.rpc.client import PSClient

    result = run(["status", f"run_dir={tmp_path}"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("geofed-hpc: error: ps.address: say where the parameter server listens")

    def dial(*args: object, **kwargs: object) -> None:
        raise AssertionError("status dialled 127.0.0.1:0 (40 s of retries) before saying what is missing")

    monkeypatch.setattr(PSClient, "connect", dial)  # at once: without dialling, whatever this machine's speed
    assert main(["status", f"run_dir={tmp_path}"]) == 2
    assert "ps.address: say where the parameter server listens" in capsys.readouterr().err


def test_the_same_site_twice_is_refused(tmp_path: Path) -> None:
    result = run(
        ["launch", "site=osc,osc", "ps.address=vm.example.org:50051", "--dry-run", "--no-ps-check"], cwd=tmp_path
    )
    assert result.returncode == 2 and "\n" not in result.stderr.strip()
    assert "site: osc is given twice in site=osc,osc; its jobs would share one checkpoint folder" in result.stderr


def test_launching_again_into_a_finished_run_is_refused_naming_what_to_change(tmp_path: Path) -> None:
    from geofed_hpc.ckpt import CheckpointStore
    from geofed_hpc.cli import compose_config
    from geofed_hpc.client.checkpoints import model_shape

    cfg, _ = compose_config([f"run_dir={tmp_path}", "train.max_syncs=3"])
    for name in ("local-0", "local-1"):
        meta = {"version": 3, "syncs": 3, "model": model_shape(cfg)}
        CheckpointStore(tmp_path / "sites" / name / "ckpt", prefix="site").save(3, {}, meta)
    result = run(["launch", f"run_dir={tmp_path}", "train.max_syncs=3"], cwd=tmp_path)
    assert result.returncode == 2 and "\n" not in result.stderr.strip()
    assert (
        f"local-0 finished already in {tmp_path} (3 syncs of train.max_syncs=3): raise train.max_syncs" in result.stderr
    )
    other = run(["launch", f"run_dir={tmp_path}", "model.d_model=32"], cwd=tmp_path)
    assert other.returncode == 2 and "is of another model (model.d_model=" in other.stderr
    assert not (tmp_path / "ps").exists()  # refused before the embedded PS started


def test_a_local_dry_run_checks_the_device_the_sites_would_use(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch sees a GPU: train.device=cuda is fine here")
    result = run(["launch", "site=local", "train.device=cuda", "--dry-run"], cwd=tmp_path)
    assert result.returncode == 2 and "# error    device       train.device=cuda:" in result.stdout
    assert result.stderr.startswith("geofed-hpc: error: train.device=cuda: this torch") and "CPU-only" in result.stderr
