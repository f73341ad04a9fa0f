"""Load a local Hugging Face-format safetensors checkpoint (GPT-2 or Llama names) into our models."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from geofed_hpc.config import ModelConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger
from geofed_hpc.models.hfconfig import check_folder_config, checkpoint_files

# (pattern on the Hugging Face name, our name template, transpose?) — GPT-2's Conv1D stores [in, out].
_GPT2 = [
    (r"wte\.weight", "wte.weight", False),
    (r"wpe\.weight", "wpe.weight", False),
    (r"h\.(\d+)\.ln_1\.(weight|bias)", "blocks.{0}.ln1.{1}", False),
    (r"h\.(\d+)\.ln_2\.(weight|bias)", "blocks.{0}.ln2.{1}", False),
    (r"h\.(\d+)\.attn\.c_attn\.weight", "blocks.{0}.attn.qkv.weight", True),
    (r"h\.(\d+)\.attn\.c_attn\.bias", "blocks.{0}.attn.qkv.bias", False),
    (r"h\.(\d+)\.attn\.c_proj\.weight", "blocks.{0}.attn.proj.weight", True),
    (r"h\.(\d+)\.attn\.c_proj\.bias", "blocks.{0}.attn.proj.bias", False),
    (r"h\.(\d+)\.mlp\.c_fc\.weight", "blocks.{0}.mlp.fc.weight", True),
    (r"h\.(\d+)\.mlp\.c_fc\.bias", "blocks.{0}.mlp.fc.bias", False),
    (r"h\.(\d+)\.mlp\.c_proj\.weight", "blocks.{0}.mlp.proj.weight", True),
    (r"h\.(\d+)\.mlp\.c_proj\.bias", "blocks.{0}.mlp.proj.bias", False),
    (r"ln_f\.(weight|bias)", "ln_f.{0}", False),
    (r"lm_head\.weight", "lm_head.weight", False),
]
_LLAMA = [
    (r"model\.embed_tokens\.weight", "wte.weight", False),
    (r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight", "blocks.{0}.attn.{1}.weight", False),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "blocks.{0}.ffn.{1}.weight", False),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "blocks.{0}.attn_norm.weight", False),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "blocks.{0}.ffn_norm.weight", False),
    (r"model\.norm\.weight", "norm.weight", False),
    (r"lm_head\.weight", "lm_head.weight", False),
]
_RULES = {"gpt2": _GPT2, "llama": _LLAMA}
# Buffers some exports carry that are not parameters.
_IGNORED = re.compile(r"(.*\.attn\.(masked_)?bias|.*\.rotary_emb\.inv_freq)$")


def map_name(arch: str, hf_name: str) -> tuple[str, bool] | None:
    """(our parameter name, transpose?) for a Hugging Face tensor name, or None when it has no counterpart."""
    name = hf_name.removeprefix("transformer.") if arch == "gpt2" else hf_name
    for pattern, template, transpose in _RULES[arch]:
        match = re.fullmatch(pattern, name)
        if match:
            return template.format(*match.groups()), transpose
    return None


def read_hf_tensors(cfg: ModelConfig, path: str | Path) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(our parameter name, full tensor, where it was read) for every tensor of the Hugging Face checkpoint at
    `path`, one at a time (transposed where GPT-2's Conv1D needs it). A tied output layer is checked against the
    embedding, not yielded. ConfigError names the file and tensor of anything that does not fit `cfg`."""
    path = Path(path).expanduser()
    files = checkpoint_files(path)
    check_folder_config(cfg, path if path.is_dir() else path.parent)
    held: dict[str, tuple[torch.Tensor, Path]] = {}  # tied: the head and the embedding, until both were read
    checked = False
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
                mapped = map_name(cfg.arch, hf_name)
                if mapped is None:
                    if _IGNORED.fullmatch(hf_name):
                        continue
                    other = next((a for a in _RULES if a != cfg.arch and map_name(a, hf_name)), None)
                    hint = f"it looks like a {other} checkpoint: set model.arch={other}" if other else "unknown name"
                    raise ConfigError(
                        f"model.init_from: {file} holds {hf_name!r} which model.arch={cfg.arch} lacks ({hint})"
                    )
                name, transpose = mapped
                tensor = f.get_tensor(hf_name)
                tensor = tensor.t().contiguous() if transpose else tensor
                if cfg.tie_embeddings and name in ("lm_head.weight", "wte.weight") and not checked:
                    held[name] = (tensor, file)
                    if len(held) == 2:
                        _check_tied(held)
                        held, checked = {}, True
                if name != "lm_head.weight" or not cfg.tie_embeddings:
                    yield name, tensor, f"{file} tensor {hf_name!r}"


def _check_tied(held: dict[str, tuple[torch.Tensor, Path]]) -> None:
    (head, file), (wte, _) = held["lm_head.weight"], held["wte.weight"]
    if head.shape != wte.shape or not torch.equal(head.to(wte.dtype), wte):
        raise ConfigError(
            f"model.tie_embeddings: is true but {file} holds an lm_head.weight different from the token "
            "embedding; set model.tie_embeddings=false"
        )


def load_hf_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Copy every parameter of `model` (GPT or Llama) from the Hugging Face-format checkpoint at `path`."""
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    params = dict(model.named_parameters())
    done: set[str] = set()
    for name, tensor, where in read_hf_tensors(cfg, path):
        _copy(params, name, tensor, where)
        done.add(name)
    missing = sorted(set(params) - done)
    if missing:
        raise ConfigError(
            f"model.init_from: {path} lacks {len(missing)} of the model's tensors, e.g. {missing[:3]} "
            "(a checkpoint of a smaller model, or of another architecture?)"
        )
    logger.info("loaded %d tensors from the Hugging Face checkpoint %s", len(done), path)


def _copy(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, where: str) -> None:
    param = params.get(name)
    if param is None:
        raise ConfigError(f"model.init_from: {where} ({name}) is not in this model config")
    if tuple(tensor.shape) != tuple(param.shape):
        raise ConfigError(
            f"model.init_from: {where} has shape {tuple(tensor.shape)} but {name} needs "
            f"{tuple(param.shape)}; use the model config that matches the checkpoint"
        )
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))
