"""Sockets a server binds itself, beside gRPC's: where it listens (one interface, or every one) and dials itself."""

from __future__ import annotations

import socket


def listen_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket listening on host:port only ("", "*" or "::": every interface, IPv4 and IPv6, as gRPC listens
    there; "0.0.0.0": every IPv4 interface); OSError when no address of `host` can be bound."""
    if host in ("", "*", "::"):
        if socket.has_dualstack_ipv6():
            return socket.create_server(("::", port), family=socket.AF_INET6, backlog=backlog, dualstack_ipv6=True)
        family = socket.AF_INET6 if host == "::" else socket.AF_INET
        return socket.create_server((host.strip("*"), port), family=family, backlog=backlog)
    error: OSError = OSError(f"{host} has no address")
    for family, _, _, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
        try:
            return socket.create_server(address, family=family, backlog=backlog)
        except OSError as exc:
            error = exc
    raise error


def self_dial(sock: socket.socket) -> str:
    """Where a server listening on `sock` dials itself: its address, or a loopback one for a wildcard."""
    bound = str(sock.getsockname()[0])
    if bound == "0.0.0.0":
        return "127.0.0.1"
    if bound == "::":
        v6only = sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
        return "::1" if v6only else "127.0.0.1"
    return bound
