"""A site's per-sync telemetry: transfer timings, link speed, RTT, memory and GPU."""

from __future__ import annotations

import math
import resource
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from geofed_hpc.log import logger


def rss_gb() -> float:
    """Resident memory of this process now (/proc/self/status), else its peak (getrusage), in GB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9


def gpu_metrics() -> dict[str, float]:
    """sys/gpu_util and sys/gpu_mem_gb of the current CUDA device; empty on a CPU-only site."""
    if not torch.cuda.is_available():
        return {}
    out = {"sys/gpu_mem_gb": torch.cuda.max_memory_allocated() / 1e9}
    try:
        out["sys/gpu_util"] = float(torch.cuda.utilization())
    except Exception as exc:  # noqa: BLE001 - needs NVML (pynvml); memory alone is still worth logging
        logger.debug("GPU utilisation unavailable: %s", exc)
    return out


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes * 8 / 1e6 / seconds if seconds > 0 else math.nan


@dataclass
class SyncTimer:
    """What one sync spent where, accumulated by the trainer's push and pull steps."""

    encode_s: float = 0.0
    push_s: float = 0.0
    pull_s: float = 0.0
    wait_s: float = 0.0
    bytes_received: int = 0
    staleness: int = 0
    contribution: int = 0

    def metrics(self, sent: int, total_s: float) -> dict[str, float | int]:
        transfer_down = max(self.pull_s - self.wait_s, 0.0)
        return {
            "sync/bytes_received": self.bytes_received,
            "sync/encode_seconds": self.encode_s,
            "sync/pull_seconds": self.pull_s,
            "sync/idle_seconds": self.wait_s,
            "sync/comm_overhead": (self.push_s + self.pull_s) / total_s if total_s > 0 else math.nan,
            "sync/staleness": self.staleness,
            "net/send_mbps": mbps(sent, self.push_s - self.encode_s) if sent else math.nan,
            "net/recv_mbps": mbps(self.bytes_received, transfer_down),
            "site/contribution_tokens": self.contribution,
        }


@dataclass
class RttMeter:
    """Latest and mean Heartbeat round-trip time over this run segment, in milliseconds."""

    samples: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> dict[str, float]:
        self.samples.append(seconds * 1000.0)
        return {"net/rtt_ms": self.samples[-1], "net/rtt_avg_ms": sum(self.samples) / len(self.samples)}
