"""geofed-hpc: train one LLM across many Slurm clusters and a cloud parameter server."""

__version__ = "0.1.0"
