"""Move exchanged parameters between a torch model and named float32 numpy arrays."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from geofed_hpc.errors import ProtocolError

Arrays = dict[str, np.ndarray]


def exchanged_arrays(model: torch.nn.Module) -> Arrays:
    """A float32 copy of every parameter, by name (tied parameters appear once)."""
    return {name: p.detach().to(torch.float32).cpu().numpy().copy() for name, p in model.named_parameters()}


def load_arrays(model: torch.nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Copy `arrays` into the model's parameters; names and shapes must match exactly."""
    params = dict(model.named_parameters())
    missing, extra = sorted(set(params) - set(arrays)), sorted(set(arrays) - set(params))
    if missing or extra:
        raise ProtocolError(f"global model does not match the local one: missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            src = arrays[name]
            if tuple(src.shape) != tuple(p.shape):
                raise ProtocolError(f"{name}: global shape {tuple(src.shape)} != local shape {tuple(p.shape)}")
            p.copy_(torch.from_numpy(np.ascontiguousarray(src)).to(p.dtype))


def delta(local: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]) -> Arrays:
    """phi(local) - phi(base), name by name."""
    return {name: (local[name] - base[name]).astype(np.float32, copy=False) for name in base}
