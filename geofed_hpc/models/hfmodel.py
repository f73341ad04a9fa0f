"""model=hf: any `transformers` causal language model from a local folder, built on the meta device and used through
our models' interface (forward(idx, targets) -> (logits, loss), `cfg`), its tensors under transformers' own names."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from geofed_hpc.config import ModelConfig
from geofed_hpc.config.model import hf_folder_config, hf_weight_files, safetensors_shapes
from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger

INSTALL = "pip install 'geofed-hpc[hf]'"
# Tensors some checkpoints carry that are buffers here (recomputed, never loaded).
BUFFER_SUFFIXES = ("rotary_emb.inv_freq", ".position_ids", ".attn.bias", ".attn.masked_bias")


def transformers_lib() -> Any:
    """The `transformers` module; ConfigError in one line when the `hf` extra is not installed."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            f"model=hf needs the `transformers` library, which is not installed here: {INSTALL}"
        ) from None
    return transformers


def hf_config(cfg: ModelConfig) -> Any:
    """transformers' config of model.path's config.json, checked to describe a causal LM transformers knows."""
    lib = transformers_lib()
    folder, raw = hf_folder_config(cfg.path)
    where = folder / "config.json"
    kind = raw.get("model_type")
    if raw.get("auto_map"):
        raise ConfigError(
            f"model.path: {where} names its own modelling code (auto_map: trust_remote_code), which model=hf does not "
            "run; use a model whose architecture transformers ships"
        )
    known = lib.models.auto.configuration_auto.CONFIG_MAPPING_NAMES
    if kind not in known:
        raise ConfigError(
            f"model.path: {where} has model_type {kind!r}, an architecture transformers {lib.__version__} does not "
            f"know; give a model of one it knows (llama, qwen2, mistral, gemma, phi3, ...) or upgrade it "
            f"(pip install -U transformers)"
        )
    try:
        config = lib.AutoConfig.from_pretrained(str(folder))
    except Exception as exc:  # transformers' validators raise errors of their own (huggingface_hub's) as well
        reason = " ".join(str(exc).split())
        raise ConfigError(f"model.path: transformers cannot read {where}: {reason}") from None
    if type(config) not in lib.AutoModelForCausalLM._model_mapping:
        raise ConfigError(
            f"model.path: {where} is a {kind} model, which has no causal language model in transformers "
            "(AutoModelForCausalLM); model=hf trains decoder-only language models"
        )
    return config


class HFFace:
    """Mixed in front of a transformers causal LM's class: our models' interface over its own forward."""

    cfg: ModelConfig
    tied: bool  # the output layer is the token embedding (re-tied after each materialisation)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, T, vocab] and, given targets [B, T], the mean cross-entropy (targets of -1 are ignored)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be [batch, sequence] token ids, got shape {tuple(idx.shape)}")
        if idx.size(1) > self.cfg.context:
            raise ConfigError(
                f"sequence length {idx.size(1)} exceeds model.context={self.cfg.context}; "
                "feed shorter windows or raise model.context"
            )
        logits = super().forward(input_ids=idx, use_cache=False).logits  # type: ignore[misc]
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss


_FACES: dict[type, type] = {}


def _face(cls: type) -> type:
    """`cls` with HFFace in front (its name, so that logs and FSDP's wrapper class read as transformers' own)."""
    if cls not in _FACES:
        _FACES[cls] = type(cls.__name__, (HFFace, cls), {"__module__": __name__, "hf_class": cls})
    return _FACES[cls]


_ACTIVATIONS = ("activation_function", "hidden_act", "hidden_activation")  # where configs name their activation


def build_hf_meta(cfg: ModelConfig) -> nn.Module:
    """The model of model.path's config.json on the meta device (float32 parameters), with our interface."""
    lib = transformers_lib()
    config = hf_config(cfg)
    # transformers' "gelu_new" (GPT-2, Phi, GPT-J...) is the tanh GELU written as separate operations, each keeping its
    # output for the backward pass (53% more activation memory in GPT-2-medium's blocks): build with PyTorch's fused
    # tanh GELU, the same function, and keep the folder's name in the config that `export hf` writes back.
    fused = [k for k in _ACTIVATIONS if getattr(config, k, None) == "gelu_new"]
    for key in fused:
        setattr(config, key, "gelu_pytorch_tanh")
    with torch.device("meta"):
        model = lib.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for key in fused:
        setattr(model.config, key, "gelu_new")
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = out is not None and out.weight is inp.weight
    model.__class__ = _face(type(model))
    model.cfg = cfg
    model.tied = tied
    return model


