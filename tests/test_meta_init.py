"""Models built on the meta device, sharded before anything is allocated, then initialised or loaded tensor by
tensor into each rank's shards: llama3_8b counted and sharded without materialising it; the same weights as one
process; a Hugging Face checkpoint streamed into two ranks' shards."""

from __future__ import annotations

import resource
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from geofed_hpc.cli import compose_config
from geofed_hpc.client.fsdp import full_state, load_streamed, local_numel, shard_model
from geofed_hpc.client.precision import Precision
from geofed_hpc.config import ModelConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.models import build_model, num_params
from geofed_hpc.models.init import initial_tensors
from geofed_hpc.models.registry import build_meta, materialize
from geofed_hpc.models.stream import hf_tensors, initial_stream
from tests.dist_util import run_ranks
from tests.test_hf_checkpoint import hf_gpt2_tensors, hf_llama_tensors

GPT = ModelConfig(name="g", vocab_size=128, context=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)
LLAMA = ModelConfig(
    name="l", arch="llama", vocab_size=128, context=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48
)
LLAMA3_8B = 8_030_261_248  # Llama 3.1 8B as published


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_llama3_8b_is_counted_sharded_and_initialised_on_meta_without_materialising() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg, _ = compose_config(["model=llama3_8b"])
    before = _peak_mb()
    model = build_meta(cfg.model)
    assert num_params(model) == LLAMA3_8B and all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is not model.wte.weight  # type: ignore[union-attr]  # 3.1 8B: untied head
    # rank 3 of 8 (a fake process group: no peers, no communication): its shards, then every tensor streamed in
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    try:
        shard_model(model, Precision("bf16"))
        assert local_numel(model) == LLAMA3_8B // 8
        loaded = load_streamed(model, initial_tensors(model, 0, "meta"), "the initial weights")
        assert loaded == len(list(model.parameters())) == 291
        assert all(p.is_meta for p in model.parameters())
    finally:
        dist.destroy_process_group()
    assert _peak_mb() - before < 500  # 8B float32 would be 32 GB


def test_initial_weights_do_not_depend_on_the_order_or_the_device_build() -> None:
    a = build_model(LLAMA, seed=5)
    b = materialize(build_meta(LLAMA), "cpu")
    load_streamed(b, reversed(list(initial_tensors(b, 5))), "init")  # another order, the same values
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), name
    assert not torch.equal(a.wte.weight, build_model(LLAMA, seed=6).wte.weight)  # type: ignore[union-attr]


def _sharded_rank(rank: int, out: str, checkpoints: dict[str, str]) -> None:
    for cfg in (GPT, LLAMA):
        model = shard_model(build_meta(cfg), Precision("fp32"))
        model = materialize(model, "cpu")  # this rank's shards only
        assert local_numel(model) < num_params(model)
        load_streamed(model, initial_stream(model, 7, torch.device("cpu")), "init")
        state = full_state(model)
        streamed = shard_model(build_meta(cfg), Precision("fp32"))
        streamed = materialize(streamed, "cpu")
        load_streamed(streamed, hf_tensors(cfg, checkpoints[cfg.arch]), "model.init_from")
        hf = full_state(streamed)
        if rank == 0:
            np.savez(f"{out}/{cfg.arch}-init.npz", **{k: v.numpy() for k, v in state.items()})
            np.savez(f"{out}/{cfg.arch}-hf.npz", **{k: v.numpy() for k, v in hf.items()})


@pytest.mark.slow
def test_two_ranks_initialise_and_stream_a_checkpoint_into_their_shards_as_one_process_does(tmp_path: Path) -> None:
    sources = {}
    for cfg, convert in ((GPT, hf_gpt2_tensors), (LLAMA, hf_llama_tensors)):
        source = build_model(cfg, seed=11)
        sources[cfg.arch] = source
        save_file({k: v.contiguous() for k, v in convert(source).items()}, str(tmp_path / f"{cfg.arch}.safetensors"))
    files = {arch: str(tmp_path / f"{arch}.safetensors") for arch in sources}
    run_ranks(_sharded_rank, 2, str(tmp_path), files)
    for cfg in (GPT, LLAMA):
        one = build_model(cfg, seed=7)
        init = np.load(tmp_path / f"{cfg.arch}-init.npz")
        hf = np.load(tmp_path / f"{cfg.arch}-hf.npz")
        loaded = build_model(ModelConfig(**{**cfg.__dict__, "init_from": files[cfg.arch]}), seed=0)
        for name, param in one.named_parameters():
            assert np.array_equal(init[name], param.detach().numpy()), name  # bit for bit, whatever the sharding
            assert np.array_equal(hf[name], sources[cfg.arch].get_parameter(name).detach().numpy()), name
            assert np.array_equal(hf[name], loaded.get_parameter(name).detach().numpy()), name


def test_a_streamed_checkpoint_that_does_not_fit_names_the_tensor(tmp_path: Path) -> None:
    source = hf_llama_tensors(build_model(LLAMA, seed=0))
    path = tmp_path / "l.safetensors"
    save_file({k: v for k, v in source.items() if k != "model.norm.weight"}, str(path))
    model = materialize(build_meta(LLAMA), "cpu")
    with pytest.raises(ConfigError, match=r"model.init_from: lacks 1 of the model's tensors, e.g. \['norm.weight'\]"):
        load_streamed(model, hf_tensors(LLAMA, path), "model.init_from")
    wide = ModelConfig(**{**LLAMA.__dict__, "d_ff": 64})
    save_file(source, str(path))
    with pytest.raises(
        ConfigError, match=r"blocks.0.ffn.down.weight has shape \(32, 48\) but the model needs \(32, 64\)"
    ):
        load_streamed(materialize(build_meta(wide), "cpu"), hf_tensors(wide, path), "model.init_from")
    untied = dict(source, **{"lm_head.weight": source["model.embed_tokens.weight"] + 1})
    save_file(untied, str(path))
    with pytest.raises(ConfigError, match="model.tie_embeddings: is true but .* holds an lm_head.weight different"):
        list(hf_tensors(LLAMA, path))
