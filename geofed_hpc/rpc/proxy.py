"""The HTTP CONNECT proxy a site's gRPC channel goes through, and a probe that says why a proxy will not carry it.

gRPC reads the proxy from the environment (`grpc_proxy`, then `https_proxy`, then `http_proxy`; `no_grpc_proxy`,
then `no_proxy`, lists hosts to reach directly), and `site.proxy` is exported under those names in the batch script.
Through the proxy TLS stays end to end: the proxy sees a CONNECT to the PS's host and port, then only ciphertext.
When a channel cannot connect, `open_path` repeats what gRPC did with the standard library, so the site's error can
name what the proxy answered (a CONNECT refused for the port, a request for credentials) rather than time out.
"""

from __future__ import annotations

import base64
import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import unquote

from geofed_hpc.errors import UnavailableError
from geofed_hpc.log import HIDDEN

_URL = re.compile(r"(?:http://)?(?:(?P<user>[^\s/@:]*)(?::(?P<password>[^\s/@]*))?@)?(?P<host>\[[^\]]+\]|[^\s/:@]+)"
                  r"(?::(?P<port>\d{1,5}))?/?")  # fmt: skip
MAX_ANSWER = 8192  # bytes of the proxy's answer read, at most, before its status line and headers must have ended
# What a proxy that is down, restarting or cannot reach the PS (yet) says: worth retrying, unlike a refusal.
_PASSING = ("does not answer (", "could not reach ", "closed the connection during CONNECT")


@dataclass(frozen=True)
class Proxy:
    """An HTTP proxy: host, port and the credentials of a `http://user:pass@host:port` URL (never shown)."""

    host: str
    port: int
    user: str = ""
    password: str = ""

    @property
    def shown(self) -> str:
        """The proxy as messages name it: its password as ***."""
        who = f"{self.user}:{HIDDEN}@" if self.password else f"{self.user}@" if self.user else ""
        return f"http://{who}{self.host}:{self.port}"

    def authorization(self) -> str:
        if not self.user:
            return ""
        pair = f"{self.user}:{self.password}".encode()
        return f"Proxy-Authorization: Basic {base64.b64encode(pair).decode()}\r\n"


def passing(why: str) -> bool:
    """`why` (a line of `tunnel`'s) names a proxy that may carry the connection on a later try."""
    return why.startswith("the proxy ") and any(p in why for p in _PASSING)


def parse_proxy(url: str) -> Proxy | None:
    """`url` as gRPC reads a proxy setting (http://[user:pass@]host[:port], the scheme optional); None when it is
    empty or not an http:// proxy gRPC would use."""
    url = url.strip()
    if not url or ("://" in url and not url.startswith("http://")):
        return None
    match = _URL.fullmatch(url)
    if not match:
        return None
    port = int(match.group("port") or 80)
    user, password = unquote(match.group("user") or ""), unquote(match.group("password") or "")
    return Proxy(match.group("host").strip("[]"), port, user, password)


def proxy_for(host: str, environ: dict[str, str] | None = None) -> Proxy | None:
    """The proxy gRPC's channel to `host` goes through, read from the environment as gRPC reads it; None for none."""
    env = os.environ if environ is None else environ
    setting = next((env[k] for k in ("grpc_proxy", "https_proxy", "http_proxy") if env.get(k)), "")
    if not setting:
        return None
    skip = env.get("no_grpc_proxy") or env.get("no_proxy") or ""
    name = host.lower()
    for entry in (e.strip().lower().lstrip(".") for e in skip.split(",")):
        if entry and (entry == "*" or name == entry or name.endswith("." + entry)):
            return None
    return parse_proxy(setting)


def open_path(host: str, port: int, timeout: timedelta, environ: dict[str, str] | None = None) -> socket.socket:
    """A TCP connection to host:port as gRPC makes it: direct, or a tunnel through the environment's proxy.
    OSError when nothing answers directly; UnavailableError, in one line saying what to do, when the proxy does
    not answer or will not carry the connection."""
    proxy = proxy_for(host, environ)
    if proxy is None:
        return socket.create_connection((host, port), timeout=timeout.total_seconds())
    return tunnel(proxy, host, port, timeout)


def tunnel(proxy: Proxy, host: str, port: int, timeout: timedelta) -> socket.socket:
    """A connection to host:port through `proxy` (HTTP CONNECT), or UnavailableError naming what the proxy said."""
    try:
        sock = socket.create_connection((proxy.host, proxy.port), timeout=timeout.total_seconds())
    except OSError as exc:
        raise UnavailableError(
            f"the proxy {proxy.shown} does not answer ({exc.strerror or exc}): check site.proxy (exported as "
            "https_proxy/grpc_proxy on compute nodes) against the proxy your cluster documents"
        ) from None
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{proxy.authorization()}\r\n".encode())
        answer = _read_answer(sock)
    except OSError as exc:
        sock.close()
        why = f"the proxy {proxy.shown} closed the connection during CONNECT {target}: {exc}"
        raise UnavailableError(why) from None
    status, reason = _status(answer)
    if status == 200:
        return sock
    sock.close()
    raise UnavailableError(_refusal(proxy, target, port, status, reason))


def _read_answer(sock: socket.socket) -> bytes:
    answer = b""
    while b"\r\n\r\n" not in answer and len(answer) < MAX_ANSWER:
        chunk = sock.recv(MAX_ANSWER - len(answer))
        if not chunk:
            break
        answer += chunk
    return answer


def _status(answer: bytes) -> tuple[int, str]:
    line = answer.split(b"\r\n", 1)[0].decode("latin-1")
    match = re.fullmatch(r"HTTP/1\.[01] (\d{3}) ?(.{0,80}).*", line)
    if not match:
        return 0, ""
    return int(match.group(1)), "".join(c if c.isprintable() else "?" for c in match.group(2)).strip()


def _refusal(proxy: Proxy, target: str, port: int, status: int, reason: str) -> str:
    said = f"{status} {reason}".strip()
    if status == 0:
        return (
            f"the proxy {proxy.shown} gave no HTTP answer to CONNECT {target}: is site.proxy an HTTP proxy "
            "(not SOCKS, not the PS itself)?"
        )
    if status in (401, 407):  # tinyproxy answers wrong credentials with 401
        if proxy.user:
            return f"the proxy {proxy.shown} refused the credentials of site.proxy ({said}): check user and password"
        return (
            f"the proxy {proxy.shown} asks for credentials ({said}): set site.proxy=http://USER:PASS@{proxy.host}:"
            f"{proxy.port}"
        )
    if status in (403, 405) and port != 443:
        return (
            f"the proxy {proxy.shown} refused CONNECT to port {port} ({said}): many proxies allow CONNECT only to "
            "port 443; run the parameter server there (`geofed-hpc ps up ps.port=443` on the VM, and ps.address="
            f"HOST:443 in the site file), or ask the cluster's admins to allow CONNECT to port {port}"
        )
    if status in (403, 405):
        return f"the proxy {proxy.shown} refused CONNECT to {target} ({said}): ask the cluster's admins to allow it"
    return (
        f"the proxy {proxy.shown} could not reach {target} ({said}): is `geofed-hpc ps up` running there, and is "
        "its port open to the proxy?"
    )
