"""Split learning's model parts: a site's client part with its auxiliary model, and the server part beside the PS."""

from __future__ import annotations

import copy
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from geofed_hpc.config import ModelConfig, ParadigmConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.models.llama import rope_frequencies

AUX = "aux."  # the auxiliary model's parameter names start with it


class CutLink(Protocol):
    """A site's way to the server part (client/split.py): cut-layer activations [B, T, d] (float32) and their
    targets [B, T] (token ids, -1 ignored) go up; the server part's loss (and for `gradient` the gradient of its
    mean loss at the cut) comes back."""

    def train(self, acts: np.ndarray, targets: np.ndarray) -> float: ...

    def gradient(self, acts: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]: ...

    def evaluate(self, acts: np.ndarray, targets: np.ndarray) -> float: ...


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (targets of -1 ignored), as the full models compute it."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)


def _norm_name(cfg: ModelConfig) -> str:
    return "ln_f" if cfg.arch == "gpt2" else "norm"


def _model_cfg(model: nn.Module) -> ModelConfig:
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise ConfigError("split learning needs one of this project's models (model.arch gpt2 or llama)")
    return cfg


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.get_submodule("blocks").children())


def _array(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy()


class Rope(nn.Module):
    """What each block takes beside the residual stream: Llama's rotary cos and sin for a length; GPT-2: nothing."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.llama = cfg.arch == "llama"
        self.register_buffer("inv_freq", rope_frequencies(cfg) if self.llama else torch.zeros(0), persistent=False)

    def angles(self, t: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        if not self.llama:
            return ()
        angles = torch.outer(torch.arange(t, device=device, dtype=torch.float32), self.inv_freq.float())
        return angles.cos(), angles.sin()


class AuxModel(nn.Module):
    """Estimates the server part's loss from cut-layer activations, so that its gradient at the cut stands in for the
    server's: copies of the server part's first `blocks` blocks and of the final norm (fitted at alignment; with
    paradigm.aux_local also trained on the site's loss), then a fixed output layer: a frozen copy of the model's, or for
    tied embeddings the client's embedding, detached (the caller passes it). Fixed, because the output layer's gradient
    is dense: training it would change every row of a vocabulary-sized matrix each round, and the exchange of phi would
    carry all of them."""

    def __init__(self, model: nn.Module, cut: int, blocks: int) -> None:
        super().__init__()
        cfg = _model_cfg(model)
        full = _blocks(model)
        self.blocks = nn.ModuleList(copy.deepcopy(full[i]) for i in range(cut, cut + blocks))
        self.norm = copy.deepcopy(model.get_submodule(_norm_name(cfg)))
        self.head = None if cfg.tie_embeddings else copy.deepcopy(model.get_submodule("lm_head"))
        if self.head is not None:
            self.head.requires_grad_(False)

    def forward(
        self, z: torch.Tensor, args: tuple[torch.Tensor, ...], tied: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = z
        for block in self.blocks:
            x = block(x, *args)
        x = self.norm(x)
        if self.head is not None:
            return self.head(x)
        assert tied is not None, "a tied auxiliary model needs the embedding as its output layer"
        return F.linear(x, tied)


class ClientPart(nn.Module):
    """A site's model under fsl_sage or split: the full model's embeddings and first `cut` blocks, under the same
    names, and for fsl_sage the auxiliary model (`aux.*`). Training, fsl_sage: the auxiliary model's loss (its
    gradient at the cut is the estimate), uploading the activations and targets first when `upload_due`; split: a
    surrogate whose gradient at the cut is the server part's (fetched over `link`). Evaluation: the composed
    model's loss, which the server part computes. Without a link (before the site connects): the auxiliary
    model's loss, or for split a zero surrogate."""

    def __init__(self, model: nn.Module, paradigm: ParadigmConfig) -> None:
        super().__init__()
        cfg = _model_cfg(model)
        self.cfg = cfg
        self.wte = model.get_submodule("wte")
        self.gpt2 = cfg.arch == "gpt2"
        if self.gpt2:
            self.wpe, self.drop = model.get_submodule("wpe"), model.get_submodule("drop")
        self.blocks = nn.ModuleList(_blocks(model)[: paradigm.cut])
        self.rope = Rope(cfg)
        estimate = paradigm.name == "fsl_sage"
        self.aux = AuxModel(model, paradigm.cut, paradigm.aux_blocks) if estimate else None
        if self.aux is not None and not paradigm.aux_local:
            self.aux.requires_grad_(False)  # alignment alone changes it (the fitted model replaces it)
        self.link: CutLink | None = None
        self.upload_due = False

    def smash(self, idx: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The cut-layer activations of token ids [B, T], and the blocks' extra arguments for that length."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be [batch, sequence] token ids, got shape {tuple(idx.shape)}")
        t = idx.size(1)
        if t > self.cfg.context:
            raise ConfigError(f"sequence length {t} exceeds model.context={self.cfg.context}")
        x = self.wte(idx)
        if self.gpt2:
            x = self.drop(x + self.wpe(torch.arange(t, device=idx.device)))
        args = self.rope.angles(t, idx.device)
        for block in self.blocks:
            x = block(x, *args)
        return x, args

    def aux_logits(self, z: torch.Tensor, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        assert self.aux is not None
        tied = self.wte.weight.detach() if self.aux.head is None else None  # type: ignore[operator]
        return self.aux(z, args, tied)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        z, args = self.smash(idx)
        if targets is None:
            if self.aux is None:
                raise ConfigError("paradigm=split: a site holds no output layer (the server part does)")
            return self.aux_logits(z, args), None
        if not self.training:
            return z, self._composed_loss(z, targets, args)
        if self.aux is None:
            return z, self._server_gradient_loss(z, targets)
        if self.upload_due and self.link is not None:
            self.link.train(_array(z), targets.cpu().numpy())
        logits = self.aux_logits(z, args)
        return logits, lm_loss(logits, targets)

    def _composed_loss(self, z: torch.Tensor, targets: torch.Tensor, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.link is not None:
            return torch.tensor(self.link.evaluate(_array(z), targets.cpu().numpy()), device=z.device)
        if self.aux is not None:
            return lm_loss(self.aux_logits(z, args), targets)
        return torch.tensor(float("nan"), device=z.device)

    def _server_gradient_loss(self, z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A tensor whose value is the server part's loss and whose gradient at `z` is the server's."""
        if self.link is None:
            return (z * 0).sum()
        loss, grad = self.link.gradient(_array(z), targets.cpu().numpy())
        surrogate = (z * torch.from_numpy(grad).to(z.device, z.dtype)).sum()
        return surrogate - surrogate.detach() + loss


class ServerPart(nn.Module):
    """The rest of a full model cut after `cut` blocks: blocks cut.. under their own names (the first `cut` slots
    hold no parameters), the final norm, and an output layer of its own (for tied embeddings a copy of the
    embedding: the client's goes its own way). forward(z, targets) -> (logits, mean loss)."""

    def __init__(self, model: nn.Module, cut: int) -> None:
        super().__init__()
        cfg = _model_cfg(model)
        self.cfg, self.cut = cfg, cut
        full = _blocks(model)
        self.blocks = nn.ModuleList([nn.Identity() for _ in range(cut)] + full[cut:])
        self.norm_name = _norm_name(cfg)
        self.add_module(self.norm_name, model.get_submodule(self.norm_name))
        head = model.get_submodule("lm_head")
        assert isinstance(head, nn.Linear)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device=head.weight.device)
        with torch.no_grad():
            self.lm_head.weight.copy_(head.weight)
        self.rope = Rope(cfg)

    def forward(self, z: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        args = self.rope.angles(z.size(1), z.device)
        x = z
        for block in list(self.blocks)[self.cut :]:
            x = block(x, *args)
        logits = self.lm_head(self.get_submodule(self.norm_name)(x))
        if targets is None:
            return logits, torch.tensor(float("nan"))
        return logits, lm_loss(logits, targets)


def split_names(names: list[str], cut: int) -> tuple[list[str], list[str]]:
    """A full model's parameter names divided into the client part's and the server part's."""
    client = [n for n in names if n.startswith(("wte.", "wpe.")) or _block_of(n) in range(cut)]
    return client, [n for n in names if n not in client]


def _block_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit() else -1
