"""torch.distributed for a site job: ranks from submitit (client/ranks.py) or torchrun, gloo on CPU, nccl on GPU."""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from geofed_hpc.client import devices
from geofed_hpc.client.ranks import SiteRanks as SiteRanks
from geofed_hpc.client.ranks import port_for as port_for
from geofed_hpc.client.ranks import site_ranks as site_ranks
from geofed_hpc.log import logger

# How long `wait_released` waits for the process group's threads to let go of a collective's tensor.
RELEASE_TIMEOUT = timedelta(seconds=10)
RELEASE_LINGER = timedelta(milliseconds=20)


def pick_device(ranks: SiteRanks, want: str = "auto") -> torch.device:
    """cuda:local_rank when a GPU is there (and `want` is auto or cuda), else cpu; cuda without a usable GPU is a
    ConfigError saying why (client/devices.py)."""
    return devices.pick_device(ranks.local_rank, want)


def init_distributed(ranks: SiteRanks, device: torch.device, timeout: timedelta) -> bool:
    """Join the site's process group (nccl on GPU, gloo on CPU); False (and nothing done) for one process."""
    if ranks.world_size == 1 or dist.is_initialized():
        return dist.is_initialized()
    backend = "nccl" if device.type == "cuda" else "gloo"
    logger.info(
        "rank %d/%d: %s process group via %s:%d on %s",
        ranks.rank,
        ranks.world_size,
        backend,
        ranks.master_addr,
        ranks.master_port,
        device,
    )
    dist.init_process_group(
        backend,
        init_method=f"tcp://{ranks.master_addr}:{ranks.master_port}",
        rank=ranks.rank,
        world_size=ranks.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    return True


def close_distributed() -> None:
    """Leave the process group, if any: waits for its pending work (call it before the interpreter exits, never
    after an error inside a collective: a peer may be gone mid-operation). Best effort: the process ends next."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001
            logger.warning("leaving the process group failed: %s", exc)


def holders(tensor: torch.Tensor) -> int:
    """How many references `tensor` has now; after a collective on it, `wait_released` waits until it is back."""
    return sys.getrefcount(tensor)


def wait_released(tensor: torch.Tensor, before: int, timeout: timedelta = RELEASE_TIMEOUT) -> None:
    """After a rank's last collective on `tensor`: wait (sleeping, so without the GIL) until the process group's
    worker thread has dropped its reference, i.e. until `tensor` has the `before` holders it had.

    A gloo worker frees a finished collective after the caller's wait returned, and freeing a tensor Python
    knows needs the GIL. If the interpreter is already exiting by then, Python ends that thread in the middle
    of a C++ destructor and the process aborts ("terminate called without an active exception") after all its
    work was done. Only the last collective needs this: a process that goes on gives the worker its GIL.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    while sys.getrefcount(tensor) > before and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(RELEASE_LINGER.total_seconds())  # the group's other worker thread may still free an earlier one
