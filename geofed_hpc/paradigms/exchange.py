"""What the PS and the wire know of a paradigm: pure functions on named float32 arrays (no torch here)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from geofed_hpc.config import ParadigmConfig
from geofed_hpc.errors import StaleError

Params = dict[str, np.ndarray]
Spec = dict[str, tuple[int, ...]]

# Tensor names the adapters add to a layer `<layer>.`: LoRA's A and B, RAVAN's shared A_i, B_i and heads H_i.
LORA = ("lora_a", "lora_b")
RAVAN_HEAD = "ravan_h"
RAVAN_SHARED = ("ravan_a", "ravan_b")
ZO_COEF, ZO_CHECK = "zo.coef", "zo.check"
CHECK_ELEMENTS = 16


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


class Exchange:
    """The global model is every parameter a site does not keep private; a delta, and each global update,
    carries the exchanged ones (`wire_spec`). `expand` turns an update as sent into one on the global model,
    `check` verifies a site's update before it is folded. The identity paradigm exchanges everything."""

    name = "identity"

    def __init__(self, cfg: ParadigmConfig | None = None, steps: int = 0) -> None:
        self.cfg = cfg or ParadigmConfig()
        self.steps = steps

    def describe(self) -> str:
        return self.cfg.describe()

    def is_private(self, name: str) -> bool:
        """Stays on its site: never in the global model, a push or a pull (checkpoints keep it)."""
        return False

    def is_exchanged(self, name: str) -> bool:
        """Carried by deltas and updates (the rest of the global model is shared once and frozen)."""
        return not self.is_private(name)

    def public(self, arrays: Mapping[str, np.ndarray]) -> Params:
        """The part of a site's full parameters that belongs in the global model."""
        return {k: v for k, v in arrays.items() if not self.is_private(k)}

    def wire_spec(self, spec: Spec) -> Spec:
        """Names and shapes a delta or a global update carries, given the global model's."""
        return {k: s for k, s in spec.items() if self.is_exchanged(k)}

    def check(self, update: Mapping[str, np.ndarray], version: int, spec: Spec) -> None:
        """Refuse a site's update that cannot belong to `version` of a global model shaped `spec`."""

    def expand(self, update: Mapping[str, np.ndarray], version: int, spec: Spec) -> Mapping[str, np.ndarray]:
        """The update to add to the global model at `version` (shaped `spec`) for an update as exchanged."""
        return update

    def merge(self, params: Mapping[str, np.ndarray]) -> Params:
        """theta of the plain model (no adapter tensors) from the global model, for export and evaluation."""
        return dict(params)


def _merged(params: Mapping[str, np.ndarray], leaves: tuple[str, ...], delta: Any) -> Params:
    """Add delta(layer) to each adapted layer's `.weight` and drop the adapter tensors (names ending in leaves)."""
    out = {k: v for k, v in params.items() if not _leaf(k).startswith(leaves)}
    layers = sorted({k.rsplit(".", 1)[0] for k in params if _leaf(k).startswith(leaves)})
    for layer in layers:
        out[f"{layer}.weight"] = (params[f"{layer}.weight"] + delta(layer)).astype(np.float32)
    return out


class LoRA(Exchange):
    """FedIT: the adapters' A and B are exchanged (and averaged separately); the base weights are frozen."""

    name = "lora"

    def is_exchanged(self, name: str) -> bool:
        return _leaf(name) in LORA

    def merge(self, params: Mapping[str, np.ndarray]) -> Params:
        scale = np.float32(self.cfg.alpha / self.cfg.rank)
        return _merged(params, LORA, lambda n: scale * (params[f"{n}.lora_b"] @ params[f"{n}.lora_a"]))


class HybridLoRA(Exchange):
    """The base weights are exchanged as in pretraining; the LoRA adapters stay on their site."""

    name = "hybrid_lora"

    def is_private(self, name: str) -> bool:
        return _leaf(name) in LORA


