"""Model definitions written here (no hub): GPT-2 and Llama 3 causal language models."""

from geofed_hpc.models.gpt import GPT, Block
from geofed_hpc.models.llama import Llama, LlamaBlock
from geofed_hpc.models.registry import ARCHS, build_model, num_params

__all__ = ["ARCHS", "GPT", "Block", "Llama", "LlamaBlock", "build_model", "num_params"]
