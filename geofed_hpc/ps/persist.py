"""PS snapshots (model, optimizer state, residual, version, sessions) and `ps up --init-from` files."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from geofed_hpc.ckpt import CheckpointStore, load_tensors
from geofed_hpc.errors import CheckpointError
from geofed_hpc.log import logger
from geofed_hpc.ps.aggregate import Params

FORMAT = 1
_GROUPS = ("param", "momentum", "residual")


@dataclass
class PSState:
    """Everything a restarted PS needs; tensors go in as raw arrays, the rest as JSON (no pickle)."""

    version: int
    params: Params
    momentum: Params = field(default_factory=dict)
    residual: Params = field(default_factory=dict)
    sessions: list[dict[str, Any]] = field(default_factory=list)
    push_ids: list[list[Any]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)


class Snapshots:
    """`global-{version}.gft` files in the state directory, written atomically; the newest two are kept."""

    def __init__(self, directory: Path, keep: int = 2) -> None:
        self.store = CheckpointStore(directory, prefix="global", keep=keep)

    def save(self, state: PSState) -> Path:
        tensors: dict[str, np.ndarray] = {}
        for group, arrays in zip(_GROUPS, (state.params, state.momentum, state.residual), strict=True):
            tensors.update({f"{group}/{k}": v for k, v in arrays.items()})
        meta = {
            "format": FORMAT,
            "version": state.version,
            "time": time.time(),
            "sessions": state.sessions,
            "push_ids": state.push_ids,
            "settings": state.settings,
        }
        return self.store.save(state.version, tensors, meta)

    def load(self) -> tuple[PSState, Path] | None:
        """The newest snapshot that loads cleanly (a torn or corrupt newer file is skipped), or None."""
        loaded = self.store.load_latest()
        if loaded is None:
            return None
        tensors, meta, path = loaded
        if meta.get("format") != FORMAT or not isinstance(meta.get("version"), int):
            raise CheckpointError(f"snapshot {path} is not a geofed PS snapshot (format {meta.get('format')!r})")
        groups: dict[str, Params] = {g: {} for g in _GROUPS}
        for name, arr in tensors.items():
            group, _, key = name.partition("/")
            if group in groups:
                groups[group][key] = arr.astype(np.float32, copy=False)
        state = PSState(
            meta["version"],
            groups["param"],
            groups["momentum"],
            groups["residual"],
            list(meta.get("sessions", [])),
            list(meta.get("push_ids", [])),
            dict(meta.get("settings", {})),
        )
        return state, path


def load_init(path: Path) -> tuple[Params, int]:
    """Θ0 and its version from a PS snapshot (`param/*`), a site checkpoint (`model/*`) or a plain tensor file."""
    tensors, meta = load_tensors(Path(path).expanduser())
    for prefix in ("param/", "model/"):
        picked = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if picked:
            break
    else:
        picked = dict(tensors)
    params: Params = {}
    for name, arr in picked.items():
        if arr.dtype.kind != "f":
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {arr.dtype}; a model holds float tensors only")
        if not np.isfinite(arr).all():
            raise CheckpointError(f"{path}: tensor {name!r} holds NaN or Inf; refusing to seed the federation")
        params[name] = arr.astype(np.float32, copy=False)
    if not params:
        raise CheckpointError(f"{path}: holds no tensors to seed the global model with")
    version = meta.get("version", 0)
    version = version if isinstance(version, int) and version >= 0 else 0
    logger.info("read %d tensors (version %d) from %s", len(params), version, path)
    return params, version
