"""`export hf` and `generate`: a trained model out of a run directory, a PS snapshot or a site checkpoint."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geofed_hpc.commands.options import OPTIONS
from geofed_hpc.config import ModelConfig, ParadigmConfig, RunConfig, from_dict, to_dict
from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger
from geofed_hpc.paths import writable_dir

if TYPE_CHECKING:
    from geofed_hpc.ckpt.sources import Located
    from geofed_hpc.data.tokenizer import Tokenizer


def _model_config(cfg: RunConfig, shape: dict[str, Any] | None, where: str) -> ModelConfig:
    """The model a checkpoint recorded (model= may name it too, but not another one), else the composed one."""
    if shape is None:
        return cfg.model
    recorded = {k: v for k, v in shape.items() if k != "paradigm"}
    if "model.path" in OPTIONS.given:  # model=hf's folder given here (moved since the run): this one
        recorded.pop("path", None)
    if OPTIONS.model_given and recorded.get("arch", cfg.model.arch) != cfg.model.arch:
        raise ConfigError(
            f"{where} holds a {recorded.get('arch')} model but model={cfg.model.name} is {cfg.model.arch}; "
            "leave model= out (the checkpoint records its model) or give the run's model"
        )
    return from_dict(ModelConfig, {**to_dict(cfg.model), **recorded, "init_from": ""})


def _load_hf(folder: Path) -> tuple[ModelConfig, dict[str, Any], str]:
    """The model of a Hugging Face folder (`export hf`'s output), read with our loader of such checkpoints; a family
    other than ours (gpt2, llama) as model=hf."""
    from geofed_hpc.models.hf import read_hf_tensors
    from geofed_hpc.models.hfconfig import CONFIG_KEYS, model_fields, read_hf_config

    file = folder / "config.json"
    hf = read_hf_config(file)
    if hf.get("model_type") not in CONFIG_KEYS:
        return _load_any_hf(folder, hf)
    model = from_dict(ModelConfig, {**model_fields(hf, str(file)), "name": folder.name or "hf"})
    params = {name: tensor.float().numpy() for name, tensor, _ in read_hf_tensors(model, folder)}
    return model, params, f"{folder} (a Hugging Face {model.arch} model)"


def _load_any_hf(folder: Path, hf: dict[str, Any]) -> tuple[ModelConfig, dict[str, Any], str]:
    """A Hugging Face folder of a family we did not write (model=hf): its weights under transformers' names."""
    from geofed_hpc.models.hfmodel import build_hf_meta, hf_weight_tensors

    positions = hf.get("max_position_embeddings")
    context = positions if isinstance(positions, int) and positions > 0 else 1024
    model = ModelConfig(name=folder.name or "hf", arch="hf", path=str(folder), context=context, tokenizer="")
    params = {name: tensor.float().numpy() for name, tensor in hf_weight_tensors(model, build_hf_meta(model))}
    return model, params, f"{folder} (a Hugging Face {hf.get('model_type')} model)"


def load_trained(cfg: RunConfig, src: str, site: str = "") -> tuple[ModelConfig, dict[str, Any], str]:
    """(model config, plain weights with adapters merged, a description) of the model `src` names: a run
    directory's newest global model (or --site's own), a PS snapshot, a site checkpoint, or an exported folder."""
    from geofed_hpc.ckpt.sources import locate

    return load_located(cfg, locate(Path(src), site))


def load_located(cfg: RunConfig, where: Located) -> tuple[ModelConfig, dict[str, Any], str]:
    """load_trained's model, from the source `locate` found."""
    from geofed_hpc.ckpt import CheckpointStore, load_tensors
    from geofed_hpc.paradigms.exchange import exchange_for
    from geofed_hpc.ps.persist import Snapshots, load_init

    if where.kind == "hf":
        return _load_hf(where.path)
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


def _same_tokenizer(a: str, b: str) -> bool:
    """Two data.tokenizer values that name the same file (or both gpt2)."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    pa, pb = (pa / "tokenizer.json" if pa.is_dir() else pa), (pb / "tokenizer.json" if pb.is_dir() else pb)
    return pa.is_file() and pb.is_file() and pa.resolve() == pb.resolve()


def _exists(spec: str) -> bool:
    from geofed_hpc.data.tokenizer import GPT2

    path = Path(spec).expanduser()
    return spec == GPT2 or (path / "tokenizer.json" if path.is_dir() else path).is_file()


def recorded_tokenizer(run: Path) -> tuple[str, str, str] | None:
    """(tokenizer, its sha256 or "", where) of the tokenizer the run directory `run` records: the shard index of the
    data.source its launch.json's configs name (the newest launch's first), else that config's data.tokenizer (with
    the sha256 of RUN/data's index when that names the same file), else RUN/data's index (`data prepare
    run_dir=RUN`). None when the run records none."""
    from geofed_hpc.data.shards import INDEX, is_shard_dir, read_index
    from geofed_hpc.launch.manifest import load_manifest, manifest_path

    try:
        manifest = load_manifest(run)
    except ConfigError as exc:
        logger.warning("%s; looking for the run's tokenizer in %s instead", exc, run / "data")
        manifest = None
    configs = manifest.configs if manifest else {}
    newest = [job.cluster_site for job in reversed(manifest.jobs)] if manifest else []
    launched: tuple[str, str] | None = None  # (data.tokenizer, where) of the newest launch config naming one
    for name in sorted(configs, key=lambda n: newest.index(n) if n in newest else len(newest)):
        data = configs[name].get("data") if isinstance(configs[name], dict) else None
        if not isinstance(data, dict):
            continue
        source = str(data.get("source") or "")
        if source and is_shard_dir(source):
            folder = Path(source).expanduser()
            index = read_index(folder)
            return index.tokenizer, index.tokenizer_sha256, str(folder / INDEX)
        if data.get("tokenizer") and launched is None:
            launched = str(data["tokenizer"]), f"{manifest_path(run)} (configs.{name}.data.tokenizer)"
    prepared = read_index(run / "data") if is_shard_dir(str(run / "data")) else None
    if prepared is not None and (
        launched is None or _same_tokenizer(launched[0], prepared.tokenizer) or not _exists(launched[0])
    ):
        return prepared.tokenizer, prepared.tokenizer_sha256, str(run / "data" / INDEX)
    return (launched[0], "", launched[1]) if launched else None


def _the_runs(recorded: tuple[str, str, str]) -> tuple[Tokenizer, str]:
    """The tokenizer a run recorded, checked against the sha256 it recorded; ConfigError when it is gone or changed."""
    from geofed_hpc.data.tokenizer import load_tokenizer

    spec, sha256, where = recorded
    if not _exists(spec):
        raise ConfigError(
            f"data.tokenizer: the run was trained with {spec} (recorded in {where}), which is gone; give that "
            "tokenizer: data.tokenizer=PATH of its tokenizer.json"
        )
    tok = load_tokenizer(spec)
    if sha256 and tok.identity != sha256:
        raise ConfigError(
            f"data.tokenizer: {tok.name} has changed since the run was trained with it (sha256 {tok.identity[:12]}, "
            f"{where} records {sha256[:12]}); give the run's tokenizer: data.tokenizer=PATH of its tokenizer.json"
        )
    return tok, f"the run's, recorded in {where}" + (", sha256 checked" if sha256 else "")


def tokenizer_for(cfg: RunConfig, model: ModelConfig, where: Located) -> tuple[Tokenizer, str]:
    """(tokenizer, where it came from) of the model `where` names: data.tokenizer when given, else the one its run
    recorded (a run directory, or a checkpoint inside one), the tokenizer.json of an exported folder, or the
    model's own. A tokenizer that cannot be the model's (more ids than it has; far fewer, unless recorded) is
    refused."""
    from geofed_hpc.data.tokenizer import load_tokenizer

    given = any(key in ("data.tokenizer", "model.tokenizer") for key in OPTIONS.given)
    recorded = None if given or where.run is None else recorded_tokenizer(where.run)
    if recorded is not None:
        tok, origin = _the_runs(recorded)
    elif not given and where.kind == "hf":
        file = where.path / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(f"{where.path} holds no tokenizer.json; give its tokenizer: data.tokenizer=PATH")
        tok, origin = load_tokenizer(str(file)), "the folder's"
    else:
        tok = load_tokenizer(cfg.data.tokenizer or model.tokenizer or "")
        origin = "data.tokenizer" if given else "the model's own: no run records another"
    vetted = recorded is not None or (where.kind == "hf" and not given)  # known to be the model's: only the upper bound
    if tok.vocab_size > model.vocab_size or (not vetted and model.vocab_size > tok.vocab_size + 4096):
        raise ConfigError(
            f"data.tokenizer: {tok.name} has {tok.vocab_size:,} ids but the model has {model.vocab_size:,}; give the "
            "run's tokenizer (data.tokenizer=PATH of its tokenizer.json)"
        )
    return tok, origin


def family(model: ModelConfig) -> str:
    """gpt2, llama, or model=hf's model_type (qwen2, mistral, ...)."""
    if model.arch != "hf":
        return model.arch
    from geofed_hpc.config.model import hf_folder_config

    return str(hf_folder_config(model.path)[1].get("model_type", "hf"))


