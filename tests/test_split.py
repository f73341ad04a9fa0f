"""Split learning in memory and over gRPC: the parts compose, alignment fits, bad uploads leave the server part."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from geofed_hpc import codec
from geofed_hpc.config import CodecConfig, ModelConfig, ParadigmConfig, RunConfig
from geofed_hpc.errors import (
    AuthError,
    CheckpointError,
    CodecError,
    ConfigError,
    GeofedError,
    LimitError,
    MismatchError,
    ProtocolError,
)
from geofed_hpc.models import build_model
from geofed_hpc.paradigms import exchange_for
from geofed_hpc.paradigms.cutserver import CutServer
from geofed_hpc.paradigms.site import SplitSite, site_paradigm
from geofed_hpc.paradigms.split import ClientPart, ServerPart
from geofed_hpc.ps.app import ParameterServer, attach_split_part, run_settings
from geofed_hpc.ps.servicer import ParameterServerLogic
from geofed_hpc.ps.split.service import SplitService
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient
from geofed_hpc.rpc.guard import bearer
from geofed_hpc.rpc.stream import collect, digest, to_chunks
from tests.conftest import ps_config
from tests.test_ps_bad_input import crafted

MODEL = ModelConfig(name="t", vocab_size=1000, context=16, d_model=16, n_layers=3, n_heads=2, d_ff=32)
LLAMA = replace(MODEL, arch="llama", n_kv_heads=1, tie_embeddings=False)
FP32 = CodecConfig(name="fp32")
B, T, D = 2, 8, MODEL.d_model


def split_cfg(state_dir: str = "", name: str = "fsl_sage", **paradigm: Any) -> RunConfig:
    settings = {"cut": 1, "aux_blocks": 1, "buffer_sequences": 8, "align_steps": 6, "server_lr": 1e-2, **paradigm}
    return RunConfig(
        model=MODEL,
        ps=ps_config(state_dir=state_dir, aggregation="async"),
        codec=FP32,
        paradigm=ParadigmConfig(name=name, **settings),
        wandb_mode="disabled",
    )


def make_split(cfg: RunConfig) -> tuple[ParameterServerLogic, SplitService, str]:
    """An in-memory PS with its server part, seeded with a site's client part; a session of it."""
    logic = ParameterServerLogic(cfg.ps, run_settings(cfg), exchange=exchange_for(cfg.paradigm))
    service = attach_split_part(cfg, logic)
    assert service is not None
    session = logic.join(m.JoinRequest("s", paradigm=cfg.paradigm.describe())).session_id
    if not logic.initialized:  # a restarted PS has its model from the snapshot
        client = ClientPart(build_model(MODEL, seed=0), cfg.paradigm)
        arrays = {n: p.detach().numpy().copy() for n, p in client.named_parameters()}
        payload = codec.encode(arrays, FP32)
        header = m.PushHeader(session, 0, 0, 0, "fp32", len(payload), digest(payload), "init", init=True)
        assert logic.push_delta(iter(to_chunks(header, payload, 1 << 16))).accepted
    return logic, service, session


def batch(seed: int = 0, b: int = B, t: int = T, d: int = D) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(b, t, d)).astype(np.float32), rng.integers(0, MODEL.vocab_size, (b, t)).astype(np.int64)


def upload(
    session: str,
    acts: np.ndarray,
    targets: np.ndarray,
    *,
    kind: str = "train",
    cut: int = 1,
    codec_name: str = "bf16",
    shape: list[int] | None = None,
    encoded: bytes | None = None,
) -> list[m.Chunk]:
    enc = encoded if encoded is not None else codec.encode({"acts": acts}, CodecConfig(name=codec_name))
    payload = enc + codec.encode({"targets": targets.astype(np.float32)}, FP32)
    header = m.SplitHeader(session, kind, cut, shape or list(acts.shape), codec_name, len(payload), digest(payload))
    header.acts_bytes = len(enc)
    return list(to_chunks(header, payload, 4096))


