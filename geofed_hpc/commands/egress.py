"""`geofed-hpc relay`: forward sites' connections to their parameter server from a node with both networks."""

from __future__ import annotations

from geofed_hpc.commands.options import OPTIONS
from geofed_hpc.config import RunConfig
from geofed_hpc.config.fields import parse_duration, split_host_port
from geofed_hpc.egress.relay import Relay, run_relay
from geofed_hpc.errors import ConfigError


def cmd_relay(cfg: RunConfig) -> int:
    """Forward to --to (default ps.address) from --listen (default 0.0.0.0 on the PS's port) until Ctrl-C."""
    to = OPTIONS.relay_to or cfg.ps.address
    if not to:
        raise ConfigError("relay: --to HOST:PORT is missing: the parameter server's address, as the relay reaches it")
    target = _address(to, "--to")
    listen = _address(OPTIONS.relay_listen or f"0.0.0.0:{target[1]}", "--listen")
    if OPTIONS.relay_max_connections < 1:
        raise ConfigError(f"--max-connections: expected at least 1, got {OPTIONS.relay_max_connections}")
    idle = parse_duration(OPTIONS.relay_idle, "--idle")
    return run_relay(Relay(target, listen, OPTIONS.relay_max_connections, idle))


def _address(value: str, flag: str) -> tuple[str, int]:
    try:
        return split_host_port(value)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
