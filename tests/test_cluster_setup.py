"""A newcomer on a login node: the README's cluster steps, a read-only folder, and the site job's line per sync."""

from __future__ import annotations

import errno
import io
import re
import shlex
from contextlib import redirect_stderr
from pathlib import Path
from types import SimpleNamespace

import pytest

from geofed_hpc.cli import compose_config, main

REPO = Path(__file__).resolve().parents[1]


def _section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def _commands(block: str, variables: dict[str, str]) -> list[list[str]]:
    """The geofed-hpc command lines of a shell block, $VARIABLES set by it expanded, comments dropped."""
    lines = []
    for raw in block.splitlines():
        line = raw.split(" #", 1)[0].strip()
        assignment = re.fullmatch(r"""([A-Z_]+)=(["'])(.*)\2""", line)
        if assignment:
            variables[assignment.group(1)] = assignment.group(3)
            continue
        for part in line.split("&&"):
            if part.strip().startswith("geofed-hpc "):
                expanded = re.sub(r"\$([A-Z_]+)", lambda m: variables.get(m.group(1), m.group(0)), part)
                lines.append(shlex.split(expanded)[1:])
    return lines


def test_readme_on_a_cluster_goes_from_git_clone_to_a_launch_with_the_ca_and_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "corpus").mkdir()  # the user's corpus, as the README's `data.source=~/corpus` names it
    (tmp_path / "corpus" / "a.txt").write_text("In the beginning.\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    section = _section("On a cluster")
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    steps = ["git clone", "python -m venv", "download.pytorch.org/whl/cu", "pip install -e", "site new", "site check"]
    where = [block.find(step) for step in [*steps, "launch site="]]
    assert -1 not in where and where == sorted(where), dict(zip([*steps, "launch"], where, strict=True))
    clone = next(line for line in block.splitlines() if "git clone" in line)
    install = next(line for line in block.splitlines() if line.startswith("pip install -e"))
    assert "$HOME" in clone and "$HOME" in install  # the editable install runs from storage the compute nodes see
    launches = [c for c in _commands(block, {}) if c[:1] == ["launch"] or c[:2] == ["site", "check"]]
    assert len(launches) >= 3
    for words in launches:
        overrides = [w for w in words if "=" in w and not w.startswith("-")]
        assert {"ps=cloud", "site=osc"} <= set(overrides), words
        for key in ("ps.address=", "ps.ca_file=", "site.token="):
            assert any(w.startswith(key) for w in overrides), (key, words)
        cfg, _ = compose_config(overrides)  # the settings as written compose
        assert not cfg.ps.insecure and cfg.ps.ca_file == "~/geofed/ca.crt" and cfg.site.token == "TOKEN"


def test_readme_cluster_launch_lines_carry_ps_cloud_ca_and_token() -> None:
    """Launches carry the PS's settings; a login node's `status site=osc` after them needs none: it dials the PS as
    launch recorded (tests/test_preflight_ps.py shows that it does)."""
    block = _section("On real clusters").split("```bash", 1)[1].split("```", 1)[0]
    cluster = _section("On a cluster").split("```bash", 1)[1].split("```", 1)[0]
    for commands in (_commands(block, {}), _commands(cluster, {})):
        launches = [i for i, c in enumerate(commands) if c[:1] == ["launch"]]
        statuses = [i for i, c in enumerate(commands) if c[:1] == ["status"] and "site=osc" in c]
        assert launches and statuses and min(launches) < min(statuses)
        for i in launches:
            words = commands[i]
            assert "ps=cloud" in words and any(w.startswith("ps.ca_file=") for w in words), words
            assert any(w.startswith("site.token=") for w in words), words


@pytest.mark.parametrize(
    "args, setting",
    [
        (["token", "issue", "site=osc", "ps.state_dir={tmp}/state"], "ps.state_dir"),
        (["data", "prepare", "run_dir={tmp}/run"], "run_dir"),
        (["site", "new", "mine", "--config-dir={tmp}/conf"], "site new"),
    ],
)
def test_a_read_only_filesystem_is_refused_in_one_line_naming_the_setting(
    args: list[str], setting: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from geofed_hpc import paths

    (tmp_path / "conf").mkdir()

    def read_only(dir: str, prefix: str) -> tuple[int, str]:
        raise OSError(errno.EROFS, "Read-only file system", f"{dir}/{prefix}x")

    monkeypatch.setattr(paths.tempfile, "mkstemp", read_only)
    err = io.StringIO()
    with redirect_stderr(err):
        assert main([a.format(tmp=tmp_path) for a in args]) == 2
    folder = tmp_path / {"ps.state_dir": "state", "run_dir": "run/data", "site new": "conf/site"}[setting]
    assert err.getvalue() == (
        f"geofed-hpc: error: {setting}: cannot write in {folder}: a read-only filesystem: choose a writable one "
        "($SCRATCH, $HOME)\n"
    )


def test_a_site_job_logs_one_line_per_sync_with_version_loss_tokens_bytes_and_seconds(
    warnings_log: pytest.LogCaptureFixture,
) -> None:
    from geofed_hpc.client.trainer import SiteTrainer

    trainer = SimpleNamespace(
        name="osc-0",
        progress=SimpleNamespace(syncs=4, tokens_seen=8192),
        sync=SimpleNamespace(version=7, tokens_per_step=lambda: 256),
    )
    SiteTrainer._log_sync(trainer, 3, 2.5, 2.25, 3 * 2**20, 0.5, 1.5, 0.25)  # type: ignore[arg-type]
    SiteTrainer._log_sync(trainer, 3, 2.5, float("nan"), 0, 0.5, 1.5, 0.5)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in warnings_log.records if r.getMessage().startswith("osc-0: sync")]
    assert lines == [
        "osc-0: sync 4: version 7, 3 steps, train loss 2.5000, val loss 2.2500, 768 tokens (1536 tokens/s, 8192 in "
        "all), sent 3.00 MiB, 1.5s (0.5s training), goodput 0.25",
        "osc-0: sync 4: version 7, 3 steps, train loss 2.5000, 768 tokens (1536 tokens/s, 8192 in all), sent 0.00 MiB, "
        "1.5s (0.5s training), goodput 0.50",
    ]


def test_a_home_path_the_shell_leaves_unexpanded_is_taken_as_written() -> None:
    """`ps.ca_file=~/geofed/ca.crt` reaches the command with its `~` (the shell expands it only at a word's start),
    which Hydra's grammar refuses; each setting's reader expands it."""
    cfg, _ = compose_config(
        ["ps.ca_file=~/geofed/ca.crt", "data.tokenizer=~/Llama-3.2-1B/tokenizer.json", "++model.init_from=~/m"]
    )
    assert (cfg.ps.ca_file, cfg.data.tokenizer) == ("~/geofed/ca.crt", "~/Llama-3.2-1B/tokenizer.json")
    assert cfg.model.init_from == "~/m"
    err = io.StringIO()
    with redirect_stderr(err):
        assert main(["launch", "site=osc", "ps.address=vm:50051", "ps.client_cert_file=~/x'y", "--cfg"]) == 2
    assert err.getvalue().startswith("geofed-hpc: error: cannot parse override") and err.getvalue().count("\n") == 1
