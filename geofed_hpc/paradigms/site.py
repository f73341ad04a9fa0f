"""A paradigm on a site: adapters and frozen weights, the trainable set per step, the update it pushes."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import nn

from geofed_hpc.config import ParadigmConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.paradigms.adapters import add_lora, add_ravan
from geofed_hpc.paradigms.exchange import (
    LORA,
    ZO_CHECK,
    ZO_COEF,
    Exchange,
    Params,
    ZerothOrder,
    _leaf,
    direction_check,
    directions,
    exchange_for,
)
from geofed_hpc.paradigms.split import ClientPart, CutLink

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
STATE_PREFIX = "paradigm/"


class SiteParadigm:
    """Identity (pretraining) by default; subclasses add adapters, freeze weights or change the step."""

    error_feedback = True  # the codec's residual rides on the next delta (the same tensors each round)
    additive = True  # two pushes from one base add up to their sum (the work after a confirmed one can follow it)
    custom_step = False  # True: `step` replaces the optimizer step (zo)
    one_process = False  # True: the site runs one process (its step talks to the PS: split learning)

    def __init__(self, cfg: ParadigmConfig, exchange: Exchange) -> None:
        self.cfg, self.exchange = cfg, exchange

    def prepare(self, model: nn.Module) -> None:
        """Add the adapters and freeze what this paradigm never trains (before sharding and the optimizer)."""

    def site_model(self, model: nn.Module) -> nn.Module:
        """The module the site trains, made from the full model after `prepare` (split learning: its client part)."""
        return model

    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        """Every parameter the optimizer steps in some phase."""
        return [p for p in model.parameters() if p.requires_grad]

    def phase(self, step: int) -> int:
        """Which parameters train at the `step`-th step of a round (0-based): 0 for every paradigm but hybrid."""
        return 0

    def set_phase(self, model: nn.Module, phase: int) -> None:
        """Make the parameters of `phase` the ones with gradients."""

    def wire_update(self, local: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]) -> Params:
        """What a push carries: phi(local) - phi(base) over the exchanged tensors."""
        return {
            k: (local[k] - v).astype(np.float32, copy=False) for k, v in base.items() if self.exchange.is_exchanged(k)
        }

    def begin_round(self, version: int, seed: int, resumed_steps: int) -> None:
        """A round of local steps starts from global `version` (`resumed_steps` already taken before a requeue)."""

    def before_step(self, model: nn.Module, count: int) -> None:
        """Before the site's `count`-th local step (its lifetime count, 1-based), on every rank."""

    def step(self, model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor) -> float:
        raise ConfigError(f"paradigm {self.cfg.name} trains with the optimizer, not a custom step")

    def state(self) -> Params:
        """Checkpoint tensors (paradigm/<name>) of an unfinished round."""
        return {}

    def load_state(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Restore `state()` from checkpoint tensors (others are ignored)."""


class _Freezing(SiteParadigm):
    """Only the exchanged tensors train (LoRA's A and B, RAVAN's heads); the rest is frozen."""

    add: Callable[[nn.Module, ParadigmConfig], list[str]]

    def prepare(self, model: nn.Module) -> None:
        type(self).add(model, self.cfg)
        for name, p in model.named_parameters():
            p.requires_grad_(self.exchange.is_exchanged(name))


class LoRASite(_Freezing):
    add = staticmethod(add_lora)


class RavanSite(_Freezing):
    add = staticmethod(add_ravan)


class HybridLoRASite(SiteParadigm):
    """Phase 0 trains the base weights (exchanged), phase 1 the private adapters; base_steps then adapter_steps."""

    def prepare(self, model: nn.Module) -> None:
        add_lora(model, self.cfg)
        self.set_phase(model, 0 if self.cfg.base_steps else 1)

    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        return list(model.parameters())

    def phase(self, step: int) -> int:
        cycle = self.cfg.base_steps + self.cfg.adapter_steps
        return 0 if step % cycle < self.cfg.base_steps else 1

    def set_phase(self, model: nn.Module, phase: int) -> None:
        for name, p in model.named_parameters():
            p.requires_grad_((_leaf(name) in LORA) == (phase == 1))


class ZerothOrderSite(SiteParadigm):
    """MeZO-style steps: g = (L(theta + eps z) - L(theta - eps z)) / 2 eps along the seeded direction z, then
    theta -= lr g z locally; the push is the coefficients -lr g of the round's steps and a direction checksum."""

    error_feedback = False  # a residual would land on the next round's (different) directions
    additive = False  # a push's coefficients belong to the round's directions, drawn from its start
    custom_step = True

    def __init__(self, cfg: ParadigmConfig, exchange: Exchange) -> None:
        super().__init__(cfg, exchange)
        assert isinstance(exchange, ZerothOrder)
        self.zo = exchange
        self.version, self.seed = 0, exchange.seed
        self.coefs: list[float] = []

    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        return []

    def prepare(self, model: nn.Module) -> None:
        for p in model.parameters():
            p.requires_grad_(False)

    def begin_round(self, version: int, seed: int, resumed_steps: int) -> None:
        self.version, self.seed = version, seed
        self.zo.seed = seed
        if resumed_steps != len(self.coefs):
            self.coefs = self.coefs[:resumed_steps]

    @torch.no_grad()
    def step(self, model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor) -> float:
        if len(self.coefs) >= self.zo.steps:
            raise ConfigError(f"paradigm=zo: a round has at most train.max_local_steps={self.zo.steps} steps")
        params = dict(model.named_parameters())
        spec = {k: tuple(p.shape) for k, p in params.items()}
        z = {
            k: torch.from_numpy(v).to(params[k].device)
            for k, v in directions(self.seed, self.version, len(self.coefs), spec)
        }
        eps = self.cfg.zo_eps
        for k, p in params.items():
            p.add_(z[k], alpha=eps)
        plus = float(loss_fn(x, y))
        for k, p in params.items():
            p.add_(z[k], alpha=-2 * eps)
        minus = float(loss_fn(x, y))
        coef = float(np.float32(-self.cfg.zo_lr * (plus - minus) / (2 * eps)))
        for k, p in params.items():
            p.add_(z[k], alpha=eps + coef)
        self.coefs.append(coef)
        return (plus + minus) / 2

    def wire_update(self, local: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]) -> Params:
        coefs = np.zeros(self.zo.steps, np.float32)
        coefs[: len(self.coefs)] = self.coefs
        spec = {k: tuple(v.shape) for k, v in base.items()}
        self.coefs = []
        return {ZO_COEF: coefs, ZO_CHECK: np.array([direction_check(self.seed, self.version, spec)], np.float32)}

    def state(self) -> Params:
        """The round's coefficients so far and the (version, seed) their directions came from."""
        return {
            STATE_PREFIX + ZO_COEF: np.asarray(self.coefs, np.float32),
            STATE_PREFIX + "zo.round": np.array([self.version, self.seed], np.int64),
        }

    def load_state(self, tensors: Mapping[str, np.ndarray]) -> None:
        coefs, where = tensors.get(STATE_PREFIX + ZO_COEF), tensors.get(STATE_PREFIX + "zo.round")
        self.coefs = [float(c) for c in coefs] if coefs is not None else []
        if where is not None:
            self.version, self.seed = int(where[0]), int(where[1])
            self.zo.seed = self.seed