def answer(service_or_logic: Any, chunks: list[m.Chunk]) -> tuple[m.SplitHeader, bytes]:
    header, payload = collect(service_or_logic.split(iter(chunks)), 1 << 30)
    assert isinstance(header, m.SplitHeader)
    return header, bytes(payload)


# ---------------------------------------------------------------- the parts
@pytest.mark.parametrize("cfg", [MODEL, LLAMA], ids=["gpt2", "llama"])
def test_client_and_server_parts_compose_to_the_full_model(cfg: ModelConfig) -> None:
    x, y = torch.randint(0, cfg.vocab_size, (2, 12)), torch.randint(0, cfg.vocab_size, (2, 12))
    full = build_model(cfg, seed=3)
    paradigm = ParadigmConfig(name="fsl_sage", cut=1, aux_blocks=2)
    client, server = ClientPart(build_model(cfg, seed=3), paradigm), ServerPart(build_model(cfg, seed=3), 1)
    z, _ = client.smash(x)
    torch.testing.assert_close(server(z, y)[1], full(x, y)[1])
    torch.testing.assert_close(client(x, y)[1], full(x, y)[1])  # the aux starts as a copy of the server part
    names = {n for n, _ in full.named_parameters()}
    ours = {n for n, _ in client.named_parameters() if not n.startswith("aux.")} | {
        n for n, _ in server.named_parameters()
    }
    assert ours == names | {"lm_head.weight"}  # the server's own output layer (tied: a copy of the embedding)
    assert not {n for n, _ in client.named_parameters() if n.startswith("blocks.1") or n.startswith("ln_f")}
    aux = {n for n, _ in client.named_parameters() if n.startswith("aux.")}
    assert {n for n, p in client.named_parameters() if not p.requires_grad} == aux  # alignment alone moves it
    local = ClientPart(build_model(cfg, seed=3), replace(paradigm, aux_local=True))
    frozen = {n for n, p in local.named_parameters() if not p.requires_grad}
    assert frozen == ({"aux.head.weight"} if cfg.arch == "llama" else set())  # the aux's output layer is fixed


@pytest.mark.parametrize("aux_local", [False, True])
def test_a_local_step_trains_the_aux_only_with_aux_local(aux_local: bool) -> None:
    client = ClientPart(build_model(MODEL, seed=0), ParadigmConfig(name="fsl_sage", cut=1, aux_local=aux_local))
    before = {n: p.detach().clone() for n, p in client.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in client.parameters() if p.requires_grad], lr=1e-2)
    x, y = torch.randint(0, MODEL.vocab_size, (2, T)), torch.randint(0, MODEL.vocab_size, (2, T))
    client.train()
    client(x, y)[1].backward()  # no link: the auxiliary model's loss, whose gradient at the cut is the estimate
    optimizer.step()
    moved = {n for n, p in client.named_parameters() if not torch.equal(p, before[n])}
    assert "blocks.0.attn.qkv.weight" in moved and "wte.weight" in moved  # the client part trains on the estimate
    aux = {n for n in before if n.startswith("aux.")}
    assert moved & aux == (aux if aux_local else set())


def test_a_cut_outside_the_model_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"paradigm\.cut: 3 leaves no block for the server part.*use 1\.\.2"):
        RunConfig(model=MODEL, paradigm=ParadigmConfig(name="split", cut=3))
    with pytest.raises(ConfigError, match=r"paradigm\.aux_blocks: 3 is more than the server part's 2 blocks"):
        RunConfig(model=MODEL, paradigm=ParadigmConfig(name="fsl_sage", cut=1, aux_blocks=3))
    for cfg in (
        ParadigmConfig(name="fsl_sage", cut=2, align_interval=3, act_codec="int8"),
        ParadigmConfig(name="split"),
    ):
        again = ParadigmConfig.from_description(cfg.describe())
        assert again.describe() == cfg.describe() and again.cut == cfg.cut


