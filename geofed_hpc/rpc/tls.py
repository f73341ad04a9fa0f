"""The federation's certificates (`geofed-hpc ps init`): a CA, the PS server certificate, per-site client ones."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import ssl
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from geofed_hpc.config import PSConfig
from geofed_hpc.errors import ConfigError, UnavailableError
from geofed_hpc.log import logger
from geofed_hpc.rpc.proxy import open_path

DEFAULT_DIR = "~/.geofed/ps"
CA_VALIDITY = timedelta(days=3650)
LEAF_VALIDITY = timedelta(days=825)  # the longest leaf lifetime common TLS clients accept
CLOCK_SKEW = timedelta(hours=1)  # backdate notBefore: site clocks are not all in step with the VM's
_DNS = re.compile(r"^(?=.{1,253}$)(\*\.)?([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*[A-Za-z0-9-]{1,63}$")

Key = ec.EllipticCurvePrivateKey


@dataclass
class TLSFiles:
    """Where `ps init` writes; the CA key sits next to the CA certificate."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    sites_dir: Path

    def site(self, name: str) -> tuple[Path, Path]:
        return self.sites_dir / f"{name}.crt", self.sites_dir / f"{name}.key"


@dataclass
class InitResult:
    files: TLSFiles
    names: list[str]
    created: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)


def tls_files(cfg: PSConfig) -> TLSFiles:
    """ps.ca_file / ps.cert_file / ps.key_file, each defaulting to ~/.geofed/ps/{ca.crt,server.crt,server.key}."""
    base = Path(DEFAULT_DIR).expanduser()
    ca = Path(cfg.ca_file).expanduser() if cfg.ca_file else base / "ca.crt"
    cert = Path(cfg.cert_file).expanduser() if cfg.cert_file else base / "server.crt"
    key = Path(cfg.key_file).expanduser() if cfg.key_file else base / "server.key"
    return TLSFiles(ca, ca.with_suffix(".key"), cert, key, ca.parent / "sites")


