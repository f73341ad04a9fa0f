"""Checkpoint files: atomic writes, the .gft tensor format and the keep-latest store."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from geofed_hpc.ckpt import CheckpointStore, atomic_write_bytes, load_tensors, save_tensors, tensorfile
from geofed_hpc.ckpt.atomic import temp_target
from geofed_hpc.errors import CheckpointError, ConfigError


def _all_dtypes() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal(7).astype(np.float16),
        "f64": rng.standard_normal((2, 2, 2)),
        "i64": np.arange(-5, 6, dtype=np.int64),
        "i32": np.array([[np.iinfo(np.int32).min, 0, np.iinfo(np.int32).max]], dtype=np.int32),
        "i16": np.array([-3, 3], dtype=np.int16),
        "i8": np.array([-128, 127], dtype=np.int8),
        "u8": np.arange(256, dtype=np.uint8),
        "u16": np.array([0, 1, 65535], dtype=np.uint16),
        "u32": np.array([4_000_000_000], dtype=np.uint32),
        "u64": np.array([2**63 + 5], dtype=np.uint64),
        "bool": np.array([True, False, True]),
        "scalar_f32": np.array(3.5, dtype=np.float32),
        "scalar_i64": np.array(-42, dtype=np.int64),
        "empty_f32": np.zeros((0,), dtype=np.float32),
        "empty_2d_u16": np.zeros((4, 0), dtype=np.uint16),
        "naïve/ünïcode.weight": np.ones(3, dtype=np.float32),
    }


def _small_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.gft"
    save_tensors(
        path,
        {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array(7, dtype=np.int64), "c": np.zeros(0)},
        {"step": 3},
    )
    return path


def test_round_trip_every_dtype(tmp_path: Path) -> None:
    tensors = _all_dtypes()
    meta = {"step": 12, "loss": 1.25, "nested": {"ok": [1, 2, "x"]}, "none": None, "flag": True}
    path = tmp_path / "all.gft"
    save_tensors(path, tensors, meta)
    loaded, loaded_meta = load_tensors(path)
    assert list(loaded) == list(tensors)
    assert loaded_meta == meta
    for name, arr in tensors.items():
        out = loaded[name]
        assert out.dtype == arr.dtype, name
        assert out.shape == arr.shape, name
        np.testing.assert_array_equal(out, arr)
        assert out.flags.writeable, name
        out[...] = 0  # writable for real, not a view of a read-only buffer


def test_round_trip_non_contiguous_and_big_endian(tmp_path: Path) -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    tensors = {"t": base.T, "strided": base[:, ::2], "be": np.arange(5, dtype=">i4"), "be_f": np.ones(3, ">f2")}
    path = tmp_path / "nc.gft"
    save_tensors(path, tensors, {})
    loaded, _ = load_tensors(path)
    for name, arr in tensors.items():
        np.testing.assert_array_equal(loaded[name], arr)
        assert loaded[name].dtype.name == arr.dtype.name
    assert loaded["be"].dtype == np.dtype("<i4")


def test_large_tensor_is_streamed_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensorfile, "_CHUNK", 1000)
    seen: list[int] = []
    real = tensorfile.atomic_write_bytes

    def spy(path: Path, data: object, mode: int | None = None) -> None:
        assert not isinstance(data, (bytes, bytearray, memoryview)), "save_tensors must stream, not build one blob"

        def chunks() -> Iterator[bytes]:
            for chunk in data:  # type: ignore[attr-defined]
                seen.append(len(chunk))
                yield chunk

        real(path, chunks(), mode)

    monkeypatch.setattr(tensorfile, "atomic_write_bytes", spy)
    big = np.random.default_rng(1).standard_normal(10_000).astype(np.float32)
    path = tmp_path / "big.gft"
    save_tensors(path, {"big": big, "small": np.ones(3, np.int32)}, {"k": "v"})
    assert max(seen) <= 1000 + 64  # no chunk holds the whole 40 KB tensor
    loaded, meta = load_tensors(path)
    np.testing.assert_array_equal(loaded["big"], big)
    assert meta == {"k": "v"}


def test_unsupported_inputs_write_nothing(tmp_path: Path) -> None:
    path = tmp_path / "x.gft"
    save_tensors(path, {"a": np.ones(2, np.float32)}, {"v": 1})
    before = path.read_bytes()
    with pytest.raises(TypeError, match="object"):
        save_tensors(path, {"obj": np.array([object()], dtype=object)}, {})
    with pytest.raises(TypeError, match="complex128"):
        save_tensors(path, {"c": np.ones(2, np.complex128)}, {})
    with pytest.raises(TypeError, match="JSON"):
        save_tensors(path, {"a": np.ones(2, np.float32)}, {"bad": object()})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gft"]


def test_missing_file_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "nope.gft"
    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_tensors(path)
    assert str(path) in str(info.value)


def test_foreign_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"\x80\x04\x95" + b"\x00" * 100)  # a pickle's opening bytes
    with pytest.raises(CheckpointError, match="not a geofed tensor file") as info:
        load_tensors(path)
    assert str(path) in str(info.value)


def test_truncation_at_every_cut_point(tmp_path: Path) -> None:
    path = _small_file(tmp_path)
    full = path.read_bytes()
    cut_path = tmp_path / "cut.gft"
    for cut in range(len(full)):
        cut_path.write_bytes(full[:cut])
        with pytest.raises(CheckpointError) as info:
            load_tensors(cut_path)
        assert str(cut_path) in str(info.value), cut
        msg = str(info.value)
        assert "truncated" in msg or "corrupt" in msg, (cut, msg)
    cut_path.write_bytes(full)
    load_tensors(cut_path)


def test_flipped_byte_anywhere_is_detected(tmp_path: Path) -> None:
    path = _small_file(tmp_path)
    full = path.read_bytes()
    bad_path = tmp_path / "flipped.gft"
    for pos in range(len(full)):
        for mask in (0x01, 0xFF):
            data = bytearray(full)
            data[pos] ^= mask
            bad_path.write_bytes(bytes(data))
            with pytest.raises(CheckpointError) as info:
                load_tensors(bad_path)
            assert str(bad_path) in str(info.value), (pos, mask)


def test_flipped_data_byte_reports_checksum(tmp_path: Path) -> None:
    path = tmp_path / "d.gft"
    save_tensors(path, {"w": np.zeros(1000, np.float32)}, {})
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        load_tensors(path)


def test_trailing_bytes_are_rejected(tmp_path: Path) -> None:
    path = _small_file(tmp_path)
    with path.open("ab") as f:
        f.write(b"junk")
    with pytest.raises(CheckpointError, match="trailing"):
        load_tensors(path)


def test_lying_header_never_allocates_beyond_the_file(tmp_path: Path) -> None:
    path = _small_file(tmp_path)
    full = path.read_bytes()
    (hlen,) = struct.unpack("<Q", full[8:16])
    header = json.loads(full[16 : 16 + hlen])
    last = header["tensors"][-1]
    last["shape"] = [10**6, 10**6]  # 8 TB of float64
    last["nbytes"] = 8 * 10**12
    header["data_nbytes"] = last["offset"] + last["nbytes"]
    raw = json.dumps(header).encode()
    path.write_bytes(full[:8] + struct.pack("<Q", len(raw)) + raw + full[16 + hlen :])
    with pytest.raises(CheckpointError, match="truncated"):
        load_tensors(path)


def test_newer_format_version_says_upgrade(tmp_path: Path) -> None:
    path = _small_file(tmp_path)
    full = path.read_bytes()
    (hlen,) = struct.unpack("<Q", full[8:16])
    header = json.loads(full[16 : 16 + hlen])
    header["version"] = 99
    raw = json.dumps(header).encode()
    path.write_bytes(full[:8] + struct.pack("<Q", len(raw)) + raw + full[16 + hlen :])
    with pytest.raises(CheckpointError, match="upgrade geofed-hpc"):
        load_tensors(path)


def test_current_files_name_their_checksum_and_reject_an_unknown_one(tmp_path: Path) -> None:
    path = _small_file(tmp_path)
    full = path.read_bytes()
    (hlen,) = struct.unpack("<Q", full[8:16])
    header = json.loads(full[16 : 16 + hlen])
    assert header["checksum"] == "xxh3_128-blocks" and header["version"] == tensorfile.FORMAT_VERSION == 2
    header["checksum"] = "crc7"
    raw = json.dumps(header).encode()
    path.write_bytes(full[:8] + struct.pack("<Q", len(raw)) + raw + full[16 + hlen :])
    with pytest.raises(CheckpointError, match="unknown checksum 'crc7'"):
        load_tensors(path)


def test_blocks_are_read_in_parallel_and_each_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import xxhash

    monkeypatch.setattr(tensorfile, "BLOCK", 256)  # a file of many blocks, some across tensor boundaries
    tensors = _all_dtypes() | {"big": np.arange(1000, dtype=np.float32)}
    path = tmp_path / "blocks.gft"
    save_tensors(path, tensors, {"k": 1})
    full = path.read_bytes()
    body = full[:-40]
    blocks = b"".join(xxhash.xxh3_128(body[i : i + 256]).digest() for i in range(0, len(body), 256))
    assert full[-40:-24] == xxhash.xxh3_128(blocks).digest() and full[-24:-8] == bytes(16)
    loaded, meta = load_tensors(path)
    assert meta == {"k": 1} and loaded.keys() == tensors.keys()
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype and loaded[name].shape == value.shape
        np.testing.assert_array_equal(loaded[name], value)
    loaded["big"][0] = 5.0  # writable
    for where in (len(body) - 1, len(body) // 2, 300, 700):
        data = bytearray(full)
        data[where] ^= 0x04
        path.write_bytes(bytes(data))
        with pytest.raises(CheckpointError):
            load_tensors(path)


def test_atomic_write_failed_replace_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.gft"
    save_tensors(path, {"w": np.ones(4, np.float32)}, {"step": 1})

    def boom(src: object, dst: object) -> None:
        raise OSError("disk vanished")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk vanished"):
        save_tensors(path, {"w": np.full(4, 2.0, np.float32)}, {"step": 2})
    monkeypatch.undo()
    tensors, meta = load_tensors(path)
    assert meta == {"step": 1}
    np.testing.assert_array_equal(tensors["w"], np.ones(4, np.float32))
    assert [p.name for p in tmp_path.iterdir()] == ["m.gft"]  # the temp file was removed


def test_atomic_write_failing_source_keeps_previous(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    atomic_write_bytes(path, b"old")

    def chunks() -> Iterator[bytes]:
        yield b"new-part-1"
        raise RuntimeError("producer died")

    with pytest.raises(RuntimeError):
        atomic_write_bytes(path, chunks())
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["blob"]


_CRASH_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from geofed_hpc.ckpt import save_tensors
    where = sys.argv[2]
    if where == "replace":
        os.replace = lambda *a, **k: os._exit(7)
    else:
        os.fsync = lambda *a, **k: os._exit(7)
    save_tensors(sys.argv[1], {"w": np.full(1000, 2.0, np.float32)}, {"step": 2})
    """
)


