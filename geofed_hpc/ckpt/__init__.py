"""Crash-safe, pickle-free checkpoints and snapshots (numpy only; no torch)."""

from geofed_hpc.ckpt.atomic import atomic_write_bytes
from geofed_hpc.ckpt.store import CheckpointStore
from geofed_hpc.ckpt.tensorfile import SUPPORTED_DTYPES, load_tensors, read_meta, save_tensors

__all__ = ["SUPPORTED_DTYPES", "CheckpointStore", "atomic_write_bytes", "load_tensors", "read_meta", "save_tensors"]
