"""`launch` and `site check` dial the PS as the jobs will before anything is submitted: every way a job could not
join is one line and exit code 2, against a real `ps up` over TLS and mutual TLS."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from geofed_hpc.ps.tokens import TokenFile, tokens_path
from tests import test_ps_edge
from tests.dist_util import free_port
from tests.test_launch_slurm import LOGIN_ENV, LOGIN_SLURM, _fake_slurm
from tests.test_ps_edge import EdgePS
from tests.test_tls import ps_init

CLI = [sys.executable, "-m", "geofed_hpc.cli"]
edge = test_ps_edge.edge  # the fixture: a real `ps up` over TLS and over mutual TLS, with tokens for osc and tacc


def site_args(edge: EdgePS, site: str = "osc", token: str | None = None, cert: str = "") -> list[str]:
    """A Slurm site's settings as its user gives them: the PS's address and CA, the site's token (and under mutual
    TLS the certificate `ps init` issued, `cert` or the site's own)."""
    pki = edge.where / "pki"
    args = [
        f"site={site}",
        "ps=cloud",
        f"ps.address=127.0.0.1:{edge.port}",
        f"ps.ca_file={pki / 'ca.crt'}",
        f"site.token={edge.tokens.get(site, '') if token is None else token}",
    ]
    if edge.mutual:
        name = cert or site
        args += [
            f"ps.client_cert_file={pki / 'sites' / f'{name}.crt'}",
            f"ps.client_key_file={pki / 'sites' / f'{name}.key'}",
        ]
    return args


def check(args: list[str], where: Path, *flags: str) -> subprocess.CompletedProcess:
    """`geofed-hpc site check` on a login node whose sinfo and sacctmgr answer for osc."""
    env = {**os.environ, **LOGIN_ENV, **_fake_slurm(where / "bin", *LOGIN_SLURM)}
    return subprocess.run(
        CLI + ["site", "check", *args, *flags], cwd=where, capture_output=True, text=True, timeout=120, env=env
    )


