"""The reparametrization phi(theta): what sites train, exchange and keep private (identity, LoRA, RAVAN, ZO)."""

from geofed_hpc.paradigms.exchange import Exchange, exchange_for

__all__ = ["Exchange", "exchange_for"]
