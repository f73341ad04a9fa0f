"""Channel and server options (message limits, keepalive), TLS credentials, and a plain TCP probe."""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc

from geofed_hpc.config import PSConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.rpc.tls import check_key_pair

# Clients ping every 30 s, below the 60-350 s idle timeouts of common NATs and firewalls; the server
# accepts pings that often so it never answers with GOAWAY "too_many_pings".
# The server pings idle connections itself every minute so half-open ones (a site's NAT dropped them) close.
CLIENT_KEEPALIVE_MS = 30_000
SERVER_MIN_PING_INTERVAL_MS = 10_000
SERVER_KEEPALIVE_MS = 60_000
# What one connection may hold on the PS: streams at once (a site needs a handful: a push, a pull, a heartbeat, a
# split upload), how long its TLS handshake may take, and how long it may stay open with no call at all (a site's
# heartbeats keep its own busy; gRPC redials transparently when one was closed).
SERVER_MAX_STREAMS_PER_CONNECTION = 32
SERVER_HANDSHAKE_TIMEOUT_MS = 20_000
SERVER_MAX_IDLE_MS = 300_000
# After an outage gRPC redials with its own backoff (by default up to 120 s): cap it, so a PS that is back
# is found within seconds by the retries in rpc/client.py.
MAX_RECONNECT_BACKOFF_MS = 5_000


def client_options(cfg: PSConfig, keepalive_ms: int = CLIENT_KEEPALIVE_MS) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_http_proxy", 1),  # honour https_proxy / grpc_proxy on compute nodes
        ("grpc.initial_reconnect_backoff_ms", 1_000),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
        # a connection of its own, as a site's process has: gRPC would otherwise let every client of one process share
        # one connection, and the PS takes SERVER_MAX_STREAMS_PER_CONNECTION streams on each
        ("grpc.use_local_subchannel_pool", 1),
        # through a relay or a tunnel, the certificate is still the PS's: checked against its name, not the relay's
        *([("grpc.ssl_target_name_override", cfg.tls_name)] if cfg.tls_name and not cfg.insecure else []),
    ]


def server_options(cfg: PSConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        # a caller's message longer than this is refused as it arrives, never read whole (a 16 MiB site name...)
        ("grpc.max_receive_message_length", min(cfg.max_message_bytes, cfg.max_request_bytes)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
        ("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.so_reuseport", 0),  # a port already in use must fail, not be shared silently
        ("grpc.max_concurrent_streams", SERVER_MAX_STREAMS_PER_CONNECTION),
        ("grpc.server_handshake_timeout_ms", SERVER_HANDSHAKE_TIMEOUT_MS),
        ("grpc.max_connection_idle_ms", SERVER_MAX_IDLE_MS),
        *_window(cfg),
    ]


def _window(cfg: PSConfig) -> list[tuple[str, Any]]:
    """A fixed receive window per stream (BDP probing off): a push waiting for its turn buffers at most that."""
    if cfg.stream_window_bytes == 0:
        return []
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", cfg.stream_window_bytes)]


def _read(path: str, field: str) -> bytes:
    if not path:
        raise ConfigError(f"{field}: TLS needs this file; set it, or ps.insecure=true for a plaintext local demo")
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{field}: file {p} does not exist")
    return p.read_bytes()


def server_credentials(cfg: PSConfig) -> grpc.ServerCredentials:
    """TLS with the PS certificate; with ps.client_ca_file, mutual TLS: sites without a cert it signed are refused."""
    key, cert = _read(cfg.key_file, "ps.key_file"), _read(cfg.cert_file, "ps.cert_file")
    check_key_pair(cert, key, str(Path(cfg.cert_file).expanduser()), str(Path(cfg.key_file).expanduser()))
    pair = [(key, cert)]
    if not cfg.client_ca_file:
        return grpc.ssl_server_credentials(pair)
    client_ca = _read(cfg.client_ca_file, "ps.client_ca_file")
    return grpc.ssl_server_credentials(pair, root_certificates=client_ca, require_client_auth=True)


def channel_credentials(cfg: PSConfig) -> grpc.ChannelCredentials:
    """Verify the PS against ps.ca_file; present ps.client_cert_file when the PS asks for mutual TLS."""
    ca = _read(cfg.ca_file, "ps.ca_file")
    if not cfg.client_cert_file:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    key = _read(cfg.client_key_file, "ps.client_key_file")
    return grpc.ssl_channel_credentials(ca, key, _read(cfg.client_cert_file, "ps.client_cert_file"))


def listening(host: str, port: int, timeout: timedelta) -> bool:
    """Something accepts TCP connections at host:port within `timeout` (a refused connection answers at once)."""
    try:
        with socket.create_connection((host, port), timeout=timeout.total_seconds()):
            return True
    except OSError:
        return False
