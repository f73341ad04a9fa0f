"""`export hf` and `generate` from checkpoints: what `transformers` loads equals our model, and bad input is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.cli import main
from geofed_hpc.client.checkpoints import model_shape
from geofed_hpc.config import ModelConfig, ParadigmConfig, RunConfig
from geofed_hpc.data.tokenizer import load_tokenizer
from geofed_hpc.models import build_model
from geofed_hpc.models.export import hf_tensors, write_weights
from geofed_hpc.paradigms.site import site_paradigm
from geofed_hpc.ps.persist import PSState, Snapshots

GPT = ModelConfig(name="g", vocab_size=50257, context=32, d_model=32, n_layers=2, n_heads=4, d_ff=64)
LLAMA = ModelConfig(
    name="l", arch="llama", vocab_size=50257, context=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
    rope_theta=500000.0, rope_scaling=8.0, rope_original_context=16, max_positions=512, tie_embeddings=False,
)  # fmt: skip
IDS = torch.tensor([load_tokenizer("gpt2").encode("In the beginning God created the heaven and the earth. And")])

pytestmark = pytest.mark.usefixtures("restore_logging")


def adapted(model: ModelConfig, paradigm: ParadigmConfig, seed: int = 0) -> torch.nn.Module:
    """A model with adapters whose trainable tensors are random (so that merging them matters)."""
    net = build_model(model, seed=seed)
    site_paradigm(paradigm, 0).prepare(net)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.rsplit(".", 1)[-1].startswith(("lora_", "ravan_h")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return net.eval()


def site_checkpoint(folder: Path, net: torch.nn.Module, model: ModelConfig, paradigm: ParadigmConfig) -> Path:
    """A site checkpoint as a site writes one: model/* tensors and the model and paradigm it recorded."""
    cfg = RunConfig(model=model, paradigm=paradigm)
    tensors = {f"model/{k}": v.detach().numpy().copy() for k, v in net.named_parameters()}
    meta = {"version": 3, "syncs": 3, "global_model": False, "model": model_shape(cfg)}
    return CheckpointStore(folder, prefix="site").save(3, tensors, meta)


def hf_logits(folder: Path, ids: torch.Tensor = IDS) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return hf(ids).logits.float()


@pytest.mark.parametrize(
    "model, paradigm",
    [
        (GPT, ParadigmConfig(name="ravan", targets=["attn.qkv", "mlp.fc"], heads=2, rank=2)),
        (LLAMA, ParadigmConfig(name="lora", rank=2, alpha=4.0)),
        (GPT, ParadigmConfig(name="lora", targets=["attn.qkv", "lm_head"], rank=1)),  # the tied embedding too
    ],
)
def test_adapters_are_merged_and_transformers_gives_our_logits(
    tmp_path: Path, model: ModelConfig, paradigm: ParadigmConfig
) -> None:
    net = adapted(model, paradigm)
    ckpt = site_checkpoint(tmp_path / "ckpt", net, model, paradigm)
    assert main(["export", "hf", str(ckpt), str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "float32" and config["vocab_size"] == model.vocab_size
    with torch.no_grad():
        ours = net(IDS)[0]
    assert (hf_logits(tmp_path / "out") - ours).abs().max() <= 1e-4


def test_bf16_sharded_and_long_context_llama(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    net = build_model(LLAMA, seed=3).eval()
    params = {k: v.detach().numpy() for k, v in net.named_parameters()}
    ids = torch.randint(0, LLAMA.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    ckpt = site_checkpoint(tmp_path / "ckpt", net, LLAMA, ParadigmConfig())
    assert main(["export", "hf", str(ckpt), str(tmp_path / "fp32")]) == 0
    with torch.no_grad():
        ours = net(ids)[0]
    assert (hf_logits(tmp_path / "fp32", ids) - ours).abs().max() <= 1e-4  # RoPE scaled past the original context
    assert main(["export", "hf", str(ckpt), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16" and config["max_position_embeddings"] == 512
    assert config["rope_parameters"]["rope_type"] == "llama3" and config["rope_parameters"]["factor"] == 8.0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert hf.dtype == torch.bfloat16
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    write_weights(hf_tensors(LLAMA, params, "fp32", "test"), sharded, max_shard_bytes=2_000_000)
    for name in ("config.json", "generation_config.json"):
        (sharded / name).write_text((tmp_path / "fp32" / name).read_text())
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (sharded / "model.safetensors").exists()
    assert (hf_logits(sharded, ids) - ours).abs().max() <= 1e-4


def test_a_ps_snapshot_exports_with_the_model_named_and_generates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    net = build_model(GPT, seed=5).eval()
    params = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
    path = Snapshots(tmp_path / "state").save(PSState(7, params, settings={"paradigm": "identity"}))
    shape = [f"model.{k}={v}" for k, v in (("d_model", 32), ("n_heads", 4), ("d_ff", 64), ("context", 32))]
    args = ["export", "hf", str(path), str(tmp_path / "out"), *shape]
    assert main(args) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (hf(IDS).logits - net(IDS)[0]).abs().max() <= 1e-4
        want = hf.generate(IDS, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[0, IDS.shape[1] :]
    capsys.readouterr()
    prompt = "In the beginning God created the heaven and the earth. And"
    assert main(["generate", str(tmp_path / "state"), "--prompt", prompt, "--max-new-tokens", "8", *shape]) == 0
    tok = load_tokenizer("gpt2")
    greedy = want.tolist()
    greedy = greedy[: greedy.index(tok.eot_id) + 1] if tok.eot_id in greedy else greedy  # ours stops there
    assert capsys.readouterr().out == prompt + tok.decode(greedy) + "\n"


def bad(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(args) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("geofed-hpc: error:")]
    assert len(errors) == 1
    return errors[0]


def test_bad_sources_and_outputs_are_one_line_and_leave_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    net = build_model(GPT, seed=0)
    ckpt = site_checkpoint(tmp_path / "ckpt", net, GPT, ParadigmConfig())
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "notes.txt").write_text("x")
    out = tmp_path / "out"
    assert "is none of a run directory, a PS snapshot" in bad(
        ["export", "hf", str(tmp_path / "stuff"), str(out)], capsys
    )
    assert "does not exist" in bad(["export", "hf", str(tmp_path / "nowhere"), str(out)], capsys)
    message = bad(["export", "hf", str(tmp_path / "stuff" / "notes.txt"), str(out)], capsys)
    assert "notes.txt is none of a run directory" in message and "not a geofed tensor file" in message
    message = bad(["export", "hf", str(ckpt), str(tmp_path / "stuff")], capsys)
    assert "stuff exists and is not empty" in message and "--force" in message
    message = bad(["export", "hf", str(ckpt), str(out), "model=tiny_llama"], capsys)
    assert "holds a gpt2 model but model=tiny_llama is llama" in message
    snap = Snapshots(tmp_path / "state").save(PSState(1, {k: v.detach().numpy() for k, v in net.named_parameters()}))
    assert "holds a gpt2 model but model.arch is llama" in bad(
        ["export", "hf", str(snap), str(out), "model=tiny_llama"], capsys
    )
    assert "--site picks a site of a run directory" in bad(["export", "hf", str(ckpt), str(out), "--site", "x"], capsys)
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert main(["export", "hf", str(ckpt), str(tmp_path / "stuff"), "--force"]) == 0
    assert not (tmp_path / "stuff" / "notes.txt").exists() and (tmp_path / "stuff" / "model.safetensors").exists()


def test_hf_tensors_refuse_a_model_of_another_shape() -> None:
    from geofed_hpc.errors import ConfigError

    params: dict[str, Any] = {k: v.detach().numpy() for k, v in build_model(GPT, seed=0).named_parameters()}
    other = ModelConfig(**{**GPT.__dict__, "vocab_size": 1000})
    with pytest.raises(ConfigError, match=r"src: tensor 'wte.weight' has shape \(50257, 32\) but model=g needs"):
        hf_tensors(other, params, "fp32", "src")
    assert np.array_equal(hf_tensors(GPT, params, "fp32", "s")["transformer.h.0.attn.c_attn.weight"].numpy(),
                          params["blocks.0.attn.qkv.weight"].T)  # fmt: skip