def test_alignment_lowers_the_gradient_estimate_error() -> None:
    paradigm = ParadigmConfig(name="fsl_sage", cut=1, aux_blocks=1, align_steps=30, server_lr=1e-2, buffer_sequences=8)
    server = CutServer(MODEL, paradigm, seed=0, device=torch.device("cpu"))
    client = ClientPart(build_model(MODEL, seed=0), paradigm)
    start = {n: p.detach().numpy().copy() for n, p in client.named_parameters()}
    for i in range(6):  # the server part moves away from the copy the aux started as
        loss, grad = server.train(*batch(i))
        assert np.isfinite(loss) and grad is None
    fitted = server.align(start, version=2)
    before, after = server.align_error
    assert after < 0.8 * before, server.align_error
    assert set(fitted) == {n for n, _ in client.named_parameters() if n.startswith("aux.") and ".head." not in n}
    assert server.alignments == 1 and server.aligned_version == 2 and server.kept.sequences == 8  # the buffer's size


def test_a_fitted_aux_goes_in_once_at_the_first_step_of_its_round_and_survives_a_requeue() -> None:
    cfg = ParadigmConfig(name="fsl_sage", cut=1, aux_blocks=1, align_interval=2, server_update_interval=3)
    site = site_paradigm(cfg, 4)
    assert isinstance(site, SplitSite)
    model = site.site_model(build_model(MODEL, seed=0))
    assert isinstance(model, ClientPart)
    name = "aux.norm.weight"
    assert not site.alignment_due(1) and site.alignment_due(2)
    site.take_fitted({name: np.full(D, 7.0, np.float32)}, 2)
    assert not site.alignment_due(2)
    saved = site.state()  # a requeue between the pull and the round
    again = site_paradigm(cfg, 4)
    again.load_state(saved)
    for paradigm in (site, again):
        paradigm.begin_round(2, 0, 0)
        paradigm.before_step(model, 3)
        assert torch.equal(model.get_parameter(name), torch.full((D,), 7.0)) and model.upload_due
        with torch.no_grad():
            model.get_parameter(name).zero_()
        paradigm.before_step(model, 4)  # once only
        assert not model.get_parameter(name).any() and not model.upload_due
        assert not paradigm.alignment_due(2)
    late = site_paradigm(cfg, 4)
    late.load_state(saved)
    late.begin_round(3, 0, 0)  # the global model moved on: the fitted model is for another version
    late.before_step(model, 5)
    assert not model.get_parameter(name).any()


# ---------------------------------------------------------------- bad uploads
def _nan(s: str) -> list[m.Chunk]:
    acts, targets = batch()
    acts[0, 0, 0] = np.nan
    return upload(s, acts, targets, codec_name="fp32", encoded=crafted({"acts": acts}))


def _targets(values: np.ndarray) -> Callable[[str], list[m.Chunk]]:
    return lambda s: upload(s, batch()[0], values)


def _checksum(s: str) -> list[m.Chunk]:
    chunks = upload(s, *batch(5, b=8, t=16), codec_name="fp32")  # incompressible: several chunks
    assert len(chunks) > 1
    chunks[-1] = m.Chunk(data=bytes(len(chunks[-1].data)))
    return chunks


def _oversize(s: str) -> list[m.Chunk]:
    chunks = upload(s, *batch())
    assert chunks[0].split is not None
    chunks[0].split.total_bytes = 1 << 40
    return chunks


PUSH = m.PushHeader("s", 0, 1, 1, "fp32", 3, digest(b"abc"), "p")
BAD, PRE, LIMIT, LOSS, AUTH = (
    "INVALID_ARGUMENT",
    "FAILED_PRECONDITION",
    "RESOURCE_EXHAUSTED",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)