@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_process_killed_mid_write_keeps_previous(tmp_path: Path, where: str) -> None:
    path = tmp_path / "m.gft"
    save_tensors(path, {"w": np.ones(1000, np.float32)}, {"step": 1})
    proc = subprocess.run([sys.executable, "-c", _CRASH_SCRIPT, str(path), where], capture_output=True, timeout=120)
    assert proc.returncode == 7, proc.stderr.decode()
    leftovers = [p for p in tmp_path.iterdir() if p != path]
    assert len(leftovers) == 1 and temp_target(leftovers[0]) == "m.gft"
    tensors, meta = load_tensors(path)
    assert meta == {"step": 1}
    np.testing.assert_array_equal(tensors["w"], np.ones(1000, np.float32))
    # the next write cleans the leftover temp file
    save_tensors(path, {"w": np.zeros(2, np.float32)}, {"step": 3})
    assert [p.name for p in tmp_path.iterdir()] == ["m.gft"]
    assert load_tensors(path)[1] == {"step": 3}


def test_ckpt_does_not_import_torch() -> None:
    code = "import sys, geofed_hpc.ckpt; assert 'torch' not in sys.modules, 'ckpt imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- CheckpointStore ---------------------------------------------------------------------------------------


def _save_steps(store: CheckpointStore, steps: list[int]) -> None:
    for s in steps:
        store.save(s, {"w": np.full(3, float(s), np.float32)}, {"step": s})


