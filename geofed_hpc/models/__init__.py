"""Model definitions written here (no hub): a GPT-2 style causal language model."""

from geofed_hpc.models.gpt import GPT, Block, build_model, num_params

__all__ = ["GPT", "Block", "build_model", "num_params"]
