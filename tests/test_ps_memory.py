"""PS memory: a push, its update and pulls leave the PS holding the model, the residual and the momentum, no more."""

from __future__ import annotations

import math
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from geofed_hpc import faults
from geofed_hpc.codec import stream
from geofed_hpc.codec.packed import PackedTensor
from geofed_hpc.config import CodecConfig
from geofed_hpc.paradigms.exchange import Exchange
from geofed_hpc.ps.aggregate import MeanAccumulator, add_update
from geofed_hpc.ps.model import GlobalModel
from geofed_hpc.ps.servicer import ParameterServerLogic
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.stream import collect
from tests.conftest import ps_config
from tests.test_ps_logic import Clock, joined, make, push_chunks

SHAPES = {"w": (1536, 1024), "v": (512, 1024)}  # 2,097,152 values: 8 MiB a copy
COPY = 4 * sum(math.prod(s) for s in SHAPES.values())
PIECE = 1 << 15  # values per codec piece here: what the PS holds of a piece in flight is 1/64 of the model


def arrays(seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(s) * scale).astype(np.float32) for k, s in SHAPES.items()}


@pytest.fixture
def traced() -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


def copies() -> tuple[float, float]:
    """(now, peak) of the memory traced since the last reset, in fp32 copies of the model."""
    now, peak = tracemalloc.get_traced_memory()
    return now / COPY, peak / COPY


def pull_full(logic: ParameterServerLogic, session: str) -> int:
    header, payload = collect(logic.stream_model(m.ModelRequest(session, 0, 0.0)), 1 << 30)
    size = len(payload)
    del payload
    return size


@pytest.mark.parametrize("codec_name", ["int8", "sparse"])
@pytest.mark.parametrize("outer", ["plain", "nesterov"])
def test_the_ps_holds_no_extra_full_copy_after_pushes_and_pulls(
    outer: str, codec_name: str, monkeypatch: pytest.MonkeyPatch, traced: None, tmp_path: Path
) -> None:
    """With an int8 or sparse run (downlink of the same codec, its residual kept), the PS holds after each async
    push and whole-model pull the model, the residual and (Nesterov) the momentum: 2 or 3 fp32 copies, plus the
    newest encoded update. At its peak while a push is decoded, folded, encoded, published and added, it holds
    less than one copy more (the push as its int8 contents, the encoded update, a few pieces): no decoded copy of
    the push, of the aggregate, of the update or of the model for pulls (each of which would add a whole one)."""
    monkeypatch.setattr(stream, "PIECE", PIECE)
    cfg = CodecConfig(name=codec_name, block_size=64)
    held = 3.0 if outer == "nesterov" else 2.0  # model, residual (, momentum)
    tracemalloc.stop()  # what the test itself builds is not the PS's
    logic = make(  # a state directory, as `ps up` has: the kept updates are files there, not memory
        "async", run_codec=codec_name, outer_optimizer=outer, global_lr=0.7, momentum=0.9, state_dir=str(tmp_path)
    )
    (s,) = joined(logic, 1)
    init_chunks = push_chunks(s, 0, arrays(0), init=True, push_id="init")
    pushes = [push_chunks(s, v, arrays(1 + v, 1e-3), cfg=cfg, push_id=f"p{v}") for v in range(2)]
    tracemalloc.start()
    assert logic.push_delta(iter(init_chunks)).accepted
    del init_chunks
    model_only, _ = copies()
    assert model_only < 1.1  # the model, nothing of the init push's payload
    assert pull_full(logic, s) > COPY // 2  # a whole-model pull (fp32, zstd): streamed from a file, not kept in memory
    after_pull, _ = copies()
    assert after_pull - model_only < 0.05
    peaks: list[float] = []
    for version, chunks in enumerate(pushes):
        tracemalloc.reset_peak()
        reply = logic.push_delta(iter(chunks))
        assert reply.accepted and logic.version == version + 1, reply.reason
        now, peak = copies()
        assert now <= held + 0.5, f"push {version}: the PS holds {now:.2f} copies after (expected {held} + an update)"
        assert peak <= held + 1.0, f"push {version}: the PS peaked at {peak:.2f} copies (expected {held} + < 1)"
        peaks.append(round(peak, 2))
        pull_full(logic, s)
        assert copies()[0] - now < 0.05  # the model of the new version for a whole pull: a file, not memory
    state = logic.core.model
    full_size = {k for k, v in state.params.items() if v.size == math.prod(SHAPES[k])}  # type: ignore[union-attr]
    assert full_size == set(SHAPES) and set(state.downlink.residual) == set(SHAPES)
    assert set(state.outer.buffers) == (set(SHAPES) if outer == "nesterov" else set())
    logic.finish()
    print(f"{outer} {codec_name}: peaks {peaks} fp32 copies")