def test_store_names_prunes_and_loads_latest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck", prefix="client-osc", keep=2)
    assert store.load_latest() is None and store.latest_step() is None
    _save_steps(store, [10, 20, 30, 40])
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == ["client-osc-000000030.gft", "client-osc-000000040.gft"]
    assert store.latest_step() == 40
    loaded = store.load_latest()
    assert loaded is not None
    tensors, meta, path = loaded
    assert meta == {"step": 40} and path.name == "client-osc-000000040.gft"
    np.testing.assert_array_equal(tensors["w"], np.full(3, 40.0, np.float32))


@pytest.mark.parametrize("keep", [1, 3])
def test_store_keep(tmp_path: Path, keep: int) -> None:
    store = CheckpointStore(tmp_path, keep=keep)
    _save_steps(store, list(range(6)))
    assert [s for s, _ in store.files()] == list(range(6))[-keep:]


def test_store_falls_back_when_newest_is_corrupt(tmp_path: Path, warnings_log: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(tmp_path, prefix="ps", keep=3)
    _save_steps(store, [1, 2, 3])
    newest = store.path_for(3)
    newest.write_bytes(newest.read_bytes()[:-100])  # truncated
    loaded = store.load_latest()
    assert loaded is not None
    assert loaded[1] == {"step": 2} and loaded[2] == store.path_for(2)
    warnings = [r for r in warnings_log.records if r.levelno == logging.WARNING]
    assert any(str(newest) in r.getMessage() for r in warnings)

    data = bytearray(store.path_for(2).read_bytes())
    data[-50] ^= 0xFF  # corrupt, same length
    store.path_for(2).write_bytes(bytes(data))
    loaded = store.load_latest()
    assert loaded is not None and loaded[1] == {"step": 1}


def test_store_all_corrupt_is_none(tmp_path: Path, warnings_log: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(tmp_path)
    _save_steps(store, [1, 2])
    for _, p in store.files():
        p.write_bytes(b"")
    assert store.load_latest() is None
    assert store.latest_step() == 2  # by name; load_latest is what verifies


def test_store_ignores_other_files_and_cleans_its_temp_files(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, prefix="ckpt", keep=2)
    (tmp_path / "ckpt-best-000000005.gft").write_bytes(b"other store")
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / ".ckpt-000000003.gft.tmp-123-abcd").write_bytes(b"half a checkpoint")
    (tmp_path / ".other.gft.tmp-9-ffff").write_bytes(b"someone else's")
    _save_steps(store, [7])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".other.gft.tmp-9-ffff", "ckpt-000000007.gft", "ckpt-best-000000005.gft", "notes.txt"]
    assert store.latest_step() == 7