def refused(result: subprocess.CompletedProcess, *words: str) -> str:
    """The one error line of a refused check, which must name each of `words`."""
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("geofed-hpc: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    line = errors[0]
    assert all(w in line for w in words), line
    assert "ready to launch" not in result.stdout
    return line


def test_a_site_that_can_join_is_ready_and_its_token_is_not_used_up(edge: EdgePS, tmp_path: Path) -> None:
    for _ in range(2):  # shown twice: a check consumes nothing
        ok = check(site_args(edge), tmp_path)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert f"127.0.0.1:{edge.port} answers (TLS, certificate verified; token accepted" in ok.stdout
        assert ok.stdout.splitlines()[-1] == "site osc: ready to launch"


def test_tls_mistakes_are_errors_naming_the_setting(edge: EdgePS, tmp_path: Path) -> None:
    not_a_cert = tmp_path / "ca.crt"
    not_a_cert.write_text("this is not a certificate\n")
    args = site_args(edge)
    with_ca = [a if not a.startswith("ps.ca_file=") else f"ps.ca_file={not_a_cert}" for a in args]
    refused(check(with_ca, tmp_path), "ps.ca_file")
    stranger = tmp_path / "stranger"
    assert ps_init(stranger) == 0
    other_ca = [a if not a.startswith("ps.ca_file=") else f"ps.ca_file={stranger / 'ca.crt'}" for a in args]
    refused(check(other_ca, tmp_path), "does not verify against ps.ca_file")
    plain = [a for a in args if not a.startswith(("ps.client_", "ps.ca_file="))]
    refused(check([*plain, "ps.insecure=true"], tmp_path), "speaks TLS but this client is plaintext")


def test_a_ps_that_does_not_answer_is_an_error_unless_told_it_comes_later(edge: EdgePS, tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    args = [a if not a.startswith("ps.address=") else f"ps.address={dead}" for a in site_args(edge)]
    refused(check(args, tmp_path), f"nothing answers at {dead}", "--no-ps-check")
    later = check(args, tmp_path, "--no-ps-check")
    assert later.returncode == 0, later.stderr
    assert "not probed: --no-ps-check" in later.stdout
    # an address list is dialled address by address: a dead second PS of a group is named too
    both = [a if not a.startswith("ps.address=") else f"ps.address=[127.0.0.1:{edge.port},{dead}]" for a in args]
    refused(check(both, tmp_path), f"nothing answers at {dead}")


def test_tokens_the_ps_would_refuse_are_errors(edge: EdgePS, tmp_path: Path) -> None:
    refused(check(site_args(edge, token=""), tmp_path), "site.token", "Status needs a credential")
    refused(check(site_args(edge, token="gft_0123456789abcdef_nope"), tmp_path), "site.token", "refused")
    refused(check(site_args(edge, token=edge.tokens["tacc"]), tmp_path), "enrollment token of site 'tacc', not 'osc'")
    tokens = TokenFile(tokens_path(str(edge.where / "state")))
    spare, record = tokens.issue("osc", timedelta(days=1))
    assert check(site_args(edge, token=spare), tmp_path).returncode == 0
    tokens.revoke(token_id=record.id)
    refused(check(site_args(edge, token=spare), tmp_path), "site.token", "revoked")


def test_a_client_certificate_of_another_site_is_an_error(edge: EdgePS, tmp_path: Path) -> None:
    if not edge.mutual:
        pytest.skip("client certificates are bound to sites under mutual TLS only")
    refused(check(site_args(edge, cert="tacc"), tmp_path), "ps.client_cert_file", "issued for tacc, not site osc")


def test_launch_refuses_before_sbatch(edge: EdgePS, tmp_path: Path) -> None:
    """`launch` of a Slurm site whose token the PS refuses submits nothing (sbatch here records any call)."""
    bin_dir = tmp_path / "bin"
    env = {**os.environ, **LOGIN_ENV, **_fake_slurm(bin_dir, *LOGIN_SLURM)}
    called = tmp_path / "sbatch-called"
    for name in ("sbatch", "srun"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "$0 $*" >> {called}\nexit 1\n')
        (bin_dir / name).chmod(0o755)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("In the beginning was the word.\n" * 100)
    args = [*site_args(edge, token=edge.tokens["tacc"]), f"site.run_dir={tmp_path / 'run'}", f"data.source={corpus}"]
    result = subprocess.run(CLI + ["launch", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    refused(result, "enrollment token of site 'tacc', not 'osc'")
    assert not called.exists(), called.read_text()


def test_status_of_a_launched_site_dials_the_ps_as_its_jobs_do(edge: EdgePS, tmp_path: Path) -> None:
    """`status site=osc` alone, after a launch with ps=cloud, the address, CA, token (and client certificate): what
    launch.json recorded is used, so the README's `status site=osc` works as written."""
    from geofed_hpc.cli import compose_config
    from geofed_hpc.config import to_dict
    from geofed_hpc.launch.executor import site_run_dir
    from geofed_hpc.launch.manifest import JobRecord, record_jobs

    launched, _ = compose_config([*site_args(edge), f"site.run_dir={tmp_path / 'runs'}"])
    run_dir = site_run_dir(launched)
    job = JobRecord("osc-0", "5", "osc", "slurm", str(tmp_path / "o"), str(tmp_path / "e"))
    record_jobs(run_dir, launched.federation, launched.ps.address, "osc", to_dict(launched), [job])
    env = {**os.environ, **LOGIN_ENV}
    status = subprocess.run(
        CLI + ["status", "site=osc", f"site.run_dir={tmp_path / 'runs'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert status.returncode == 0, status.stdout + status.stderr
    assert "osc-0" in status.stdout and "initialized True" in status.stdout
    with edge.client("tacc") as client:
        edge.joined(client, "tacc-7")  # joined, never pushed: no loss to show yet
    time.sleep(3.5)  # nobody heartbeats: every site is quiet after 3 heartbeat intervals of 1s
    quiet = subprocess.run(
        CLI + ["status", "site=osc", f"site.run_dir={tmp_path / 'runs'}", "ps.heartbeat_interval=1s"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    rows = {line.split()[0]: line.split() for line in quiet.stdout.splitlines() if line.startswith(("osc-", "tacc-"))}
    assert rows["tacc-7"][1] == "quiet" and rows["tacc-7"][-3] == "-", quiet.stdout  # loss: none before a push
    assert rows["osc-0"][1] == "quiet" and rows["osc-0"][-3] != "-", quiet.stdout
    wrong = subprocess.run(
        CLI + ["status", "site=osc", f"site.run_dir={tmp_path / 'runs'}", "site.token=gft_0123456789abcdef_no"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    refused(wrong, "refused")  # what the command line sets still wins over the record
