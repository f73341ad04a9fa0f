"""model=hf: transformers causal LMs of other families than ours (Qwen2, Mistral, Gemma, Phi-3) from a local folder:
built on meta, initialised per seed or loaded from the folder's safetensors, refused with one line when the folder
does not fit, trained in a real federation (a real `ps up`, real site processes, one site on two FSDP2 ranks),
exported with `export hf` and loaded unchanged by transformers with the same logits."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from geofed_hpc.config import (
    CodecConfig,
    DataConfig,
    ModelConfig,
    ParadigmConfig,
    RunConfig,
    SiteConfig,
    TrainConfig,
    to_dict,
)
from geofed_hpc.data.prepare import prepare_shards
from geofed_hpc.data.tokenizer import load_tokenizer, run_tokenizer
from geofed_hpc.errors import ConfigError
from geofed_hpc.models import build_model
from geofed_hpc.models.registry import build_meta, decoder_blocks, materialize
from tests.conftest import ps_config
from tests.dist_util import free_port
from tests.site_procs import Site

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
VOCAB = 50257  # GPT-2's, whose tokenizer.json each folder holds (the bundled Bible trains with it)
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "mistral": ("MistralConfig", {"head_dim": 8, "sliding_window": None}),
    "gemma": ("GemmaConfig", {"head_dim": 8, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "phi3": ("Phi3Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
}


def hf_folder(folder: Path, family: str, weights: bool = False, tokenizer: bool = True, **changes: Any) -> Path:
    """A tiny model of `family` as a Hugging Face folder: config.json (transformers' own), its random weights when
    `weights`, GPT-2's tokenizer as tokenizer.json."""
    name, extra = FAMILIES[family]
    config = getattr(transformers, name)(**{**SHAPE, **extra, **changes})
    folder.mkdir(parents=True, exist_ok=True)
    if weights:
        with torch.random.fork_rng():
            torch.manual_seed(11)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    if tokenizer:
        load_tokenizer("gpt2").save(folder, SHAPE["max_position_embeddings"])
    return folder


def hf_model(folder: Path, context: int = 32, **fields: Any) -> ModelConfig:
    return ModelConfig(name="hf", arch="hf", path=str(folder), context=context, tokenizer="", **fields)


def same_logits(ours: torch.nn.Module, theirs: Any, atol: float = 1e-4) -> None:
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours.eval()(ids)[0] - theirs.eval()(ids).logits).abs().max().item()
    assert diff <= atol, diff


# ---------------------------------------------------------------- building, init, loading
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_folder_builds_its_architecture_on_meta_and_inits_per_seed(tmp_path: Path, family: str) -> None:
    cfg = hf_model(hf_folder(tmp_path / family, family))
    assert cfg.vocab_size == VOCAB and cfg.d_model == 32 and cfg.n_layers == 2 and cfg.max_positions == 64
    meta = build_meta(cfg)
    assert all(p.is_meta for p in meta.parameters()) and len(decoder_blocks(meta)) == 2
    assert type(meta).__name__ == getattr(transformers, FAMILIES[family][0].replace("Config", "ForCausalLM")).__name__
    a, b, c = build_model(cfg, seed=1), build_model(cfg, seed=1), build_model(cfg, seed=2)
    pa, pb, pc = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in pa)  # per seed, the same values
    assert not torch.equal(pa["model.layers.0.mlp.down_proj.weight"], pc["model.layers.0.mlp.down_proj.weight"])
    norm = pa["model.layers.0.input_layernorm.weight"]  # transformers' own init: Gemma's norms are 1 + w, w = 0
    assert torch.equal(norm, torch.zeros_like(norm) if family == "gemma" else torch.ones_like(norm))
    assert abs(pa["model.layers.1.self_attn.o_proj.weight"].std().item() - 0.02) < 0.005
    reference = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(cfg.path))
    buffers = dict(reference.named_buffers())
    for name, buffer in a.named_buffers():  # RoPE frequencies (and Gemma's embedding scale) as transformers has them
        assert torch.equal(buffer, buffers[name]), name
    reference.load_state_dict({**dict(a.named_parameters())}, strict=False)
    same_logits(a, reference, atol=0)
    assert cfg.param_count() == sum(p.numel() for p in a.parameters()) or family == "qwen2"  # qwen2: biases
    x = torch.randint(0, VOCAB, (2, 32))
    _, loss = a.train()(x, x)
    assert loss is not None and abs(loss.item() - np.log(VOCAB)) < 1.0  # about uniform at the start