def test_store_saving_an_older_step_keeps_it(tmp_path: Path, warnings_log: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    _save_steps(store, [100, 200])
    path = store.save(50, {"w": np.zeros(1, np.float32)}, {"step": 50})
    assert path.exists()
    assert [s for s, _ in store.files()] == [50, 200]
    assert any("step 50" in r.getMessage() for r in warnings_log.records)


def test_store_overwrites_same_step(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    store.save(5, {"w": np.zeros(1, np.float32)}, {"v": 1})
    store.save(5, {"w": np.ones(1, np.float32)}, {"v": 2})
    loaded = store.load_latest()
    assert loaded is not None and loaded[1] == {"v": 2}
    assert len(store.files()) == 1


def test_store_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="keep"):
        CheckpointStore(tmp_path, keep=0)
    with pytest.raises(ConfigError, match="prefix"):
        CheckpointStore(tmp_path, prefix="../up")
    with pytest.raises(ValueError, match="step"):
        CheckpointStore(tmp_path).save(-1, {}, {})


def test_format_2_checks_every_block_and_format_1_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from geofed_hpc.ckpt import tensorfile

    monkeypatch.setattr(tensorfile, "BLOCK", 4096)  # a 40 KB file of 10 blocks, read and hashed in parallel
    tensors = {"w": np.arange(10_000, dtype=np.float32), "b": np.ones(7, np.int16), "e": np.zeros(0, np.float64)}
    new, old = tmp_path / "new.gft", tmp_path / "old.gft"
    save_tensors(new, tensors, {"k": 1})
    save_tensors(old, tensors, {"k": 1}, version=1)
    full = new.read_bytes()
    (hlen,) = struct.unpack("<Q", full[8:16])
    header = json.loads(full[16 : 16 + hlen])
    assert header["version"] == 2 and header["checksum"] == "xxh3_128-blocks" and len(full) > 9 * 4096
    old_full = old.read_bytes()
    assert old_full[-40:-8] == hashlib.sha256(old_full[:-40]).digest()  # format 1: as the first release wrote it
    for path in (new, old):
        loaded, meta = load_tensors(path)
        assert meta == {"k": 1} and set(loaded) == set(tensors)
        for k, v in tensors.items():
            np.testing.assert_array_equal(loaded[k], v)
            assert loaded[k].flags.writeable
    for pos in (16 + hlen + 8, 4096 * 3 + 7, len(full) - 41):  # in the header's block, a middle one, the last
        data = bytearray(full)
        data[pos] ^= 0x01
        new.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match="checksum"):
            load_tensors(new)
    data = bytearray(old.read_bytes())
    data[len(data) // 2] ^= 0x01
    old.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 checksum does not match"):
        load_tensors(old)
    with pytest.raises(ValueError, match="format version"):
        save_tensors(tmp_path / "x.gft", tensors, {}, version=3)