CASES: list[tuple[str, Callable[[str], list[m.Chunk]], type[GeofedError], str, str]] = [
    ("wrong-width", lambda s: upload(s, *batch(d=8)), ProtocolError, "8 wide: the server part takes 16", BAD),
    ("too-long", lambda s: upload(s, *batch(t=32)), ProtocolError, "32 positions.*at most 16", BAD),
    ("not-3d", lambda s: upload(s, *batch(), shape=[B, T]), ProtocolError, r"shape \[2, 8\]: expected \[batch", BAD),
    ("shape-lies", lambda s: upload(s, *batch(), shape=[B, T - 1, D]), ProtocolError, "expected tensors", BAD),
    ("wrong-dtype", lambda s: upload(s, *batch(), codec_name="fp32", encoded=crafted({"acts": batch()[0]},
        dtype="float16")), ProtocolError, "split upload refused", BAD),
    ("codec-not-allowed", lambda s: upload(s, *batch(), codec_name="int4"), ProtocolError, "activation codec", BAD),
    ("codec-lies", lambda s: upload(s, *batch(), encoded=codec.encode({"acts": batch()[0]}, CodecConfig(name="int8"))),
        ProtocolError, "header says codec 'bf16', the activations are 'int8'", BAD),
    ("nan", _nan, ProtocolError, "NaN or Inf", BAD),
    ("target-out-of-vocab", _targets(np.full((B, T), 1000)), ProtocolError, r"token ids in 0\.\.999", BAD),
    ("target-not-integer", _targets(np.full((B, T), 0.5)), ProtocolError, "token ids", BAD),
    ("another-cut", lambda s: upload(s, *batch(), cut=2), MismatchError, r"paradigm\.cut=2.*after block 1", PRE),
    ("over-the-buffer", lambda s: upload(s, *batch(b=9)), LimitError, r"9 sequences.*buffer_sequences", LIMIT),
    ("kind-of-split", lambda s: upload(s, *batch(), kind="gradient"), ProtocolError, "fsl_sage takes train, eval", BAD),
    ("unknown-session", lambda s: upload("0" * 32, *batch()), AuthError, "session", AUTH),
    ("wrong-checksum", _checksum, CodecError, "checksum", LOSS),
    ("oversize", _oversize, ProtocolError, "cannot hold 2x8x16 activations", BAD),
    ("push-header", lambda s: list(to_chunks(PUSH, b"abc", 4096)), ProtocolError, "split header", BAD),
    ("empty-stream", lambda s: [], ProtocolError, "split header", BAD),
]  # fmt: skip


def test_bad_uploads_are_refused_clearly_and_leave_the_server_part_untouched() -> None:
    logic, service, session = make_split(split_cfg())
    before = service.digest()
    for name, build, error, message, _ in CASES:
        with pytest.raises(error, match=message):
            answer(logic, build(session))
        assert service.digest() == before, name
        assert service.server.steps == 0 and not service.server.kept.items, name
    reply, grad = answer(logic, upload(session, *batch()))
    assert reply.kind == "train" and np.isfinite(reply.loss) and reply.server_steps == 1 and grad == b""
    assert service.digest() != before and service.server.kept.sequences == B
    evaluated, _ = answer(logic, upload(session, *batch(), kind="eval"))
    assert service.server.steps == 1 and evaluated.loss < reply.loss  # evaluated after the step, nothing changed
    logic.staging.close()


def test_split_answers_the_gradient_at_the_cut_and_an_identity_ps_has_no_server_part() -> None:
    logic, service, session = make_split(split_cfg(name="split"))
    acts, targets = batch()
    reply, payload = answer(logic, upload(session, acts, targets, kind="gradient"))
    grad = codec.decode(payload, expected={"grad": ((B, T, D), "float32")})["grad"]
    z = torch.from_numpy(acts).requires_grad_(True)
    fresh = ServerPart(build_model(MODEL, seed=0), 1)
    fresh(z, torch.from_numpy(targets))[1].backward()
    np.testing.assert_allclose(grad, z.grad.numpy(), atol=2e-4)  # bf16 on the wire, both ways
    with pytest.raises(MismatchError, match="split has no auxiliary model"):
        list(logic.fetch_aux(m.AuxRequest(session, 2, 1)))
    logic.staging.close()
    plain = ParameterServerLogic(ps_config(), m.RunSettings())
    with pytest.raises(MismatchError, match="runs paradigm identity: it has no server part"):
        list(plain.split(iter(upload(session, acts, targets))))
    plain.staging.close()


