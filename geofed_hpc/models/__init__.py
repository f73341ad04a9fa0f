"""Model definitions written here (no hub): GPT-2 and Llama 3 causal language models (imported lazily, so that
the login node's checks of a Hugging Face folder, in hfconfig, never load torch); hfmodel: model=hf, any
`transformers` causal language model from a local folder, under the same interface."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from geofed_hpc.models.gpt import GPT, Block
    from geofed_hpc.models.llama import Llama, LlamaBlock
    from geofed_hpc.models.registry import ARCHS, build_model, num_params

_HOME = {
    "GPT": "gpt",
    "Block": "gpt",
    "Llama": "llama",
    "LlamaBlock": "llama",
    "ARCHS": "registry",
    "build_model": "registry",
    "num_params": "registry",
}
__all__ = ["ARCHS", "GPT", "Block", "Llama", "LlamaBlock", "build_model", "num_params"]


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"geofed_hpc.models.{_HOME[name]}"), name)
    raise AttributeError(f"module 'geofed_hpc.models' has no attribute {name!r}")
