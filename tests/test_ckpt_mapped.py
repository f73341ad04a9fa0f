"""load_tensors(mapped=True): a checkpoint mapped instead of read is checked byte for byte like a read one, its
arrays are writable, and a write to them never reaches the file."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from geofed_hpc.ckpt import CheckpointStore, load_tensors, save_tensors, tensorfile
from geofed_hpc.errors import CheckpointError


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "w": rng.standard_normal((40, 30)).astype(np.float32),
        "i": np.arange(-50, 50, dtype=np.int64),
        "h": rng.standard_normal(17).astype(np.float16),
        "u": np.arange(256, dtype=np.uint8),
        "s": np.array(2.5, dtype=np.float32),
        "e": np.zeros((3, 0), dtype=np.float32),
    }


@pytest.mark.parametrize("version", [1, 2])
def test_a_mapped_load_gives_the_same_writable_arrays_and_never_writes_the_file(tmp_path: Path, version: int) -> None:
    tensors = _tensors()
    path = tmp_path / "m.gft"
    save_tensors(path, tensors, {"step": 4}, version=version)
    before = hashlib.sha256(path.read_bytes()).digest()
    mapped, meta = load_tensors(path, mapped=True)
    read, read_meta = load_tensors(path)
    assert meta == read_meta == {"step": 4} and list(mapped) == list(read) == list(tensors)
    for name, value in tensors.items():
        assert mapped[name].dtype == value.dtype and mapped[name].shape == value.shape
        np.testing.assert_array_equal(mapped[name], value)
        assert mapped[name].flags.writeable
    mapped["w"] += 1.0  # copy-on-write: the process's copy changes, the file does not
    mapped["u"][:] = 0
    np.testing.assert_array_equal(mapped["w"], tensors["w"] + 1.0)
    assert hashlib.sha256(path.read_bytes()).digest() == before
    again, _ = load_tensors(path, mapped=True)
    np.testing.assert_array_equal(again["w"], tensors["w"])
    np.testing.assert_array_equal(again["u"], tensors["u"])


@pytest.mark.parametrize("version", [1, 2])
def test_a_mapped_load_refuses_every_flipped_byte_and_every_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int
) -> None:
    monkeypatch.setattr(tensorfile, "BLOCK", 512)  # many blocks, hashed by several threads
    path = tmp_path / "m.gft"
    save_tensors(path, _tensors(), {"k": 1}, version=version)
    full = path.read_bytes()
    bad = tmp_path / "bad.gft"
    for pos in range(0, len(full), 7):
        data = bytearray(full)
        data[pos] ^= 0x10
        bad.write_bytes(bytes(data))
        with pytest.raises(CheckpointError) as info:
            load_tensors(bad, mapped=True)
        assert str(bad) in str(info.value), pos
    for cut in range(0, len(full), 97):
        bad.write_bytes(full[:cut])
        with pytest.raises(CheckpointError, match="truncated|corrupt|not a geofed"):
            load_tensors(bad, mapped=True)
    data = bytearray(full)
    data[len(full) // 2] ^= 0x01  # a data byte: the checksum names itself
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum does not match"):
        load_tensors(bad, mapped=True)


def test_the_mapping_outlives_the_file_being_replaced(tmp_path: Path) -> None:
    """Checkpoints are replaced by renames and pruned by unlinks: arrays mapped before stay what they were."""
    path = tmp_path / "m.gft"
    tensors = _tensors()
    save_tensors(path, tensors, {})
    mapped, _ = load_tensors(path, mapped=True)
    save_tensors(path, {k: v * 0 for k, v in tensors.items()}, {})  # atomic replace
    np.testing.assert_array_equal(mapped["w"], tensors["w"])
    path.unlink()
    np.testing.assert_array_equal(mapped["i"], tensors["i"])


def test_prefetch_reads_the_newest_file_ahead_and_never_fails(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", prefix="site")
    assert store.prefetch() is None  # no checkpoint: nothing to read
    store.save(1, _tensors(), {"n": 1})
    store.save(2, _tensors(), {"n": 2})
    thread = store.prefetch()
    assert thread is not None and thread.daemon
    thread.join(timeout=60)
    assert not thread.is_alive()
    store.path_for(2).chmod(0)  # unreadable (root reads it anyway): the hint never raises
    thread = store.prefetch()
    assert thread is not None
    thread.join(timeout=60)
    store.path_for(2).unlink()
    store.path_for(1).unlink()
    assert store.prefetch() is None
