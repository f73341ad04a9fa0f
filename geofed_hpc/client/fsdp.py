"""FSDP2 for a site: shard per block then the root; full model/optimizer state to and from rank 0."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from geofed_hpc.client.precision import Precision
from geofed_hpc.errors import ConfigError, ProtocolError
from geofed_hpc.models.registry import decoder_blocks

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def shard_model(model: nn.Module, precision: Precision, reshard_after_forward: bool = True) -> nn.Module:
    """fully_shard every decoder block (`model.blocks`; a model=hf model's layers, the classes its `_no_split_modules`
    names), then the root (embeddings, final norm, head)."""
    policy = precision.mp_policy()
    for block in decoder_blocks(model):
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


@torch.no_grad()
def load_streamed(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], what: str) -> int:
    """Copy full tensors, given one at a time on every rank, into this rank's shards (or the parameters of an
    unsharded model): peak memory is the shards plus one full tensor. Every parameter must come exactly once.
    No collective: each rank keeps its slice. Returns the tensors loaded."""
    params = dict(model.named_parameters())
    done: set[str] = set()
    for name, full in tensors:
        param = params.get(name)
        if param is None:
            raise ConfigError(f"{what}: holds {name!r}, which this model does not have")
        if tuple(full.shape) != tuple(param.shape):
            raise ConfigError(
                f"{what}: {name} has shape {tuple(full.shape)} but the model needs {tuple(param.shape)}; use the "
                "model config that matches it"
            )
        value = full.to(param.device, param.dtype)
        if isinstance(param, DTensor):
            local = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(value)
        done.add(name)
        del full, value
    missing = sorted(set(params) - done)
    if missing:
        raise ConfigError(f"{what}: lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}")
    return len(done)


def local_numel(model: nn.Module) -> int:
    """Parameters this rank holds (its shards under FSDP2)."""
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def param_names(model: nn.Module) -> list[str]:
    """Parameter names in model order, tied parameters once (what is exchanged and checkpointed)."""
    return [name for name, _ in model.named_parameters()]


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full float32 CPU tensor, on rank 0 only ({} on the other ranks; collective)."""
    names = param_names(model)
    state: dict[str, Any]
    if is_sharded(model):
        state = dict(get_model_state_dict(model, options=_FULL))
        if dist.get_rank() != 0:
            return {}
    else:
        state = dict(model.named_parameters())
    return {n: state[n].detach().to("cpu", torch.float32) for n in names}


def load_full_state(model: nn.Module, state: Mapping[str, Any]) -> None:
    """Load full parameters given on rank 0 ({} elsewhere) into every rank's shards (collective).

    Names and shapes are checked on rank 0 before anything is sent; tied parameters need one entry."""
    names = param_names(model)
    if not is_sharded(model) or dist.get_rank() == 0:
        _check_state(model, state, names)
    if is_sharded(model):
        tensors: dict[str, Any] = _with_tied(model, state) if dist.get_rank() == 0 else {}
        set_model_state_dict(model, tensors, options=_BROADCAST)
        return
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in names:
            params[name].copy_(torch.as_tensor(state[name]).to(params[name].dtype))


def _check_state(model: nn.Module, state: Mapping[str, Any], names: list[str]) -> None:
    missing, extra = sorted(set(names) - set(state)), sorted(set(state) - set(names))
    if missing or extra:
        raise ProtocolError(f"global model does not match the local one: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, param in model.named_parameters():
        shape = tuple(param.shape)  # a DTensor reports its global shape
        if tuple(state[name].shape) != shape:
            raise ProtocolError(f"{name}: global shape {tuple(state[name].shape)} != local shape {shape}")


def check_arrays(model: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Names and shapes of full arrays against the model (before any rank is asked to load them)."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    missing, extra = sorted(set(shapes) - set(arrays)), sorted(set(arrays) - set(shapes))
    if missing or extra:
        raise ProtocolError(f"model state does not match this model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in shapes.items():
        if tuple(arrays[name].shape) != shape:
            raise ProtocolError(f"{name}: incoming shape {tuple(arrays[name].shape)} != this model's {shape}")


def _with_tied(model: nn.Module, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The full state dict keys (tied parameters under every name) from one entry per parameter."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        out[name] = torch.as_tensor(state[by_id[id(param)]]).to(torch.float32)
    return out


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, full CPU tensors on rank 0 ({} elsewhere; collective)."""
    if is_sharded(model):
        return get_optimizer_state_dict(model, optimizer, options=_FULL)
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load what full_optimizer_state returned (given on rank 0) into every rank (collective)."""
    options = _BROADCAST if is_sharded(model) else StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, state, options=options)