def plain_class(model: nn.Module) -> type:
    """transformers' own class of a model=hf model (what save_pretrained should name)."""
    return next(c.hf_class for c in type(model).__mro__ if "hf_class" in vars(c))  # type: ignore[attr-defined]


def materialize_hf(model: nn.Module, device: str | torch.device) -> nn.Module:
    """Allocate a meta model's (or its shards') tensors on `device`, uninitialised; the output layer re-tied to the
    embedding; the buffers (RoPE frequencies, embedding scales) computed as transformers computes them."""
    model = model.to_empty(device=device)
    if model.tied:  # type: ignore[union-attr]
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()  # type: ignore[operator]
        if head.weight is not embedding.weight:
            head.weight = embedding.weight
    init_buffers(model)
    return model


@torch.no_grad()
def init_buffers(model: nn.Module) -> None:
    """transformers' own init of what is not a parameter: every parameter is marked initialised (its init functions
    then leave it alone), the module marks of an earlier init are cleared, and initialize_weights runs."""
    params = list(model.parameters())
    for p in params:
        p._is_hf_initialized = True  # type: ignore[attr-defined]
    for m in model.modules():
        m.__dict__.pop("_is_hf_initialized", None)
    try:
        model.initialize_weights()  # type: ignore[operator]
    finally:
        for p in params:
            p.__dict__.pop("_is_hf_initialized", None)
        for m in model.modules():
            m.__dict__.pop("_is_hf_initialized", None)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the modules of the classes its `_no_split_modules` names (what FSDP shards and
    activation checkpointing recomputes one by one), else its longest nn.ModuleList."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or module is model:
            continue
        if any(c.__name__ in names for c in type(module).__mro__):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ConfigError(f"model.path: {type(model).__name__} has no list of decoder layers to shard")
    return list(max(lists, key=lambda m: len(m)))  # type: ignore[arg-type]


