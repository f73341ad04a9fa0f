"""The PS group's exchanges on its gloo process group: bytes all-gathered or broadcast, float32 sums all-reduced."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from geofed_hpc.errors import UnavailableError


class Group(Protocol):
    """What the PS group uses of a gloo ProcessGroupGloo (its collectives run ring algorithms over TCP)."""

    def rank(self) -> int: ...
    def size(self) -> int: ...
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> dist.Work: ...
    def broadcast(self, tensors: list[torch.Tensor], options: dist.BroadcastOptions) -> dist.Work: ...
    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...
    def shutdown(self) -> None: ...


class PeerLost(UnavailableError):
    """An exchange with the PS group failed: a peer is gone or did not answer within ps.peer_timeout."""


@dataclass
class Traffic:
    """The group's last exchange of round sums: the bytes this PS received (fp32: its share, reduced and sent back
    by the ring), how long the exchange took (seconds), when (time.time)."""

    nbytes: int = 0
    seconds: float = 0.0
    at: float = 0.0

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


def _wait(work: dist.Work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PeerLost(f"the PS group's {what} failed (a peer is gone or too slow): {first}") from None


def _as_tensor(data: bytes, size: int) -> torch.Tensor:
    buf = torch.zeros(max(size, 1), dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def allgather_bytes(pg: Group, data: bytes, what: str = "exchange", traffic: Traffic | None = None) -> list[bytes]:
    """Every peer's `data`, in rank order (sizes first, then one all-gather padded to the largest; `traffic` times
    that one: the peers are aligned by then, so it is the transfer, not a wait for the slowest)."""
    n = pg.size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    _wait(pg.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]), what)
    lengths = [int(s.item()) for s in sizes]
    top = max(lengths)
    outs = [torch.empty(max(top, 1), dtype=torch.uint8) for _ in range(n)]
    start = time.monotonic()
    _wait(pg.allgather([outs], [_as_tensor(data, top)]), what)
    if traffic is not None:
        traffic.nbytes, traffic.seconds, traffic.at = (n - 1) * top, time.monotonic() - start, time.time()
    return [o[:size].numpy().tobytes() for o, size in zip(outs, lengths, strict=True)]


def broadcast_bytes(pg: Group, data: bytes, root: int, what: str = "transfer") -> bytes:
    """`data` of peer `root` on every peer (what the others pass is ignored)."""
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = root, 0
    size = torch.tensor([len(data)], dtype=torch.int64)
    _wait(pg.broadcast([size], options), what)
    buf = _as_tensor(data if pg.rank() == root else b"", int(size.item()))
    _wait(pg.broadcast([buf], options), what)
    return buf[: int(size.item())].numpy().tobytes()


def allreduce_f32(pg: Group, flat: np.ndarray, traffic: Traffic) -> np.ndarray:
    """The element-wise sum of every peer's float32 `flat` (gloo's ring all-reduce), identical on every peer."""
    tensor = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
    start = time.monotonic()
    _wait(pg.allreduce([tensor]), "all-reduce of round sums")
    traffic.nbytes, traffic.seconds, traffic.at = tensor.numel() * 4, time.monotonic() - start, time.time()
    return tensor.numpy()
