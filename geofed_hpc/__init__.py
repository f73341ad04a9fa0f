"""geofed-hpc: train one LLM across many Slurm clusters and a cloud parameter server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["FederatedCallback", "Site", "__version__"]

if TYPE_CHECKING:
    from geofed_hpc.client.api import Site
    from geofed_hpc.client.hf import FederatedCallback

# The public API for one's own training loop, imported on first use: `import geofed_hpc` stays light (no torch).
_LAZY = {"Site": "geofed_hpc.client.api", "FederatedCallback": "geofed_hpc.client.hf"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'geofed_hpc' has no attribute {name!r}")