def _unit_seed(seed: int, unit: str) -> int:
    digest = hashlib.sha256(f"{seed}:{unit}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def hf_random_tensors(cfg: ModelConfig, seed: int, device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full initial value) of every parameter, drawn by transformers' own init (its `_init_weights`: the
    family's std, zero or unit norms, scaled projections) one decoder layer at a time (then the rest), each from the
    global RNG seeded by (seed, layer): the same values whatever the sharding, on every rank. Peak memory: a layer."""
    replica = build_hf_meta(cfg)  # shapes only: each unit's tensors are swapped in, drawn, yielded, swapped out
    init: Callable[[nn.Module], None] = replica._init_weights  # type: ignore[assignment]
    names = {id(p): n for n, p in replica.named_parameters()}
    layers = decoder_layers(replica)
    where = {id(m): n for n, m in replica.named_modules()}
    in_layer = {id(m) for layer in layers for m in layer.modules()}
    rest = [m for m in replica.modules() if id(m) not in in_layer]
    units = [(where[id(layer)], list(layer.modules())) for layer in layers] + [("", rest)]
    device = torch.device(device)
    for unit, modules in units:
        fresh: dict[int, torch.Tensor] = {}
        saved: list[tuple[dict[str, Any], str, Any]] = []
        for module in modules:
            stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for store in stores:
                for key, value in store.items():
                    if value is None:
                        continue
                    if id(value) not in fresh:
                        fresh[id(value)] = torch.empty(value.shape, dtype=value.dtype, device=device)
                    saved.append((store, key, value))
                    store[key] = fresh[id(value)]
        devices = (
            [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
        )
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(_unit_seed(seed, unit))
            for module in reversed(modules):  # a module after everything inside it, as transformers' init goes
                if any(v is not None for v in module._parameters.values()):
                    init(module)
        ordered = [(names[id(value)], fresh[id(value)]) for store, _, value in saved if id(value) in names]
        for store, key, value in saved:
            store[key] = value
        done: set[str] = set()
        for name, tensor in ordered:
            if name not in done:
                done.add(name)
                yield name, tensor.float()
        del fresh, ordered


def weights_folder(cfg: ModelConfig) -> Path | None:
    """Where a model=hf model's initial weights are: model.init_from, else model.path when it holds .safetensors
    files; None: a random init."""
    if cfg.init_from:
        return Path(cfg.init_from).expanduser()
    folder = Path(cfg.path).expanduser()
    return folder if hf_weight_files(folder) else None


def _weight_names(cfg: ModelConfig, model: nn.Module, files: list[Path]) -> dict[tuple[Path, str], str]:
    """(file, name in it) -> our parameter name for every tensor of the weight files; ConfigError naming the file and
    tensor of anything that does not fit the model model.path's config.json makes (another model's weights)."""
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    buffers = {n for n, _ in model.named_buffers()}
    config = Path(cfg.path).expanduser() / "config.json"
    mapping: dict[tuple[Path, str], str] = {}
    for file in files:
        for name, shape in safetensors_shapes(file).items():
            ours = name if name in expected else f"model.{name}" if f"model.{name}" in expected else None
            if ours is None:
                if name in buffers or name.endswith(BUFFER_SUFFIXES) or (model.tied and name == "lm_head.weight"):  # type: ignore[union-attr]
                    continue
                raise ConfigError(
                    f"model.path: the weights do not match the config: {file} holds {name!r}, which the "
                    f"{type(model).__name__} that {config} describes does not have (e.g. {next(iter(expected))!r})"
                )
            if shape != expected[ours]:
                raise ConfigError(
                    f"model.path: the weights do not match the config: {file} tensor {name!r} has shape {shape} but "
                    f"{config} makes it {expected[ours]}"
                )
            mapping[(file, name)] = ours
    missing = sorted(set(expected) - set(mapping.values()))
    if missing:
        raise ConfigError(
            f"model.path: the weights do not match the config: {', '.join(str(f) for f in files)} lack {len(missing)} "
            f"of the tensors {config} describes, e.g. {missing[:3]}"
        )
    return mapping


def hf_weight_tensors(cfg: ModelConfig, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, full tensor) of the weight files weights_folder names, checked first (names, shapes) against
    `model` (built from the same config; sharded or on meta is fine), then read one tensor at a time."""
    from safetensors import safe_open

    from geofed_hpc.models.hfconfig import checkpoint_files

    source = weights_folder(cfg)
    assert source is not None
    files = checkpoint_files(source) if cfg.init_from else hf_weight_files(source)
    mapping = _weight_names(cfg, model, files)
    logger.info("model=hf: loading %d tensors from %s", len(mapping), source)
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
                if (file, name) in mapping:
                    yield mapping[(file, name)], f.get_tensor(name)


def hf_initial_tensors(model: nn.Module, seed: int, device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a fresh model=hf model starts from: its folder's weights, else transformers' init for `seed`."""
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    if weights_folder(cfg) is not None:
        return hf_weight_tensors(cfg, model)
    return hf_random_tensors(cfg, seed, device)


@torch.no_grad()
def fill(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]] | Mapping[str, Any], what: str) -> None:
    """Copy full tensors (or arrays) into an unsharded model's parameters; every parameter exactly once."""
    params = dict(model.named_parameters())
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    done: set[str] = set()
    for name, value in items:
        param = params.get(name)
        if param is None:
            raise ConfigError(f"{what}: holds {name!r}, which this model does not have")
        value = torch.as_tensor(value)
        if tuple(value.shape) != tuple(param.shape):
            raise ConfigError(f"{what}: {name} has shape {tuple(value.shape)} but the model needs {tuple(param.shape)}")
        param.copy_(value.to(param.dtype))
        done.add(name)
    missing = sorted(set(params) - done)
    if missing:
        raise ConfigError(f"{what}: lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}")
