"""Which device a site rank trains on, why CUDA is not there when it was asked for, and how to name the device."""

from __future__ import annotations

import os

import torch

from geofed_hpc.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def cuda_problem() -> str | None:
    """Why this process cannot train on a GPU (one line), or None when it can."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (
            f"this torch ({torch.__version__}) is a CPU-only build: install a CUDA build of torch in the site's "
            "environment (site.setup, site.python)"
        )
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES unset"
        return (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU ({where}): ask Slurm for GPUs "
            "(site.gpus_per_node, site.gpu_style) or check the node's driver"
        )
    return None


def check_device(want: str) -> None:
    """ConfigError (one line saying which) when `want` is cuda and this process has no usable GPU."""
    if want not in DEVICES:
        raise ConfigError(f"train.device: must be one of {', '.join(DEVICES)}; got {want!r}")
    if want == "cuda":
        problem = cuda_problem()
        if problem:
            raise ConfigError(f"train.device=cuda: {problem}")


def pick_device(local_rank: int, want: str = "auto") -> torch.device:
    """cuda:<local_rank mod GPUs> when a GPU is there and `want` is auto or cuda, else cpu."""
    check_device(want)
    if want != "cpu" and torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    """The GPU's model (NVIDIA H100 80GB HBM3), or `cpu`."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_memory(device: torch.device, local_ranks: int) -> int:
    """Bytes one rank may use: the GPU's total memory, or this node's available memory over its ranks."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    from geofed_hpc.client.microbatch import available_memory

    return available_memory() // max(1, local_ranks)