def cmd_export_hf(cfg: RunConfig) -> int:
    from geofed_hpc.ckpt.atomic import atomic_dir
    from geofed_hpc.ckpt.sources import locate
    from geofed_hpc.models.export import write_model

    if len(OPTIONS.paths) != 2:
        raise ConfigError("export hf: give the source and the output folder: export hf SRC OUT [--dtype bf16]")
    src, out = OPTIONS.paths
    writable_dir(Path(out).expanduser().absolute().parent, "export hf OUT")
    where = locate(Path(src), OPTIONS.site)
    model, params, described = load_located(cfg, where)
    tok, origin = tokenizer_for(cfg, model, where)
    with atomic_dir(Path(out), OPTIONS.force) as folder:
        write_model(folder, model, params, OPTIONS.dtype, tok.bos_id, tok.eot_id, described)
        tok.save(folder, model.max_positions or model.context)
    print(f"exported {described} as a {family(model)} model ({OPTIONS.dtype}) to {out}")
    print(f"tokenizer: {tok.name} ({origin})")
    print(f"load it with: transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def cmd_generate(cfg: RunConfig) -> int:
    import torch

    from geofed_hpc.ckpt.sources import locate
    from geofed_hpc.models import build_model
    from geofed_hpc.models.generate import generate

    if len(OPTIONS.paths) != 1:
        raise ConfigError('generate: give one model source: generate SRC --prompt "..."')
    where = locate(Path(OPTIONS.paths[0]), OPTIONS.site)
    model_cfg, params, described = load_located(cfg, where)
    tok, origin = tokenizer_for(cfg, model_cfg, where)
    logger.info("tokenizer: %s (%s)", tok.name, origin)
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
