"""After a short real federation, `export hf` gives `transformers` the federation's model: same logits, same greedy
continuations, same token ids (tiny GPT with LoRA, tiny Llama with Llama 3's tokenizer and hybrid LoRA)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.cli import main
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
from geofed_hpc.data.corpus import tokenize_source
from geofed_hpc.data.prepare import prepare_shards
from geofed_hpc.data.sources import bible_documents, bible_path
from geofed_hpc.data.tokenizer import load_tokenizer
from geofed_hpc.models import build_model
from geofed_hpc.models.generate import generate
from geofed_hpc.paradigms.site import site_paradigm
from geofed_hpc.ps.app import ParameterServer
from geofed_hpc.ps.persist import Snapshots
from tests.conftest import ps_config
from tests.site_procs import Site

pytestmark = pytest.mark.slow


def federate(folder: Path, model: ModelConfig, paradigm: ParadigmConfig, tokenizer: str, lr: float) -> RunConfig:
    """Prepare the Bible's first tokens with `tokenizer`, then two sites train two rounds against a PS whose
    snapshots are in the run directory (as `launch site=local` keeps them)."""
    data = DataConfig(tokenizer=tokenizer, source="bible", max_tokens=20000, val_fraction=0.05)
    prepare_shards(data, folder / "shards", 2)
    run = folder / "run"
    cfg = RunConfig(
        federation="x",
        run_dir=str(run),
        wandb_mode="disabled",
        site=SiteConfig(num_sites=2),
        model=model,
        ps=ps_config(state_dir=str(run / "ps"), min_sites=2, round_timeout="10m"),  # rounds of both sites
        codec=CodecConfig(name="fp32"),
        data=DataConfig(tokenizer=tokenizer, source=str(folder / "shards"), val_batches=1),
        train=TrainConfig(batch_size=4, lr=lr, sync_interval="10m", max_local_steps=3, max_syncs=2),
        paradigm=paradigm,
    )
    ps = ParameterServer(cfg)
    sites = [Site(to_dict(cfg), folder / "procs", ps.address, index=i) for i in (0, 1)]
    try:
        for site in sites:
            assert site.wait(timeout=300) == [0], site.output()
    finally:
        for site in sites:
            site.close()
        ps.stop()
    return cfg


def ours(cfg: RunConfig, arrays: dict[str, np.ndarray]) -> torch.nn.Module:
    """The federation's model as it trains: adapters added (forward hooks), weights loaded."""
    net = build_model(cfg.model, seed=0)
    site_paradigm(cfg.paradigm, 3).prepare(net)
    params = dict(net.named_parameters())
    assert set(arrays) == set(params), set(arrays) ^ set(params)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(torch.from_numpy(arrays[name]))
    return net.eval()


def same_as_transformers(net: torch.nn.Module, out: Path, spec: str) -> None:
    """Logits within 1e-4, the same greedy continuation, and AutoTokenizer's ids equal ours on the shipped text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = load_tokenizer(spec)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([tok.encode("And God said, Let there be light: and there was light. And God saw")])
    with torch.no_grad():
        assert (hf(ids).logits - net(ids)[0]).abs().max() <= 1e-4
        theirs = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate(net, ids[0].tolist(), 12) == theirs[0, ids.shape[1] :].tolist()
    auto = AutoTokenizer.from_pretrained(out)
    docs = bible_documents(bible_path(), bible_path().read_text(encoding="utf-8"))
    theirs_ids = auto(docs, add_special_tokens=False)["input_ids"]
    joined = [i for n, d in enumerate(theirs_ids) for i in ([tok.eot_id] if n else []) + d]
    ours_ids = tokenize_source(DataConfig(tokenizer=spec, source="bible"), tok)
    assert ours_ids.tolist() == joined and auto.eos_token_id == tok.eot_id


def test_a_lora_gpt_federation_exports_its_merged_adapted_model(tmp_path: Path) -> None:
    model = ModelConfig(name="t", vocab_size=50257, context=32, d_model=32, n_layers=2, n_heads=2, d_ff=64)
    cfg = federate(tmp_path, model, ParadigmConfig(name="lora", rank=2), "gpt2", lr=2e-2)
    loaded = Snapshots(tmp_path / "run" / "ps").load()
    assert loaded is not None and loaded[0].version == 2
    assert main(["export", "hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    net = ours(cfg, loaded[0].params)  # the global base weights and the global adapters, unmerged
    assert any(n.endswith("lora_b") and p.abs().sum() > 0 for n, p in net.named_parameters())  # they trained
    same_as_transformers(net, tmp_path / "out", "gpt2")


def test_a_llama_federation_with_llama3_ids_exports_the_shared_and_a_sites_model(
    tmp_path: Path, llama3_tokenizer: str
) -> None:
    vocab = load_tokenizer(llama3_tokenizer).vocab_size
    model = ModelConfig(
        name="l", arch="llama", vocab_size=vocab, context=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
        d_ff=64, tokenizer=llama3_tokenizer,
    )  # fmt: skip
    paradigm = ParadigmConfig(name="hybrid_lora", rank=2, base_steps=2, adapter_steps=1)
    cfg = federate(tmp_path, model, paradigm, llama3_tokenizer, lr=3e-3)
    tokens = f"data.tokenizer={llama3_tokenizer}"
    assert main(["export", "hf", str(tmp_path / "run"), str(tmp_path / "shared"), tokens]) == 0
    loaded = Snapshots(tmp_path / "run" / "ps").load()
    assert loaded is not None
    shared = {**loaded[0].params}  # no adapters: they never leave their sites
    plain = ours(RunConfig(model=model, data=DataConfig(tokenizer=llama3_tokenizer)), shared)
    same_as_transformers(plain, tmp_path / "shared", llama3_tokenizer)

    site = ["export", "hf", str(tmp_path / "run"), str(tmp_path / "site0"), "--site", "local-0", tokens]
    assert main(site) == 0
    latest = CheckpointStore(tmp_path / "run" / "sites" / "local-0" / "ckpt", prefix="site").load_latest()
    assert latest is not None
    arrays = {k[6:]: v for k, v in latest[0].items() if k.startswith("model/")}
    assert any(k.endswith("lora_b") and np.abs(v).sum() > 0 for k, v in arrays.items())  # its adapters trained
    same_as_transformers(ours(cfg, arrays), tmp_path / "site0", llama3_tokenizer)