def test_gelu_new_trains_as_pytorchs_fused_tanh_gelu_and_is_exported_under_its_own_name(tmp_path: Path) -> None:
    """GPT-2's "gelu_new" (separate operations, each kept for the backward pass) is built as the same function fused;
    the logits match transformers' own gelu_new model, and the config written back still says gelu_new."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    load_tokenizer("gpt2").save(tmp_path / "gpt2", 64)
    model = build_model(hf_model(tmp_path / "gpt2"), seed=0)
    assert type(model.transformer.h[0].mlp.act).__name__ == "GELUTanh"  # type: ignore[union-attr, index]
    assert model.config.activation_function == "gelu_new"  # type: ignore[union-attr]
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2")
    assert type(reference.transformer.h[0].mlp.act).__name__ == "NewGELUActivation"
    same_logits(model, reference, atol=1e-5)


def test_the_folders_weights_are_loaded_and_the_shards_init_as_one_process(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "q", "qwen2", weights=True)
    cfg = hf_model(folder)
    assert cfg.param_count() == sum(p.numel() for p in build_model(cfg, seed=0).parameters())
    same_logits(build_model(cfg, seed=5), transformers.AutoModelForCausalLM.from_pretrained(folder))
    # uninitialised, then the stream FSDP2's shards are filled from: the same tensors
    from geofed_hpc.models.stream import initial_stream

    model = materialize(build_meta(cfg), "cpu")
    streamed = dict(initial_stream(model, 0, torch.device("cpu")))
    assert all(torch.equal(streamed[n], p) for n, p in build_model(cfg, seed=0).named_parameters())


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_each_decoder_layer_with_the_same_gradients(
    tmp_path: Path, mode: str
) -> None:
    from geofed_hpc.client.blocks import checkpoint_blocks

    cfg = hf_model(hf_folder(tmp_path / "m", "mistral"))
    plain, checkpointed = build_model(cfg, seed=3), build_model(cfg, seed=3)
    assert checkpoint_blocks(checkpointed, mode) == 2
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    for model in (plain, checkpointed):
        model(x, x)[1].backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_folders_that_do_not_fit_are_refused_in_one_line(tmp_path: Path) -> None:
    def refused(match: str, make: Any) -> None:
        with pytest.raises(ConfigError, match=match) as info:
            make()
        assert "\n" not in str(info.value), info.value

    refused("model.path: model=hf needs the folder", lambda: ModelConfig(name="hf", arch="hf"))
    (tmp_path / "empty").mkdir()
    refused(r"model.path: .*empty has no config.json", lambda: hf_model(tmp_path / "empty"))
    unknown = hf_folder(tmp_path / "unknown", "mistral")
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "zebra-lm"}))
    refused(
        r"model.path: .*model_type 'zebra-lm', an architecture transformers .* does not know",
        lambda: build_meta(hf_model(unknown)),
    )
    refused(r"model.context: 128 is longer than the model's 64 positions", lambda: hf_model(unknown, context=128))

    weights = hf_folder(tmp_path / "w", "qwen2", weights=True)  # then config.json says otherwise
    config = {k: v for k, v in json.loads((weights / "config.json").read_text()).items() if k != "layer_types"}
    (weights / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    refused(
        r"weights do not match the config: .*model.safetensors tensor 'model.layers.0.mlp.\w+_proj.weight' has shape "
        r"\(\d+, \d+\) but .*config.json makes it \(\d+, \d+\)",
        lambda: build_model(hf_model(weights), 0),
    )
    (weights / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    refused(r"weights do not match the config: .*holds 'model.layers.1.", lambda: build_model(hf_model(weights), 0))
    (weights / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    refused(r"weights do not match the config: .* lack 12 of the tensors", lambda: build_model(hf_model(weights), 0))
    (weights / "config.json").write_text(
        json.dumps({**config, "num_hidden_layers": 2, "layer_types": ["sideways"] * 2})
    )
    refused(r"model.path: transformers cannot read .*config.json: .*sideways", lambda: build_meta(hf_model(weights)))

    small = hf_folder(tmp_path / "small", "gemma", vocab_size=300)  # GPT-2's tokenizer in a 300-id model
    cfg = RunConfig(model=hf_model(small))
    assert cfg.data.tokenizer == str(small / "tokenizer.json")  # the folder's own tokenizer is the run's
    refused(
        r"data.tokenizer: .* has 50,257 ids but the model has 300 \(vocab_size in .*small/config.json\)",
        lambda: run_tokenizer(cfg),
    )
    bare = RunConfig(model=hf_model(hf_folder(tmp_path / "bare", "gemma", tokenizer=False)))
    refused(r"data.tokenizer: model=hf's folder .*bare holds no tokenizer.json", lambda: run_tokenizer(bare))
    refused(
        "paradigm: split cuts one of this project's models",
        lambda: RunConfig(model=hf_model(small), paradigm=ParadigmConfig(name="split")),
    )


def test_without_transformers_model_hf_says_how_to_install_it(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "m", "qwen2")
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from geofed_hpc.cli import main\n"
        f"sys.exit(main(['launch', 'site=local', 'model=hf', 'model.path={folder}', 'model.context=32', '--dry-run']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if "transformers" in ln]
    assert lines and "pip install 'geofed-hpc[hf]'" in lines[-1], out.stdout + out.stderr


def test_lora_targets_each_familys_attention_projections(tmp_path: Path) -> None:
    from geofed_hpc.paradigms.adapters import select_targets

    qwen = build_meta(hf_model(hf_folder(tmp_path / "q", "qwen2")))
    assert sorted({n.rsplit(".", 1)[1] for n in select_targets(qwen, [])}) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    phi = build_meta(hf_model(hf_folder(tmp_path / "p", "phi3")))
    assert sorted(select_targets(phi, [])) == [
        f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("o_proj", "qkv_proj")
    ]
    assert sorted(select_targets(phi, ["*.mlp.*_proj"]))[:2] == [
        "model.layers.0.mlp.down_proj",
        "model.layers.0.mlp.gate_up_proj",
    ]
    assert len(select_targets(qwen, ["v_proj", "q_proj"])) == 4
    with pytest.raises(
        ConfigError, match=r"'wq' matches no linear layer.*available: self_attn.q_proj, self_attn.k_proj"
    ):
        select_targets(qwen, ["wq"])
    cfg = RunConfig(model=hf_model(tmp_path / "q"), paradigm=ParadigmConfig(name="lora"))
    assert cfg.paradigm.describe() == "lora(rank=4, alpha=8, targets=attention)"


@pytest.mark.parametrize("family", ["phi3", "qwen2"])
def test_hybrid_lora_ravan_and_zo_find_their_targets_and_train_on_any_family(tmp_path: Path, family: str) -> None:
    """Phi-3 fuses q, k and v into one qkv_proj; Qwen2 keeps them apart: each paradigm finds the attention
    projections of either, trains what it should, and RAVAN's merged model (what `export hf` writes) gives the
    adapted model's logits."""
    from geofed_hpc.models.hfmodel import fill
    from geofed_hpc.paradigms.site import site_paradigm

    folder = hf_folder(tmp_path / family, family)
    projections = ["qkv_proj", "o_proj"] if family == "phi3" else ["q_proj", "k_proj", "v_proj", "o_proj"]
    layers = sorted(f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in projections)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))

    def loss(model: torch.nn.Module, x: torch.Tensor = ids) -> torch.Tensor:
        logits = model(x[:, :-1])[0]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())

    def prepared(name: str) -> tuple[torch.nn.Module, Any]:
        model = build_model(hf_model(folder), seed=0)
        paradigm = site_paradigm(ParadigmConfig(name=name, rank=2, heads=2), 3)
        paradigm.prepare(model)
        return model, paradigm

    ravan, paradigm = prepared("ravan")
    heads = sorted(n for n, p in ravan.named_parameters() if p.requires_grad)
    assert (
        heads
        == sorted(paradigm.exchange.public({n: 0 for n in heads}))
        == [f"{layer}.ravan_h{i}" for layer in layers for i in (0, 1)]
    )
    with torch.no_grad():
        for name in heads:
            ravan.get_parameter(name).normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    params = {n: p.detach().numpy().copy() for n, p in ravan.named_parameters()}
    merged = build_model(hf_model(folder), seed=0, init=False)
    fill(merged, paradigm.exchange.merge(params), "the merged model")
    with torch.no_grad():
        assert (ravan.eval()(ids)[0] - merged.eval()(ids)[0]).abs().max().item() <= 1e-4

    hybrid, paradigm = prepared("hybrid_lora")
    private = sorted({n.rsplit(".", 1)[0] for n, _ in hybrid.named_parameters() if paradigm.exchange.is_private(n)})
    assert private == layers
    for phase in (0, 1):
        paradigm.set_phase(hybrid, phase)
        hybrid.zero_grad()
        loss(hybrid).backward()
        stepped = {n for n, p in hybrid.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        assert stepped and all(paradigm.exchange.is_private(n) == (phase == 1) for n in stepped), (phase, stepped)

    zo, paradigm = prepared("zo")
    before = {n: p.detach().clone() for n, p in zo.named_parameters()}
    value = paradigm.step(zo, lambda x, y: loss(zo), ids, ids)
    assert np.isfinite(value) and all(not torch.equal(p, before[n]) for n, p in zo.named_parameters())
    assert len(paradigm.wire_update({}, {n: t.numpy() for n, t in before.items()})) == 2  # coefficients, check


# ---------------------------------------------------------------- a real federation, exported
@contextmanager
def ps_up(state: Path, model: Path, *args: str) -> Iterator[str]:
    """`geofed-hpc ps up model=hf model.path=...` as its own process (plaintext, loopback); its address."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "geofed_hpc.cli", "ps", "up", "model=hf", f"model.path={model}", "model.context=32",
        f"ps.port={port}", f"ps.state_dir={state}", "codec=fp32", "train.sync_interval=10m", "train.max_local_steps=3",
        *args,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("parameter server on") or len(lines) > 200:
                break
        assert lines and lines[-1].startswith("parameter server on"), "".join(lines)
        yield f"127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Bible's first tokens, tokenized with the tokenizer.json the folders hold (GPT-2's, byte for byte)."""
    spec = hf_folder(tmp_path_factory.mktemp("tok"), "qwen2") / "tokenizer.json"
    out, cache = tmp_path_factory.mktemp("shards"), tmp_path_factory.mktemp("cache")
    prepare_shards(DataConfig(tokenizer=str(spec), source="bible", max_tokens=12000, cache_dir=str(cache)), out, 1)
    return out


def site_config(folder: Path, shards: Path, paradigm: ParadigmConfig, checkpointing: str = "none") -> RunConfig:
    """One site trains 2 syncs of 3 steps of the folder's model (the cadence its `ps up` imposes)."""
    return RunConfig(
        federation="hf",
        run_dir=str(folder.parent / f"run-{folder.name}"),
        wandb_mode="disabled",
        site=SiteConfig(num_sites=1),
        model=hf_model(folder),
        ps=ps_config(round_timeout="10m"),
        codec=CodecConfig(name="fp32"),
        data=DataConfig(source=str(shards), val_batches=1),
        train=TrainConfig(
            batch_size=4, lr=1e-2, sync_interval="10m", max_local_steps=3, max_syncs=2,
            activation_checkpointing=checkpointing,
        ),
        paradigm=paradigm,
    )  # fmt: skip


def federate(runs: list[tuple[Path, int, ParadigmConfig]], shards: Path) -> list[RunConfig]:
    """A federation per folder, side by side: a real `ps up` of its model and one site on `world` ranks."""
    cfgs = [site_config(f, shards, paradigm, "full" if f.name == "gemma" else "none") for f, _, paradigm in runs]
    with ExitStack() as stack:
        addresses = []
        for (folder, _, paradigm), cfg in zip(runs, cfgs, strict=True):
            extra = (
                [f"paradigm={paradigm.name}", f"paradigm.rank={paradigm.rank}"] if paradigm.name != "identity" else []
            )
            addresses.append(stack.enter_context(ps_up(Path(cfg.run_dir) / "ps", folder, *extra)))
        sites = []
        for (folder, world, _), cfg, address in zip(runs, cfgs, addresses, strict=True):
            sites.append(Site(to_dict(cfg), folder.parent / f"procs-{folder.name}", address, world=world))
            stack.callback(sites[-1].close)
        for site, (_, world, _) in zip(sites, runs, strict=True):
            assert site.wait(timeout=300) == [0] * world, site.output()
    return cfgs


def exported_matches(cfg: RunConfig, out: Path) -> None:
    """`export hf` of the run: transformers loads it unchanged (its own class), with our model's logits on the PS's
    final global weights (adapters merged), which moved from where they started."""
    from geofed_hpc.cli import main
    from geofed_hpc.commands.models import load_trained
    from geofed_hpc.models.hfmodel import fill

    assert main(["export", "hf", cfg.run_dir, str(out)]) == 0
    _, params, described = load_trained(cfg, cfg.run_dir)
    assert f"version 2, {cfg.paradigm.describe()}" in described, described
    ours = build_model(cfg.model, seed=0, init=False)
    fill(ours, params, "the global model")
    start = build_model(cfg.model, seed=cfg.train.seed)
    assert any(not torch.allclose(p, ours.get_parameter(n)) for n, p in start.named_parameters()), "it did not train"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(theirs) is getattr(transformers, type(theirs).__name__)  # transformers' own class, from its config
    model_type = json.loads((Path(cfg.model.path) / "config.json").read_text())["model_type"]
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type
    same_logits(ours, theirs)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("In the beginning")["input_ids"] == load_tokenizer("gpt2").encode("In the beginning")


def generates(src: str, capsys: pytest.CaptureFixture[str]) -> str:
    from geofed_hpc.cli import main

    capsys.readouterr()
    assert main(["generate", src, "--prompt", "In the beginning", "--max-new-tokens", "4"]) == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_three_families_train_in_federations_export_and_reload_in_transformers(
    tmp_path: Path, shards: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Qwen2 from its folder's weights on two FSDP2 ranks (gloo); Mistral from its weights with LoRA on its attention
    projections (the export merges them: only those weights change); Gemma from a seeded init, its decoder layers
    recomputed in the backward pass (activation checkpointing). `generate` runs the run and the export alike."""
    qwen = hf_folder(tmp_path / "qwen2", "qwen2", weights=True)
    mistral = hf_folder(tmp_path / "mistral", "mistral", weights=True)
    gemma = hf_folder(tmp_path / "gemma", "gemma")
    lora = ParadigmConfig(name="lora", rank=2)
    runs = [(qwen, 2, ParadigmConfig()), (mistral, 1, lora), (gemma, 1, ParadigmConfig())]
    for cfg, (folder, _, _) in zip(federate(runs, shards), runs, strict=True):
        exported_matches(cfg, tmp_path / f"out-{folder.name}")
    assert generates(str(tmp_path / "run-gemma"), capsys) == generates(str(tmp_path / "out-gemma"), capsys)
    gemma_log = (tmp_path / "procs-gemma" / "site-0-rank-0.log").read_text()
    assert "activation checkpointing full" in gemma_log, gemma_log[-3000:]
    log = (tmp_path / "procs-qwen2" / "site-0-rank-0.log").read_text()
    assert re.search(r"rank 0/2 .*\(FSDP2: [\d.]+M on this rank\)", log), log[-3000:]
    from safetensors.torch import load_file

    before, after = load_file(mistral / "model.safetensors"), load_file(tmp_path / "out-mistral" / "model.safetensors")
    changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
    assert changed and all(re.search(r"self_attn\.[qkvo]_proj\.weight$", n) for n in changed), changed