def test_bad_uploads_over_grpc_get_precise_statuses_and_another_cut_cannot_join() -> None:
    cfg = split_cfg()
    server = ParameterServer(cfg)
    try:
        with PSClient(cfg.ps, server.address) as client:
            client.connect()
            other = replace(cfg.paradigm, cut=2).describe()
            with pytest.raises(grpc.RpcError) as refused:
                client._calls["Join"](m.JoinRequest("s", paradigm=other), timeout=10)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "cut=2" in str(
                refused.value.details()
            )
            session = client.join(m.JoinRequest("s", paradigm=cfg.paradigm.describe())).session_id
            assert server.split is not None
            before = server.split.digest()
            raw = client._calls["Split"]
            for name, build, _, _, code in CASES:
                with pytest.raises(grpc.RpcError) as info:
                    list(raw(iter(build(session)), timeout=30, metadata=bearer(session)))
                assert info.value.code().name == code, f"{name}: {info.value.code().name} {info.value.details()}"
            assert server.split.digest() == before and server.split.server.steps == 0
            acts, targets = batch()
            payload = codec.encode({"acts": acts}, CodecConfig(name="int8"))
            header = m.SplitHeader(session, "train", 1, [B, T, D], "int8", 0, b"", len(payload))
            reply, _ = client.split(header, payload + codec.encode({"targets": targets.astype(np.float32)}, FP32))
            assert reply.server_steps == 1 and server.split.server.steps == 1
    finally:
        server.stop()


# ---------------------------------------------------------------- snapshots
def test_the_server_part_its_optimizer_and_buffer_survive_a_restart(tmp_path: Path) -> None:
    cfg = split_cfg(str(tmp_path / "ps"))
    logic, service, session = make_split(cfg)
    for i in range(3):
        answer(logic, upload(session, *batch(i)))
    header, payload = collect(logic.fetch_aux(m.AuxRequest(session, 0, 1)), 1 << 30)
    assert isinstance(header, m.SplitHeader) and header.alignments == 1 and payload  # aligned, then snapshotted
    # the fitted auxiliary model goes down in the activations' codec (bf16), within its rounding of the fitted one
    assert header.codec == cfg.paradigm.act_codec == codec.codec_name(payload) == "bf16"
    down, fitted = codec.decode(payload), service.server.fitted
    assert sorted(down) == sorted(fitted)
    assert all(np.allclose(down[k], v, rtol=2**-7, atol=1e-30) for k, v in fitted.items())
    tensors, meta = service.server.state()
    saved = (service.digest(), ({k: v.copy() for k, v in tensors.items()}, meta))
    answer(logic, upload(session, *batch(9)))  # after the snapshot: a crash loses this step
    logic.staging.close()

    crashed, again, _ = make_split(cfg)  # the same state directory, no close(): a kill
    assert again.digest() == saved[0] and again.server.steps == 3 and again.server.alignments == 1
    tensors, meta = again.server.state()
    assert meta == saved[1][1] and sorted(tensors) == sorted(saved[1][0])
    assert all(np.array_equal(tensors[k], v) for k, v in saved[1][0].items())  # optimizer, buffer, fitted aux
    answer(crashed, upload(session, *batch(9)))
    again.close()  # a graceful stop snapshots what came since
    crashed.staging.close()
    _, third, _ = make_split(cfg)
    assert third.server.steps == 4 and third.digest() == again.digest() and third.server.kept.sequences == 8
    shutil.copytree(tmp_path / "ps" / "split", tmp_path / "other" / "split")  # only the server part's snapshots
    other = split_cfg(str(tmp_path / "other"), cut=2)
    with pytest.raises(CheckpointError, match=r"holds a server part of fsl_sage\(cut=1.*this PS runs fsl_sage\(cut=2"):
        attach_split_part(other, ParameterServerLogic(other.ps, run_settings(other)))