class SplitSite(SiteParadigm):
    """fsl_sage and split: the site trains its client part (split.ClientPart) with AdamW (fsl_sage with
    paradigm.aux_local its auxiliary model too). fsl_sage uploads the activations of every
    paradigm.server_update_interval-th step, and takes the auxiliary model the server fitted (`take_fitted`, after a
    pull at an alignment version) at the first step of the round that starts from that version; split gets the server's
    gradient at every step. The fitted model and whether it went in are checkpointed (`state`), so a requeue neither
    loses nor applies it twice."""

    one_process = True

    def __init__(self, cfg: ParadigmConfig, exchange: Exchange) -> None:
        super().__init__(cfg, exchange)
        self.estimate = cfg.name == "fsl_sage"
        self.round_version = -1
        self.fitted: Params = {}
        self.fitted_version = -1  # the global version the fitted model is for (-1: none)
        self.fitted_applied = False

    def site_model(self, model: nn.Module) -> nn.Module:
        return ClientPart(model, self.cfg)

    def attach(self, model: nn.Module, link: CutLink) -> None:
        """Give the client part its way to the server part (once the site's session exists)."""
        assert isinstance(model, ClientPart)
        model.link = link

    def alignment_due(self, version: int) -> bool:
        """After a pull of `version`: whether to take the server's fitted auxiliary model for it."""
        due = self.estimate and version > 0 and version % self.cfg.align_interval == 0
        return due and self.fitted_version != version

    def take_fitted(self, arrays: Params, version: int) -> None:
        self.fitted, self.fitted_version, self.fitted_applied = dict(arrays), version, False

    def begin_round(self, version: int, seed: int, resumed_steps: int) -> None:
        self.round_version = version
        if self.fitted_version != version:
            self.fitted, self.fitted_version, self.fitted_applied = {}, -1, False

    @torch.no_grad()
    def before_step(self, model: nn.Module, count: int) -> None:
        if isinstance(model, ClientPart):
            model.upload_due = self.estimate and count % self.cfg.server_update_interval == 0
        if self.fitted and not self.fitted_applied and self.fitted_version == self.round_version:
            params = dict(model.named_parameters())
            for name, value in self.fitted.items():
                if name in params:
                    params[name].copy_(torch.from_numpy(np.asarray(value)).to(params[name].device))
            self.fitted, self.fitted_applied = {}, True

    def state(self) -> Params:
        out = {STATE_PREFIX + "split.fitted/" + k: v for k, v in self.fitted.items()}
        where = [self.fitted_version, int(self.fitted_applied)]
        return {**out, STATE_PREFIX + "split.align": np.array(where, np.int64)}

    def load_state(self, tensors: Mapping[str, np.ndarray]) -> None:
        prefix = STATE_PREFIX + "split.fitted/"
        self.fitted = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        where = tensors.get(STATE_PREFIX + "split.align")
        self.fitted_version, self.fitted_applied = (int(where[0]), bool(where[1])) if where is not None else (-1, False)


def site_paradigm(cfg: ParadigmConfig, steps: int, seed: int | None = None) -> SiteParadigm:
    """The site side of `cfg.name` (`steps`: train.max_local_steps; `seed`: the PS's, for zo)."""
    exchange = exchange_for(cfg, steps, seed)
    cls = {
        "identity": SiteParadigm,
        "lora": LoRASite,
        "hybrid_lora": HybridLoRASite,
        "ravan": RavanSite,
        "zo": ZerothOrderSite,
        "fsl_sage": SplitSite,
        "split": SplitSite,
    }[cfg.name]
    return cls(cfg, exchange)
