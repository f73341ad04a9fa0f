"""`export hf` and `generate`: a trained model out of a run directory, a PS snapshot or a site checkpoint."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from geofed_hpc.commands.options import OPTIONS
from geofed_hpc.config import ModelConfig, ParadigmConfig, RunConfig, from_dict, to_dict
from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger
from geofed_hpc.paths import writable_dir


def _model_config(cfg: RunConfig, shape: dict[str, Any] | None, where: str) -> ModelConfig:
    """The model a checkpoint recorded (model= may name it too, but not another one), else the composed one."""
    if shape is None:
        return cfg.model
    recorded = {k: v for k, v in shape.items() if k != "paradigm"}
    if OPTIONS.model_given and recorded.get("arch", cfg.model.arch) != cfg.model.arch:
        raise ConfigError(
            f"{where} holds a {recorded.get('arch')} model but model={cfg.model.name} is {cfg.model.arch}; "
            "leave model= out (the checkpoint records its model) or give the run's model"
        )
    return from_dict(ModelConfig, {**to_dict(cfg.model), **recorded, "init_from": ""})


def load_trained(cfg: RunConfig, src: str, site: str = "") -> tuple[ModelConfig, dict[str, Any], str]:
    """(model config, plain weights with adapters merged, a description) of the model `src` names: a run
    directory's newest global model (or --site's own), a PS snapshot, or a site checkpoint."""
    from geofed_hpc.ckpt import CheckpointStore, load_tensors
    from geofed_hpc.ckpt.sources import locate
    from geofed_hpc.paradigms.exchange import exchange_for
    from geofed_hpc.ps.persist import Snapshots, load_init

    where = locate(Path(src), site)
    path, meta = where.path, where.meta
    if where.kind == "snapshot":
        loaded = Snapshots(path).load() if path.is_dir() else None
        if path.is_dir() and loaded is None:
            raise ConfigError(f"{path}: none of its PS snapshots loads; give a site checkpoint instead")
        params, version = (loaded[0].params, loaded[0].version) if loaded else load_init(path)
        path = loaded[1] if loaded else path
        paradigm = str((loaded[0].settings if loaded else meta.get("settings", {})).get("paradigm", "identity"))
    else:
        latest = CheckpointStore(path, prefix="site").load_latest() if path.is_dir() else (*load_tensors(path), path)
        if latest is None:
            raise ConfigError(f"{path}: none of its site checkpoints loads")
        tensors, meta, path = latest
        params = {k[6:]: v for k, v in tensors.items() if k.startswith("model/")}
        version, paradigm = int(meta.get("version", 0)), str((meta.get("model") or {}).get("paradigm", "identity"))
    try:
        pcfg = ParadigmConfig.from_description(paradigm)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if pcfg.name == "hybrid_lora":  # the shared model, or a site's own with its private adapters merged
        merged = (
            exchange_for(pcfg).public(params)
            if where.global_model
            else exchange_for(replace(pcfg, name="lora")).merge(params)
        )
    else:
        merged = exchange_for(pcfg).merge(params)
    return _model_config(cfg, where.shape, str(path)), merged, f"{path} (version {version}, {paradigm})"


def _tokenizer_for(cfg: RunConfig, model: ModelConfig) -> Any:
    from geofed_hpc.data.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.data.tokenizer or model.tokenizer or "")
    if tok.vocab_size > model.vocab_size or model.vocab_size > tok.vocab_size + 4096:
        raise ConfigError(
            f"data.tokenizer: {tok.name} has {tok.vocab_size:,} ids but the model has {model.vocab_size:,}; give the "
            "run's tokenizer (data.tokenizer=PATH of its tokenizer.json)"
        )
    return tok


def cmd_export_hf(cfg: RunConfig) -> int:
    from geofed_hpc.ckpt.atomic import atomic_dir
    from geofed_hpc.models.export import write_model

    if len(OPTIONS.paths) != 2:
        raise ConfigError("export hf: give the source and the output folder: export hf SRC OUT [--dtype bf16]")
    src, out = OPTIONS.paths
    writable_dir(Path(out).expanduser().absolute().parent, "export hf OUT")
    model, params, described = load_trained(cfg, src, OPTIONS.site)
    tok = _tokenizer_for(cfg, model)
    with atomic_dir(Path(out), OPTIONS.force) as folder:
        write_model(folder, model, params, OPTIONS.dtype, tok.bos_id, tok.eot_id, described)
        tok.save(folder, model.max_positions or model.context)
    print(f"exported {described} as a {model.arch} model ({OPTIONS.dtype}, tokenizer {tok.name}) to {out}")
    print(f"load it with: transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def cmd_generate(cfg: RunConfig) -> int:
    import torch

    from geofed_hpc.models import build_model
    from geofed_hpc.models.generate import generate

    if len(OPTIONS.paths) != 1:
        raise ConfigError('generate: give one model source: generate SRC --prompt "..."')
    model_cfg, params, described = load_trained(cfg, OPTIONS.paths[0], OPTIONS.site)
    tok = _tokenizer_for(cfg, model_cfg)
    model = build_model(model_cfg, seed=0, init=False)
    missing = set(dict(model.named_parameters())) - set(params)
    if missing or set(params) - set(dict(model.named_parameters())):
        raise ConfigError(f"{described}: its tensors do not fit model={model_cfg.name} ({sorted(missing)[:3]}...)")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(params[name]))
    prompt = tok.encode(OPTIONS.prompt) or [tok.bos_id]
    new = generate(model, prompt, OPTIONS.max_new_tokens, OPTIONS.temperature, tok.eot_id, OPTIONS.seed)
    logger.info("generated %d tokens with %s", len(new), described)
    print(OPTIONS.prompt + tok.decode(new), flush=True)
    return 0
