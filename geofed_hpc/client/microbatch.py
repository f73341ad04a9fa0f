"""Micro-batch size: probe upward on a GPU (catching out-of-memory), a memory budget on CPU; cached as JSON."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from geofed_hpc.config import ModelConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger

SAFETY = 0.85  # keep this fraction of the largest micro-batch that fitted (allocator fragmentation, eval)


def split_batch(batch_size: int, world_size: int, rank: int, micro: int) -> tuple[slice, list[int]]:
    """This rank's slice of a site batch and its micro-batch sizes. Every rank gets the same share and the same
    micro-batches: FSDP gathers parameters in every forward, so all ranks must run as many."""
    if batch_size % world_size:
        raise ConfigError(
            f"train.batch_size: {batch_size} sequences do not split evenly over the site's {world_size} ranks; "
            f"use a multiple of {world_size} (the same batch on every site keeps tokens per local step equal)"
        )
    if micro < 1:
        raise ConfigError(f"micro-batch size must be at least 1, got {micro}")
    n = batch_size // world_size
    return slice(rank * n, (rank + 1) * n), [min(micro, n - at) for at in range(0, n, micro)]


def cache_key(device_name: str, model: ModelConfig, precision: str, world_size: int) -> str:
    """Identifies one probe result: GPU model, model shape (not its name or init), precision, ranks."""
    shape = {k: v for k, v in dataclasses.asdict(model).items() if k not in ("name", "init_from")}
    text = json.dumps([device_name, shape, precision, world_size], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def read_cache(path: Path, key: str) -> int | None:
    try:
        entry = json.loads(Path(path).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    size = entry.get("micro_batch") if isinstance(entry, dict) else None
    return size if isinstance(size, int) and size >= 1 else None


def write_cache(path: Path, key: str, micro: int, note: str) -> None:
    """Merge one result into the JSON cache (temp file + rename; a lost race only costs a re-probe)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    data[key] = {"micro_batch": micro, "what": note}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("cannot write the micro-batch cache %s (%s); the next job probes again", path, exc)


def probe(try_size: Callable[[int], bool], limit: int, safety: float = SAFETY) -> int:
    """The largest micro-batch <= limit for which `try_size(n)` returns True (False: out of memory), found by
    doubling and then bisection, times `safety` unless the whole limit fits. `try_size` must agree across ranks."""
    if not try_size(1):
        raise ConfigError(
            "micro-batch 1 does not fit in GPU memory: use more GPUs (site.gpus_per_node), "
            "a smaller model.context, or a smaller model"
        )
    good, bad = 1, limit + 1
    while good * 2 < bad:
        if try_size(min(good * 2, limit)):
            good = min(good * 2, limit)
            if good == limit:
                return limit
        else:
            bad = min(good * 2, limit)
    while bad - good > 1:
        mid = (good + bad) // 2
        if try_size(mid):
            good = mid
        else:
            bad = mid
    return good if good == limit else max(1, int(good * safety))


def oom_guard(step: Callable[[int], None]) -> Callable[[int], bool]:
    """Wrap a trial step: True when it ran, False on CUDA out-of-memory (memory released afterwards)."""

    def attempt(n: int) -> bool:
        try:
            step(n)
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    return attempt


def available_memory() -> int:
    """Bytes of memory the OS reports available (free + reclaimable) on this node."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def estimate_bytes_per_sample(model: ModelConfig, dtype_bytes: int = 4) -> int:
    """Activation memory of one sequence in forward+backward: per layer ~34·T·d bytes at 16 bits
    (Korthikanti et al. 2022) plus attention scores, and the logits with their gradient in float32."""
    t, d = model.context, model.d_model
    per_layer = t * (34 * d + 5 * model.n_heads * t) * dtype_bytes // 2
    return model.n_layers * per_layer + 3 * t * model.vocab_size * 4


def cpu_micro_batch(model: ModelConfig, n_params: int, world_size: int, limit: int, budget: int | None = None) -> int:
    """Micro-batch for CPU training from a memory budget (half the available memory, shared by the node's ranks):
    float32 weights, gradients and AdamW state (sharded over ranks) first, activations with the rest."""
    budget = budget if budget is not None else available_memory() // 2 // max(1, world_size)
    static = n_params * 16 // max(1, world_size)
    spare = budget - static
    per_sample = estimate_bytes_per_sample(model)
    micro = min(limit, spare // per_sample) if spare > 0 else 0
    if micro < 1:
        logger.warning(
            "memory budget %.1f GiB leaves no room for activations (weights+optimizer %.1f GiB); using micro-batch 1",
            budget / 2**30,
            static / 2**30,
        )
        return 1
    return int(micro)
