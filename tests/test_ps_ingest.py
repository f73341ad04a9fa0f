"""PS ingest: frames decode while the stream still arrives, concurrent pushes decode at once, memory stays bounded."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from geofed_hpc.codec import schemes
from geofed_hpc.codec.stream import Scratch
from geofed_hpc.errors import CodecError, ProtocolError
from geofed_hpc.ps.servicer import ParameterServerLogic
from geofed_hpc.rpc import messages as m
from tests.test_ps_bad_input import chunks_for, crafted
from tests.test_ps_logic import init, joined, make, push_chunks


def two_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal(20000).astype(np.float32), "b": rng.standard_normal(20000).astype(np.float32)}


def record_decodes(
    monkeypatch: pytest.MonkeyPatch, meet: threading.Barrier | None = None
) -> tuple[list[str], list[int]]:
    """Record the tensor of every decoded piece, and how many decodes ran at once (with `meet`, decodes wait there
    for as many others until it first trips: decodes that cannot run at once break it; the decodes after it, such as
    a fold's, run freely)."""
    names: list[str] = []
    running = [0]
    met = threading.Event()
    peaks: list[int] = []
    lock = threading.Lock()
    original = schemes.decode

    def decode(content: Any, plan: Any, out: Any, what: str, start: int = 0) -> None:
        with lock:
            running[0] += 1
            peaks.append(running[0])
        try:
            if meet is not None and not met.is_set():
                meet.wait(timeout=120)
                met.set()
            original(content, plan, out, what, start)
            names.append(what)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(schemes, "decode", decode)
    return names, peaks


def slots_free(logic: ParameterServerLogic) -> int:
    taken = []
    while (scratch := logic.ingest.take(f"probe-{len(taken)}")) is not None:  # a family takes at most half
        taken.append(scratch)
    for scratch in taken:
        logic.ingest.give_back(scratch)
    return len(taken)


def test_frames_are_decoded_while_the_stream_still_arrives(monkeypatch: pytest.MonkeyPatch) -> None:
    logic = make("async", downlink_codec="fp32")
    (s,) = joined(logic, 1)
    params = init(logic, s, {k: np.zeros_like(v) for k, v in two_tensors().items()})
    names, _ = record_decodes(monkeypatch)
    chunks = push_chunks(s, 0, two_tensors(1), push_id="overlap")
    seen_early: list[list[str]] = []

    def slow() -> Iterator[m.Chunk]:
        yield from chunks[:-1]
        deadline = time.monotonic() + 120
        while "tensor 'a'" not in names and time.monotonic() < deadline:
            time.sleep(0.01)
        seen_early.append(list(names))  # what was decoded before the last chunk was handed over
        yield chunks[-1]

    assert logic.push_delta(slow()).accepted
    assert seen_early == [["tensor 'a'"]]
    np.testing.assert_array_equal(logic.core.model.params["b"], two_tensors(1)["b"])  # type: ignore[index]
    assert params.keys() == {"a", "b"} and slots_free(logic) == logic.cfg.decode_threads


def test_concurrent_pushes_decode_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    logic = make("buffered", buffer_size=100, downlink_codec="fp32", decode_threads=2)
    a, b = joined(logic, 2)
    init(logic, a, {k: np.zeros_like(v) for k, v in two_tensors().items()})
    _, peaks = record_decodes(monkeypatch, meet=threading.Barrier(2))  # each decode waits for the other push's
    replies: list[m.PushReply] = []
    threads = [
        threading.Thread(
            target=lambda s=s, i=i: replies.append(
                logic.push_delta(iter(push_chunks(s, 0, two_tensors(i), push_id=f"c{i}")))
            )
        )
        for i, s in enumerate((a, b))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(replies) == 2 and all(r.accepted for r in replies)
    assert max(peaks) == 2 and logic.rounds.count == 2


def test_without_a_free_decoder_slot_a_push_is_staged_and_decoded_once_one_frees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logic = make("async", downlink_codec="fp32", decode_threads=1)
    (s,) = joined(logic, 1)
    init(logic, s, {k: np.zeros_like(v) for k, v in two_tensors().items()})
    busy = logic.ingest.take()  # another push is decoding
    assert busy is not None
    waiting = threading.Event()
    held = logic.ingest.held

    @contextmanager
    def waits_for_a_slot() -> Iterator[Scratch]:
        waiting.set()
        with held() as scratch:
            yield scratch

    monkeypatch.setattr(logic.ingest, "held", waits_for_a_slot)
    replies: list[m.PushReply] = []
    t = threading.Thread(target=lambda: replies.append(logic.push_delta(iter(push_chunks(s, 0, two_tensors(2))))))
    t.start()
    assert waiting.wait(timeout=120)  # received whole, now waiting for the slot
    assert list(logic.staging.directory.glob("push-*")) and not replies and logic.version == 0
    logic.ingest.give_back(busy)
    t.join(timeout=30)
    assert replies and replies[0].accepted and logic.version == 1
    assert not list(logic.staging.directory.glob("push-*")) and slots_free(logic) == 1


def test_a_broken_or_refused_stream_leaves_the_model_and_frees_its_decoder() -> None:
    logic = make("async", downlink_codec="fp32")
    (s,) = joined(logic, 1)
    init(logic, s, {k: np.zeros_like(v) for k, v in two_tensors().items()})
    before = logic.model_hash()
    chunks = push_chunks(s, 0, two_tensors(3), push_id="broken")
    cut = chunks[:-1]
    cut[-1] = m.Chunk(data=cut[-1].data[:-5] + b"\0" * 5)  # damaged in transit: the checksum fails
    with pytest.raises(CodecError, match="truncated|checksum"):
        logic.push_delta(iter(cut))
    bad = {"a": np.full(20000, np.nan, np.float32), "b": np.zeros(20000, np.float32)}
    with pytest.raises(ProtocolError, match="NaN or Inf"):  # verified, then refused by its decoder
        logic.push_delta(iter(chunks_for(s, crafted(bad), push_id="nan")))
    assert logic.model_hash() == before and logic.version == 0
    assert slots_free(logic) == logic.cfg.decode_threads
    assert logic.push_delta(iter(push_chunks(s, 0, two_tensors(4), push_id="good"))).accepted
