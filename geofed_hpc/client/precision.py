"""Training precision: bf16 where the GPU has it, fp16 with a (sharded) grad scaler on older GPUs, fp32 on CPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger

CHOICES = ("auto", "bf16", "fp16", "fp32")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Precision:
    """Compute dtype of forward/backward; parameters, gradients and optimizer state stay float32."""

    name: str
    device_type: str = "cpu"

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    @property
    def needs_scaler(self) -> bool:
        return self.name == "fp16"

    def mp_policy(self) -> Any:
        """FSDP2 MixedPrecisionPolicy: compute in `dtype`, reduce gradients in float32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.name == "fp32":
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Autocast for a model that FSDP does not wrap (one process); nothing for fp32."""
        if self.name == "fp32":
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def grad_scaler(self, sharded: bool) -> Any:
        """A loss scaler for fp16 (ShardedGradScaler under FSDP, GradScaler otherwise), else None."""
        if not self.needs_scaler:
            return None
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(device=self.device_type)
        return torch.amp.GradScaler(self.device_type)


def bf16_capable(device: torch.device, capability: tuple[int, int] | None = None) -> bool:
    """Native bf16: any CPU; on CUDA compute capability 8.0+ (A100, H100, RTX 30xx; not V100 or T4)."""
    if device.type != "cuda":
        return True
    major, minor = capability or torch.cuda.get_device_capability(device)
    return (major, minor) >= (8, 0)


def choose_precision(requested: str, device: torch.device, capability: tuple[int, int] | None = None) -> Precision:
    """`auto`: bf16 on bf16 GPUs, fp16 on older GPUs, fp32 on CPU. A request the hardware lacks falls back
    with a warning (bf16 on a V100 -> fp16; fp16 on a CPU -> fp32)."""
    if requested not in CHOICES:
        raise ConfigError(f"train.precision: must be one of {', '.join(CHOICES)}; got {requested!r}")
    kind = device.type
    if kind != "cuda":
        if requested == "fp16":
            logger.warning("train.precision=fp16 is not supported on %s; training in fp32", kind)
            return Precision("fp32", kind)
        return Precision("fp32" if requested == "auto" else requested, kind)
    bf16 = bf16_capable(device, capability)
    if requested == "auto":
        return Precision("bf16" if bf16 else "fp16", kind)
    if requested == "bf16" and not bf16:
        name = torch.cuda.get_device_name(device) if capability is None else f"compute capability {capability}"
        logger.warning("train.precision=bf16 but %s has no native bf16; training in fp16 with loss scaling", name)
        return Precision("fp16", kind)
    return Precision(requested, kind)
