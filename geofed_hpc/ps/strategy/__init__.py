"""Aggregation strategies, one class per `ps.aggregation` mode; `strategy_for` picks one from the config."""

from __future__ import annotations

from collections.abc import Callable

from geofed_hpc.config import PSConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.ps.rounds import OpenRound
from geofed_hpc.ps.staging import Staging
from geofed_hpc.ps.strategy.asynchronous import AsyncUpdates
from geofed_hpc.ps.strategy.base import Strategy
from geofed_hpc.ps.strategy.buffered import BufferedUpdates
from geofed_hpc.ps.strategy.sync import SyncRounds

# The only place in ps/ that reads the mode's name: everything else asks the strategy.
STRATEGIES: dict[str, type[Strategy]] = {"sync": SyncRounds, "async": AsyncUpdates, "buffered": BufferedUpdates}

__all__ = ["STRATEGIES", "AsyncUpdates", "BufferedUpdates", "Strategy", "SyncRounds", "strategy_for"]


def strategy_for(cfg: PSConfig, staging: Staging, clock: Callable[[], float]) -> Strategy:
    """The strategy of `cfg.aggregation`, with an empty open round spooling to `staging`."""
    kind = STRATEGIES.get(cfg.aggregation)
    if kind is None:
        raise ConfigError(f"ps.aggregation: must be one of {', '.join(STRATEGIES)}, got {cfg.aggregation!r}")
    return kind(cfg, OpenRound(cfg, staging, clock))
