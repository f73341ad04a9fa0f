"""Sharded state of a multi-rank site: DCP checkpoints (each rank writes its shard) and full parameters gathered
one at a time on rank 0 (the PS exchange), so rank 0 never holds a second full copy of the model at once."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from geofed_hpc.ckpt.atomic import atomic_write_bytes
from geofed_hpc.errors import CheckpointError
from geofed_hpc.log import logger

PREFIX = "shards-"
INDEX = "shards.json"


def shard_dir(root: Path, stamp: int) -> Path:
    """Where the shards of the save numbered `stamp` live (every rank derives it from the stamp)."""
    return root / f"{PREFIX}{stamp}"


def stamp_of(name: str) -> int:
    if not name.startswith(PREFIX) or not name[len(PREFIX) :].isdigit():
        raise CheckpointError(f"{name!r} is not a shard folder name ({PREFIX}<number>)")
    return int(name[len(PREFIX) :])


def new_stamp(last: int = 0) -> int:
    """A save number that grows with time (milliseconds; exact as the float a command carries)."""
    return max(last + 1, int(time.time() * 1000))


def save_shards(
    model: nn.Module, optimizer: torch.optim.Optimizer, root: Path, stamp: int, weights_only: bool = False
) -> Path:
    """Every rank writes its shard of the model and the optimizer state (`weights_only`: the model's alone, for a
    best checkpoint) (collective); rank 0 then moves the finished folder into place, so a folder named
    shards-<stamp> is complete."""
    final = shard_dir(root, stamp)
    tmp = final.with_name(final.name + ".tmp")
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if not weights_only:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=str(tmp))
    if _rank() == 0:
        tmp.rename(final)
    return final


class PendingShards:
    """This rank's shards being written in the background (DCP async_save): `finish()` waits for them; on rank 0,
    whose save completes only once every rank's shards are written, it then moves the folder into place."""

    def __init__(self, future: Future[Any], tmp: Path, final: Path) -> None:
        self.future, self.tmp, self.final = future, tmp, final

    def finish(self) -> Path:
        self.future.result()
        if _rank() == 0:
            self.tmp.rename(self.final)
        return self.final


_SAVE_GROUP: list[Any] = []  # the process group of background saves, made at the first one


def start_save_shards(model: nn.Module, optimizer: torch.optim.Optimizer, root: Path, stamp: int) -> PendingShards:
    """Every rank stages its shard of the model and the optimizer state in host memory and writes it on a thread
    of its own (torch.distributed.checkpoint.async_save; collective). Their collectives run on a gloo group of
    their own (made here, at the first background save, by every rank at once), never interleaved with training's."""
    if not _SAVE_GROUP:
        _SAVE_GROUP.append(dist.new_group(backend="gloo"))
    final = shard_dir(root, stamp)
    tmp = final.with_name(final.name + ".tmp")
    state: dict[str, Any] = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=_SAVE_GROUP[0])
    assert isinstance(future, Future)
    return PendingShards(future, tmp, final)


def load_shards(model: nn.Module, optimizer: torch.optim.Optimizer, root: Path, stamp: int) -> None:
    """Read the model and optimizer shards written by save_shards into every rank (collective). DCP reshards
    when the folder was written by another number of ranks."""
    path = shard_dir(root, stamp)
    state: dict[str, Any] = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])


def read_shards(folder: Path) -> dict[str, Any]:
    """A shard folder read whole into one process (no process group): {"model": {name: tensor}, "optim": ...}
    with full tensors, for tools and tests."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    reader = dcp.FileSystemReader(str(folder))
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def gather_param(model: nn.Module, name: str) -> np.ndarray:
    """One parameter in full as float32 on the CPU (all ranks take part; only rank 0's copy is used)."""
    param = model.get_parameter(name)
    value = param.full_tensor() if isinstance(param, DTensor) else param
    return value.detach().to("cpu", torch.float32).numpy()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class Gathered(Mapping[str, np.ndarray]):
    """A sharded model's full parameters by name on rank 0, each gathered when it is read (`fetch` runs the
    collective, which the other ranks join as a command). Read each once and drop it: peak memory on rank 0 is
    one full parameter, whatever the model size."""

    def __init__(self, names: list[str], fetch: Callable[[str], np.ndarray]) -> None:
        self.names, self.fetch = names, fetch

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.names:
            raise KeyError(name)
        return self.fetch(name)

    def __contains__(self, name: object) -> bool:  # a membership test gathers nothing
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class ShardIndex:
    """Which shard folders each checkpoint file (in the checkpoint folder or best/) refers to, in shards.json.

    A folder is listed before the file that refers to it is written, and dropped once no file refers to it:
    a crash between the two leaves a folder too many, never a file without its shards."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / INDEX

    def read(self) -> dict[str, list[str]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return {str(k): [str(d) for d in v] for k, v in data.items() if isinstance(v, list)}

    def _write(self, data: dict[str, list[str]]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.path, json.dumps(data, indent=1, sort_keys=True).encode())

    def add(self, file: str, folder: str) -> None:
        """`file` (a name relative to the checkpoint folder) is about to refer to `folder`."""
        data = self.read()
        data[file] = sorted({*data.get(file, []), folder})
        self._write(data)

    def settle(self, file: str, folder: str) -> None:
        """`file` now refers to `folder` only; folders no existing file refers to are deleted."""
        data = self.read()
        data[file] = [folder]
        data = {k: v for k, v in data.items() if (self.directory / k).exists()}
        self._write(data)
        keep = {d for folders in data.values() for d in folders}
        for entry in self.directory.glob(f"{PREFIX}*"):
            if entry.name not in keep and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                logger.debug("pruned checkpoint shards %s", entry)


def shard_meta(folder: Path, world_size: int) -> dict[str, Any]:
    """What a checkpoint's meta says about its shards."""
    return {"dir": folder.name, "world_size": world_size}