def test_a_packed_push_decodes_exactly_as_the_whole_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dense push kept as its pieces' contents reads back, in any range and after scaling, the very bits the
    whole payload decodes to, times the factors in order."""
    monkeypatch.setattr(stream, "PIECE", 1 << 12)
    for name in ("int8", "int16", "int4", "bf16", "fp32", "paper_int8"):
        rng = np.random.default_rng(5)
        small = {"w": rng.standard_normal((64, 1000)), "v": rng.standard_normal(40_000) * 1e-2}
        small = {k: v.astype(np.float32) for k, v in small.items()}
        payload = stream.encode(small, CodecConfig(name=name, block_size=64))
        whole = stream.decode(payload)
        _, packed = stream.decode_stream(payload, packed=True)
        for k, t in packed.items():
            assert isinstance(t, PackedTensor), name
            np.testing.assert_array_equal(t.dense(), whole[k])
            np.testing.assert_array_equal(t.read(1000, 9000), whole[k].reshape(-1)[1000:9000])
            assert t.nbytes < (0.6 if name not in ("fp32", "bf16") else 1.01) * whole[k].nbytes
            t.scale(np.float32(0.3))
            t.scale(np.float32(1.7))
            expected = whole[k].reshape(-1)[5000:6000] * np.float32(0.3)
            expected *= np.float32(1.7)
            np.testing.assert_array_equal(t.read(5000, 6000), expected)
            np.testing.assert_array_equal(t.read(5000, 6000), expected)  # read again: the content is unchanged


def _reference_step(model: GlobalModel, delta: dict[str, np.ndarray]) -> None:
    """The update made the way the PS made it before it streamed: whole arrays (the optimizer's and the downlink's
    dense steps, the decoded update added), on a model of its own."""
    assert model.params is not None
    update, momentum = model.outer.propose({k: v.copy() for k, v in delta.items()})
    published = model.downlink.propose(model.version, update)
    model.downlink.commit(published)
    model.outer.commit(momentum)
    add_update(model.params, dict(model.exchange.expand(published.applied, model.version, {})))
    model.version += 1


@pytest.mark.parametrize("outer", ["plain", "nesterov", "fednova"])
@pytest.mark.parametrize("downlink", ["int8", "sparse", "fp32"])
def test_the_streamed_update_is_bit_identical_to_the_whole_array_one(
    outer: str, downlink: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Piece by piece (several pieces per tensor) the PS's model, momentum and residual come out with the very bits
    the whole-array steps give, version after version; so does what a site that applies the kept updates holds."""
    monkeypatch.setattr(stream, "PIECE", 1 << 12)
    cfg = ps_config(aggregation="async", outer_optimizer=outer, global_lr=0.7, momentum=0.9, downlink_codec=downlink)
    settings = m.RunSettings(aggregation="async", codec="int8", block_size=64)
    streamed = GlobalModel(cfg, settings, Exchange(), tmp_path / "updates")
    whole = GlobalModel(cfg, settings, Exchange(), None)
    start = arrays(11)
    streamed.seed({k: v.copy() for k, v in start.items()}, 0, "test")
    whole.seed({k: v.copy() for k, v in start.items()}, 0, "test")
    site = {k: v.copy() for k, v in start.items()}
    for v in range(4):
        delta = arrays(20 + v, 1e-2)
        acc = MeanAccumulator()
        acc.fold(stream.decode_stream(stream.encode(delta, CodecConfig(name="int8")), packed=True)[1], 1.0, 0.5)
        proposal = streamed.propose(acc.peek_sum(lazy=True).mean_sources()[0])
        streamed.commit(proposal)
        _reference_step(whole, acc.peek_sum().mean()[0])
        for got, want in [(streamed.params, whole.params), (streamed.downlink.residual, whole.downlink.residual),
                          (streamed.outer.buffers, whole.outer.buffers)]:  # fmt: skip
            assert got is not None and want is not None and got.keys() == want.keys()
            for k in want:
                np.testing.assert_array_equal(got[k], want[k], err_msg=f"version {v + 1}: {k}")
        kept = (tmp_path / "updates" / f"update-{v:09d}.gfdc").read_bytes()
        for k, value in stream.decode(kept).items():
            site[k] += value
    for k, value in site.items():
        np.testing.assert_array_equal(value, streamed.params[k])  # type: ignore[index]


def test_an_update_that_cannot_be_kept_leaves_no_file_and_is_made_once_later(tmp_path: Path) -> None:
    """The encoded update is written beside the kept ones and renamed into place when it is made: a full disk at
    that step leaves neither a kept update nor a partial file, and the round is made once when there is room."""
    clock = Clock()
    logic = make("async", clock, run_codec="int8", outer_optimizer="nesterov", state_dir=str(tmp_path))
    (s,) = joined(logic, 1)
    assert logic.push_delta(iter(push_chunks(s, 0, arrays(0), init=True, push_id="init"))).accepted
    updates = tmp_path / "updates"
    faults.install("atomic.write[update-]@1=enospc")
    try:
        cfg = CodecConfig(name="int8", block_size=64)
        assert logic.push_delta(iter(push_chunks(s, 0, arrays(1, 1e-3), cfg=cfg, push_id="p0"))).accepted
        assert logic.version == 0 and logic.rounds.count == 1
        assert not [p.name for p in updates.iterdir()]
    finally:
        faults.install("")
    clock.now += 10
    logic.tick()
    assert logic.version == 1 and logic.rounds.count == 0
    assert [p.name for p in updates.iterdir()] == ["update-000000000.gfdc"]
    logic.finish()