def server_names(cfg: PSConfig) -> list[str]:
    """SANs for the server certificate: ps.tls_names, ps.address's host, ps.host, this machine, loopback."""
    names = list(cfg.tls_names)
    for address in cfg.address.split(",") if cfg.address else []:
        names.append(address.rsplit(":", 1)[0])
    if cfg.host not in ("", "0.0.0.0", "::", "[::]"):
        names.append(cfg.host)
    names += [socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1", "::1"]
    out: list[str] = []
    for name in names:
        name = name.strip("[]")
        if name and name not in out and (_is_ip(name) or _DNS.match(name)):
            out.append(name)
    return out


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = [
        x509.IPAddress(ipaddress.ip_address(n)) if _is_ip(n) else x509.DNSName(n) for n in names
    ]
    return x509.SubjectAlternativeName(entries)


def _name(common_name: str, unit: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "geofed-hpc"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _builder(subject: x509.Name, issuer: x509.Name, key: Key, validity: timedelta) -> x509.CertificateBuilder:
    now = datetime.now(timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + validity)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )


def new_ca(federation: str) -> tuple[x509.Certificate, Key]:
    """A self-signed CA that signs only end-entity certificates (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = _name(f"{federation} federation CA", "ca")
    cert = (
        _builder(subject, subject, key, CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # keyCertSign, cRLSign
        .sign(key, hashes.SHA256())
    )
    return cert, key


def issue(
    ca_cert: x509.Certificate, ca_key: Key, common_name: str, names: list[str], server: bool
) -> tuple[x509.Certificate, Key]:
    """An end-entity certificate signed by the CA: serverAuth with `names` as SANs, or clientAuth."""
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        _builder(_name(common_name, "server" if server else "site"), ca_cert.subject, key, LEAF_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, True, False, False, False, False), critical=True
        )  # digitalSignature, keyAgreement (ECDHE)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if names:
        builder = builder.add_extension(_san(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write through a temporary file, then rename: a crash never leaves half a key behind."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # the umask never loosens a private key
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_pair(cert: x509.Certificate, key: Key, cert_path: Path, key_path: Path) -> None:
    """Certificate 0644, private key 0600 (unencrypted PEM: the PS must start unattended)."""
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write(key_path, pem_key, 0o600)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def load_pair(cert_path: Path, key_path: Path) -> tuple[x509.Certificate, Key]:
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot read the CA {cert_path} / {key_path}: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise ConfigError(f"{key_path} is not the private key of {cert_path}: restore the pair or move both away")
    return cert, key


def check_key_pair(cert_pem: bytes, key_pem: bytes, cert_file: str, key_file: str) -> None:
    """The PS's TLS files before they are served: ConfigError naming them when either does not parse or the key is
    not the certificate's (gRPC would only fail to bind, which reads like a port in use)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise ConfigError(f"ps.cert_file: {cert_file} is not a PEM certificate ({exc})") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"ps.key_file: {key_file} is not an unencrypted PEM private key ({exc})") from None
    if key.public_key() != cert.public_key():
        raise ConfigError(
            f"ps.key_file: {key_file} is not the private key of ps.cert_file {cert_file}: give the pair `ps init` "
            "wrote together (server.crt with server.key), or issue a new one with `ps init ps.tls_overwrite=true`"
        )


def _state(cert: Path, key: Path, what: str, overwrite: bool) -> str:
    """'missing', 'present' (keep it) or 'replace'; a half pair is an error unless overwriting."""
    have = cert.exists(), key.exists()
    if not any(have) or overwrite:
        return "replace" if any(have) else "missing"
    if not all(have):
        lone, absent = (cert, key) if have[0] else (key, cert)
        raise ConfigError(
            f"{what}: {lone} exists but {absent} does not; move {lone} away or rerun with ps.tls_overwrite=true"
        )
    return "present"


def init_pki(cfg: PSConfig, federation: str) -> InitResult:
    """Create what is missing; never replace an existing key unless ps.tls_overwrite=true (the CA: never)."""
    files = tls_files(cfg)
    names = server_names(cfg)
    result = InitResult(files, names)
    wanted = [("server", files.server_cert, files.server_key)]
    wanted += [(site, *files.site(site)) for site in cfg.tls_sites]
    states = [_state(c, k, f"the {who} certificate", cfg.tls_overwrite) for who, c, k in wanted]
    if _state(files.ca_cert, files.ca_key, "the CA", overwrite=False) == "present":
        ca_cert, ca_key = load_pair(files.ca_cert, files.ca_key)
        result.kept.append(files.ca_cert)
    else:
        ca_cert, ca_key = new_ca(federation)
    for (who, cert_path, _), state in zip(wanted, states, strict=True):
        if state == "present" and not _issued_by(cert_path, ca_cert):
            raise ConfigError(
                f"{cert_path} was not issued by the CA {files.ca_cert}; rerun with ps.tls_overwrite=true to "
                f"issue a new {who} certificate from it"
            )
    if files.ca_cert not in result.kept:
        write_pair(ca_cert, ca_key, files.ca_cert, files.ca_key)
        result.created += [files.ca_cert, files.ca_key]
    for (who, cert_path, key_path), state in zip(wanted, states, strict=True):
        if state == "present":
            result.kept.append(cert_path)
            continue
        if who == "server":
            cert, key = issue(ca_cert, ca_key, names[0], names, server=True)
        else:
            cert, key = issue(ca_cert, ca_key, who, [], server=False)
        write_pair(cert, key, cert_path, key_path)
        result.created += [cert_path, key_path]
        logger.debug("%s %s certificate %s", "replaced" if state == "replace" else "wrote", who, cert_path)
    if files.server_cert in result.kept:
        named = set(_san_names(files.server_cert))
        missing = [n for n in names if n not in named]
        if missing:
            raise ConfigError(
                f"ps.tls_names: the server certificate {files.server_cert} does not name {', '.join(missing)} (it "
                f"names {', '.join(sorted(named)) or 'nothing'}); rerun with ps.tls_overwrite=true to issue it anew "
                "from the same CA"
            )
    return result


def _san_names(path: Path) -> list[str]:
    """The DNS names and IP addresses a certificate is for."""
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    try:
        return [str(v.value) for v in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value]
    except x509.ExtensionNotFound:
        return []


def _issued_by(cert_path: Path, ca: x509.Certificate) -> bool:
    try:
        x509.load_pem_x509_certificate(cert_path.read_bytes()).verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def describe(path: Path) -> str:
    """One line: subject CN, SANs, expiry."""
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        alt = ", ".join(str(v.value) for v in san)
    except x509.ExtensionNotFound:
        alt = ""
    until = cert.not_valid_after_utc.date().isoformat()
    return f"{path}: {cn!s}" + (f" [{alt}]" if alt else "") + f", valid until {until}"


def diagnose(address: str, cfg: PSConfig, timeout: timedelta = timedelta(seconds=5)) -> str:
    """Why a TLS or plaintext connection to `address` fails, in one line naming the setting to fix ('' if fine).

    gRPC reports most handshake failures as UNAVAILABLE "Socket closed"; this probe repeats the handshake
    with the standard library and reads the server's first HTTP/2 frame to tell the cases apart.
    """
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    try:
        raw = open_path(host, int(port), timeout)  # through the proxy gRPC uses, when there is one
    except UnavailableError as exc:
        return str(exc)
    except OSError as exc:
        return f"nothing answers at {address} ({exc.strerror or exc}): is `geofed-hpc ps up` running, is the port open?"
    with raw:
        if cfg.insecure:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            try:
                ctx.wrap_socket(raw, server_hostname=host).close()
            except (OSError, ssl.SSLError):
                return ""
            return (
                f"the parameter server at {address} speaks TLS but this client is plaintext (ps.insecure=true): "
                "set ps.insecure=false and ps.ca_file=<the federation's ca.crt>"
            )
        return _diagnose_tls(raw, cfg.tls_name or host, address, cfg)


def _diagnose_tls(raw: socket.socket, host: str, address: str, cfg: PSConfig) -> str:
    try:
        ctx = ssl.create_default_context(cafile=str(Path(cfg.ca_file).expanduser()))
        if cfg.client_cert_file:
            ctx.load_cert_chain(Path(cfg.client_cert_file).expanduser(), Path(cfg.client_key_file).expanduser())
    except (OSError, ssl.SSLError) as exc:
        return f"cannot load ps.ca_file / ps.client_cert_file / ps.client_key_file: {exc}"
    ctx.set_alpn_protocols(["h2"])
    try:
        tls = ctx.wrap_socket(raw, server_hostname=host)
    except ssl.SSLCertVerificationError as exc:
        return (
            f"the certificate of the parameter server at {address} does not verify against ps.ca_file "
            f"({cfg.ca_file}): {exc.verify_message}; use the ca.crt that `ps init` wrote on the PS, or add "
            f"{host} to ps.tls_names there and rerun `ps init ps.tls_overwrite=true`"
            + ("" if cfg.tls_name else "; through a relay or SSH tunnel, set ps.tls_name=<a name of the PS's cert>")
        )
    except ssl.SSLError as exc:
        if "WRONG_VERSION_NUMBER" in str(exc) or "RECORD_LAYER" in str(exc).upper():
            return f"the parameter server at {address} speaks plaintext: set ps.insecure=true (local demos only)"
        return f"TLS handshake with {address} failed: {exc.reason or exc}"
    except OSError as exc:
        return f"TLS handshake with {address} failed: {exc}"
    with tls:
        try:  # TLS 1.3 gives the verdict on a client certificate after the handshake: read the first frame
            tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            first = tls.recv(9)
        except (OSError, ssl.SSLError) as exc:
            first, why = b"", f": {getattr(exc, 'reason', None) or exc}"
        else:
            why = ""
    if len(first) >= 4 and first[3] == 4:  # the server's HTTP/2 SETTINGS frame: TLS is fine
        return ""
    if not cfg.client_cert_file:
        return (
            f"the parameter server at {address} closed the connection after the TLS handshake{why}: it requires "
            "a client certificate (mutual TLS): set ps.client_cert_file and ps.client_key_file "
            "(made by `ps init ps.tls_sites=[SITE]` on the PS)"
        )
    return (
        f"the parameter server at {address} refused this site's certificate {cfg.client_cert_file}{why}: "
        "it must be a site certificate signed by the CA in the PS's ps.client_ca_file"
    )
