"""TLS by default: `ps init` certificates, then real gRPC on 127.0.0.1 with right, wrong and missing credentials."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from geofed_hpc.cli import main
from geofed_hpc.config import PSConfig, RunConfig
from geofed_hpc.errors import ConfigError, UnavailableError
from geofed_hpc.ps.app import ParameterServer
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from tests.conftest import ps_config


def ps_init(where: Path, *extra: str) -> int:
    return main(
        [
            "ps",
            "init",
            f"ps.ca_file={where}/ca.crt",
            f"ps.cert_file={where}/server.crt",
            f"ps.key_file={where}/server.key",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two federations made by `ps init`: ours (with site osc) and a stranger's (with site rogue)."""
    ours, theirs = tmp_path_factory.mktemp("ours"), tmp_path_factory.mktemp("theirs")
    assert ps_init(ours, "ps.tls_names=[vm.example.org,192.0.2.7]", "ps.tls_sites=[osc]") == 0
    assert ps_init(theirs, "ps.tls_sites=[rogue]") == 0
    return {"ours": ours, "theirs": theirs}


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def tls_client(ca: Path, site: Path | None = None, **overrides: Any) -> PSConfig:
    if site is not None:
        overrides |= {"client_cert_file": f"{site}.crt", "client_key_file": f"{site}.key"}
    return ps_config(insecure=False, ca_file=str(ca), rpc_timeout="3s", **overrides)


@contextmanager
def tls_ps(pki: Path, mutual: bool = False) -> Iterator[ParameterServer]:
    extra = {"client_ca_file": str(pki / "ca.crt")} if mutual else {}
    cfg = ps_config(insecure=False, cert_file=str(pki / "server.crt"), key_file=str(pki / "server.key"), **extra)
    server = ParameterServer(replace(RunConfig(), ps=cfg))
    try:
        yield server
    finally:
        server.stop()


