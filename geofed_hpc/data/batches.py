"""Train/val split, per-site shards, a resumable random-window sampler and fixed evaluation batches."""

from __future__ import annotations

import numpy as np
import torch

from geofed_hpc.errors import ConfigError


def _check_tokens(tokens: np.ndarray, what: str) -> None:
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"{what}: expected a 1-D integer numpy array of token ids")


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): val is the last `val_fraction` of the tokens (at least one token), both non-empty views."""
    _check_tokens(tokens, "split_tokens")
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: must be in (0, 1), got {val_fraction}")
    n_val = max(1, round(len(tokens) * val_fraction))
    if n_val >= len(tokens):
        raise ConfigError(f"data.val_fraction: {len(tokens)} tokens are too few to split; use a larger data.source")
    return tokens[:-n_val], tokens[-n_val:]


def site_shard(tokens: np.ndarray, index: int, count: int) -> np.ndarray:
    """Shard `index` of `count` contiguous, disjoint, near-equal shards (a view)."""
    _check_tokens(tokens, "site_shard")
    if count < 1:
        raise ConfigError(f"site shard count must be at least 1, got {count}")
    if not 0 <= index < count:
        raise ConfigError(f"site shard index must be in 0..{count - 1}, got {index}")
    if len(tokens) < count:
        raise ConfigError(f"{len(tokens)} tokens cannot be split into {count} site shards; use more data")
    n = len(tokens)
    return tokens[index * n // count : (index + 1) * n // count]


class BatchSampler:
    """Random windows of context+1 tokens; batch k depends only on (seed, k), so resuming is exact."""

    def __init__(self, tokens: np.ndarray, batch_size: int, context: int, seed: int) -> None:
        _check_tokens(tokens, "BatchSampler")
        if batch_size < 1 or context < 1:
            raise ConfigError(f"BatchSampler: batch_size and context must be positive, got {batch_size}, {context}")
        if len(tokens) < context + 1:
            raise ConfigError(
                f"{len(tokens)} tokens are fewer than model.context + 1 = {context + 1}; "
                "use more data (data.source, data.max_tokens) or a smaller model.context"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.context = context
        self.seed = int(seed)
        self.draws = 0
        self._offsets = np.arange(context + 1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: int64 [batch_size, context], y shifted by one token."""
        rng = np.random.default_rng([self.draws, self.seed & 0xFFFFFFFFFFFFFFFF])
        self.draws += 1
        starts = rng.integers(0, len(self.tokens) - self.context, size=self.batch_size)
        windows = torch.from_numpy(self.tokens[starts[:, None] + self._offsets].astype(np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def state_dict(self) -> dict[str, int]:
        """JSON-friendly state: the seed and how many batches were drawn."""
        return {"seed": self.seed, "draws": self.draws}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue exactly after the last batch drawn when `state` was taken."""
        try:
            seed, draws = state["seed"], state["draws"]
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"sampler state must hold integer 'seed' and 'draws', got {state!r}") from exc
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (seed, draws)) or draws < 0:
            raise ConfigError(f"sampler state must hold integer 'seed' and 'draws' >= 0, got {state!r}")
        self.seed, self.draws = seed, draws


def eval_batches(tokens: np.ndarray, batch_size: int, context: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Up to `n` batches of disjoint windows from the start of `tokens`; one smaller batch if few fit."""
    _check_tokens(tokens, "eval_batches")
    if batch_size < 1 or context < 1 or n < 1:
        raise ConfigError(f"eval_batches: batch_size, context and n must be positive, got {batch_size}, {context}, {n}")
    windows = len(tokens) // (context + 1)
    if windows == 0:
        raise ConfigError(
            f"{len(tokens)} validation tokens are fewer than model.context + 1 = {context + 1}; "
            "raise data.val_fraction or use more data"
        )
    per_batch = min(batch_size, windows)
    count = min(n, windows // per_batch)
    used = torch.from_numpy(tokens[: count * per_batch * (context + 1)].astype(np.int64))
    used = used.view(count, per_batch, context + 1)
    return [(batch[:, :-1].contiguous(), batch[:, 1:].contiguous()) for batch in used]