class Ravan(Exchange):
    """Only the heads H_i are exchanged; W and the random A_i, B_i are shared once, in the first full model."""

    name = "ravan"

    def is_exchanged(self, name: str) -> bool:
        return _leaf(name).startswith(RAVAN_HEAD)

    def merge(self, params: Mapping[str, np.ndarray]) -> Params:
        scale = np.float32(self.cfg.alpha / self.cfg.rank)

        def delta(n: str) -> np.ndarray:
            heads = range(self.cfg.heads)
            return scale * sum(
                params[f"{n}.ravan_a{i}"] @ params[f"{n}.ravan_h{i}"] @ params[f"{n}.ravan_b{i}"] for i in heads
            )

        return _merged(params, (RAVAN_HEAD, *RAVAN_SHARED), delta)


def directions(seed: int, version: int, step: int, spec: Spec) -> Iterable[tuple[str, np.ndarray]]:
    """The random direction of `step` in the round that starts at `version`: standard normal float32 per
    tensor, drawn in name order from one PCG64 stream, so every replica draws the same bits."""
    rng = np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFF, version, step]))
    for name in sorted(spec):
        yield name, rng.standard_normal(int(np.prod(spec[name], dtype=np.int64)), dtype=np.float32).reshape(spec[name])


def direction_check(seed: int, version: int, spec: Spec) -> float:
    """A checksum of a round's first direction: sites and the PS that disagree on seed or version differ."""
    first = next(iter(directions(seed, version, 0, spec)), ("", np.zeros(0, np.float32)))[1]
    return float(np.float32(first.reshape(-1)[:CHECK_ELEMENTS].sum(dtype=np.float32)))


class ZerothOrder(Exchange):
    """A push is one coefficient per step, c_j = -lr * g_j, and a checksum; the dense update is
    sum_j c_j z_j with z_j = directions(seed, version, j). `steps`: train.max_local_steps (a shorter round
    sends zeros for the steps it did not take)."""

    name = "zo"

    def __init__(self, cfg: ParadigmConfig, steps: int, seed: int) -> None:
        super().__init__(cfg, steps)
        self.seed = seed

    def wire_spec(self, spec: Spec) -> Spec:
        return {ZO_COEF: (self.steps,), ZO_CHECK: (1,)}

    def check(self, update: Mapping[str, np.ndarray], version: int, spec: Spec) -> None:
        theirs, ours = float(update[ZO_CHECK][0]), direction_check(self.seed, version, spec)
        if not np.isclose(theirs, ours, rtol=1e-3, atol=1e-3):
            raise StaleError(
                f"zo seed mismatch: the site's direction checksum {theirs:.6g} is not the PS's {ours:.6g} for "
                f"version {version} (seed {self.seed}); its directions are for another seed or version: pull again"
            )

    def expand(self, update: Mapping[str, np.ndarray], version: int, spec: Spec) -> Params:
        return dense_update(update[ZO_COEF], self.seed, version, spec)


def dense_update(coefs: np.ndarray, seed: int, version: int, spec: Spec) -> Params:
    """sum_j coefs[j] * z_j in float32, steps in order (steps with a zero coefficient are skipped)."""
    out = {k: np.zeros(s, np.float32) for k, s in spec.items()}
    for j, c in enumerate(np.asarray(coefs, np.float32).reshape(-1)):
        if c == 0:
            continue
        for name, z in directions(seed, version, j, spec):
            out[name] += c * z
    return out


class Split(Exchange):
    """fsl_sage and split: the global model is what sites hold, the client part (embeddings, the first
    paradigm.cut blocks) and for fsl_sage the auxiliary model (`aux.*`), all exchanged and averaged as in
    pretraining; the server part lives beside the PS, never in the global model."""

    name = "split"


def exchange_for(cfg: ParadigmConfig, steps: int = 0, seed: int | None = None) -> Exchange:
    """The Exchange of `cfg.name` (`steps`: train.max_local_steps; `seed`: the PS's, default cfg.seed)."""
    if cfg.name == "zo":
        return ZerothOrder(cfg, steps, cfg.seed if seed is None else seed)
    kinds: dict[str, type[Exchange]] = {
        "identity": Exchange,
        "lora": LoRA,
        "hybrid_lora": HybridLoRA,
        "ravan": Ravan,
        "fsl_sage": Split,
        "split": Split,
    }
    return kinds[cfg.name](cfg, steps)