def test_ps_init_writes_a_ca_a_server_and_a_site_certificate_with_private_keys_0600(pki: dict[str, Path]) -> None:
    ours = pki["ours"]
    for key in (ours / "ca.key", ours / "server.key", ours / "sites" / "osc.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    ca, server, site = load(ours / "ca.crt"), load(ours / "server.crt"), load(ours / "sites" / "osc.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    server.verify_directly_issued_by(ca)
    site.verify_directly_issued_by(ca)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"vm.example.org", "localhost"} <= set(sans.get_values_for_type(x509.DNSName))
    assert {"192.0.2.7", "127.0.0.1"} <= {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    assert ExtendedKeyUsageOID.SERVER_AUTH in server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CLIENT_AUTH in site.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert site.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "osc"
    assert timedelta(days=365) < server.not_valid_after_utc - server.not_valid_before_utc < timedelta(days=900)


def test_ps_init_refuses_to_overwrite_keys_unless_asked(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert ps_init(tmp_path) == 0
    ca_key, server_key = (tmp_path / "ca.key").read_bytes(), (tmp_path / "server.key").read_bytes()
    capsys.readouterr()
    assert ps_init(tmp_path) == 0  # run again: nothing to do is success
    assert "nothing to do: every file exists" in capsys.readouterr().out
    assert (tmp_path / "server.key").read_bytes() == server_key
    assert ps_init(tmp_path, "ps.tls_names=[vm.example.org]") == 2  # a name the kept certificate lacks
    err = capsys.readouterr().err
    assert "ps.tls_names: the server certificate" in err and "does not name vm.example.org" in err
    assert "ps.tls_overwrite=true" in err
    assert ps_init(tmp_path, "ps.tls_sites=[tacc]") == 0  # a new site certificate; the server's is kept
    assert (tmp_path / "server.key").read_bytes() == server_key and (tmp_path / "sites" / "tacc.key").exists()
    assert ps_init(tmp_path, "ps.tls_overwrite=true") == 0
    assert (tmp_path / "server.key").read_bytes() != server_key
    assert (tmp_path / "ca.key").read_bytes() == ca_key  # the CA is never replaced: site certificates stay valid
    (tmp_path / "server.crt").unlink()
    capsys.readouterr()
    assert ps_init(tmp_path) == 2
    assert f"{tmp_path / 'server.key'} exists but {tmp_path / 'server.crt'} does not" in capsys.readouterr().err
    assert ps_init(tmp_path, "ps.tls_overwrite=true") == 0
    for name in ("ca.crt", "ca.key"):  # a new CA: certificates of the old one are refused, not kept silently
        (tmp_path / name).unlink()
    assert ps_init(tmp_path) == 2
    assert "was not issued by the CA" in capsys.readouterr().err
    assert not (tmp_path / "ca.key").exists()  # nothing written when refusing


def test_ps_init_takes_a_single_name_without_brackets_as_one_name(tmp_path: Path) -> None:
    assert ps_init(tmp_path, "ps.tls_names=vm.example.org", "ps.tls_sites=osc") == 0
    sans = load(tmp_path / "server.crt").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = sans.get_values_for_type(x509.DNSName)
    assert "vm.example.org" in names and all(len(name) > 1 for name in names), names
    assert sorted(p.name for p in (tmp_path / "sites").glob("*.crt")) == ["osc.crt"]


def test_a_site_with_the_federation_ca_joins_over_tls(pki: dict[str, Path]) -> None:
    with tls_ps(pki["ours"]) as ps, PSClient(tls_client(pki["ours"] / "ca.crt"), ps.address) as client:
        client.connect(timedelta(seconds=5))
        reply = client.join(m.JoinRequest("osc-0"))
        assert reply.session_id and client.status().sites[0].site == "osc-0"
        assert client._diagnosis() == ""  # a working handshake is not blamed


def test_a_site_trusting_another_ca_is_refused_naming_the_certificate(pki: dict[str, Path]) -> None:
    cfg = tls_client(pki["theirs"] / "ca.crt")
    with tls_ps(pki["ours"]) as ps, PSClient(cfg, ps.address) as client:
        with pytest.raises(UnavailableError, match="does not verify against ps.ca_file.*CERTIFICATE_VERIFY_FAILED"):
            client.join(m.JoinRequest("osc-0"))
        assert ps.logic.core.sessions.sessions == {}


def test_a_plaintext_site_against_a_tls_server_fails_and_is_told_to_use_tls(pki: dict[str, Path]) -> None:
    cfg = ps_config(rpc_timeout="3s")
    with tls_ps(pki["ours"]) as ps, PSClient(cfg, ps.address) as client:
        with pytest.raises(UnavailableError, match=f"{ps.address} speaks TLS but this client is plaintext"):
            client.join(m.JoinRequest("osc-0"))
        with pytest.raises(UnavailableError, match="speaks TLS but this client is plaintext.*attempts"):
            client.connect(timedelta(seconds=1))
        assert ps.logic.core.sessions.sessions == {}


def test_mutual_tls_refuses_sites_without_a_certificate_from_the_federation_ca(pki: dict[str, Path]) -> None:
    ca = pki["ours"] / "ca.crt"
    with tls_ps(pki["ours"], mutual=True) as ps:
        for cfg, why in [
            (tls_client(ca), "requires a client certificate"),
            (tls_client(ca, pki["theirs"] / "sites" / "rogue"), "refused this site's certificate"),
        ]:
            with PSClient(cfg, ps.address) as client, pytest.raises(UnavailableError, match=f"{ps.address}.*{why}"):
                client.join(m.JoinRequest("rogue-0"))
        assert ps.logic.core.sessions.sessions == {}
        with PSClient(tls_client(ca, pki["ours"] / "sites" / "osc"), ps.address) as client:
            assert client.join(m.JoinRequest("osc-0")).session_id


def test_tls_settings_are_checked_and_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ps.client_cert_file"):
        PSConfig(insecure=False, ca_file="ca.crt", client_cert_file="osc.crt")
    with pytest.raises(ConfigError, match="ps.client_ca_file: mutual TLS needs TLS"):
        PSConfig(insecure=True, client_ca_file="ca.crt")
    with pytest.raises(ConfigError, match="ps.tls_names"):
        PSConfig(tls_names=["bad name"])
    with pytest.raises(ConfigError, match=r"ps.ca_file: file .*missing.crt does not exist"):
        PSClient(tls_client(tmp_path / "missing.crt"), "127.0.0.1:1")


def test_ps_up_with_a_key_that_is_not_its_certificates_names_both_files(pki: dict[str, Path], tmp_path: Path) -> None:
    ours, theirs = pki["ours"], pki["theirs"]
    cfg = ps_config(insecure=False, cert_file=str(ours / "server.crt"), key_file=str(theirs / "server.key"))
    with pytest.raises(ConfigError) as info:
        ParameterServer(replace(RunConfig(), ps=cfg))
    text = str(info.value)
    assert text.startswith(f"ps.key_file: {theirs / 'server.key'} is not the private key of ps.cert_file")
    assert str(ours / "server.crt") in text and "in use" not in text
    (tmp_path / "junk.crt").write_text("not a certificate")
    junk = ps_config(insecure=False, cert_file=str(tmp_path / "junk.crt"), key_file=str(ours / "server.key"))
    with pytest.raises(ConfigError, match=r"ps.cert_file: .*junk.crt is not a PEM certificate"):
        ParameterServer(replace(RunConfig(), ps=junk))


def test_tls_mistakes_on_the_command_line_are_one_line_without_grpcs_own(pki: dict[str, Path]) -> None:
    import subprocess
    import sys

    def status(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "geofed_hpc.cli", "status", f"ps.address={ps.address}", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    with tls_ps(pki["ours"]) as ps:
        plaintext = status()
        wrong_ca = status("ps.insecure=false", f"ps.ca_file={pki['theirs'] / 'ca.crt'}")
        right = status("ps.insecure=false", f"ps.ca_file={pki['ours'] / 'ca.crt'}")
    assert plaintext.returncode == 2 and plaintext.stderr.count("\n") == 1, plaintext.stderr
    assert f"{ps.address} speaks TLS but this client is plaintext (ps.insecure=true)" in plaintext.stderr
    assert wrong_ca.returncode == 2 and wrong_ca.stderr.count("\n") == 1, wrong_ca.stderr
    assert "does not verify against ps.ca_file" in wrong_ca.stderr
    assert right.returncode == 0 and "initialized False" in right.stdout, right.stderr
