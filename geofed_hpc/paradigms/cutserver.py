"""The server part's math beside the PS: train on uploaded cut-layer activations, keep them, fit the auxiliary model."""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from geofed_hpc.config import ModelConfig, ParadigmConfig
from geofed_hpc.errors import CheckpointError
from geofed_hpc.models import build_model
from geofed_hpc.paradigms.exchange import Params
from geofed_hpc.paradigms.split import AUX, AuxModel, Rope, ServerPart, lm_loss

Batch = tuple[np.ndarray, np.ndarray]  # activations [B, T, d] float32, targets [B, T] int64


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy()


class KeptActivations:
    """The uploads the server keeps for alignment, oldest first, at most `capacity` sequences in all."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: deque[Batch] = deque()

    @property
    def sequences(self) -> int:
        return sum(len(t) for _, t in self.items)

    def add(self, acts: np.ndarray, targets: np.ndarray) -> None:
        self.items.append((acts, targets))
        while self.sequences > self.capacity:
            self.items.popleft()

    def state(self) -> Params:
        out: Params = {}
        for i, (acts, targets) in enumerate(self.items):
            out[f"buffer/{i:06d}/acts"] = acts
            out[f"buffer/{i:06d}/targets"] = targets.astype(np.int64)
        return out

    def load(self, tensors: Mapping[str, np.ndarray]) -> None:
        self.items.clear()
        keys = sorted({k.rsplit("/", 1)[0] for k in tensors if k.startswith("buffer/")})
        for key in keys:
            self.items.append((tensors[f"{key}/acts"].astype(np.float32), tensors[f"{key}/targets"].astype(np.int64)))


class CutServer:
    """The server part of the model cut after `paradigm.cut` blocks (built from the same config and seed as the
    sites' models, `model.init_from` included; on the GPU when there is one), its AdamW optimizer, the activations
    it keeps, and for fsl_sage the auxiliary model it last fitted (`fitted`, at global version `aligned_version`).
    Not thread-safe: the caller serialises every call."""

    def __init__(
        self, model_cfg: ModelConfig, paradigm: ParadigmConfig, seed: int, device: torch.device | None = None
    ) -> None:
        self.paradigm = paradigm
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        full = build_model(model_cfg, seed=seed)
        self.part = ServerPart(full, paradigm.cut).to(self.device)
        estimate = paradigm.name == "fsl_sage"
        self.aux = AuxModel(full, paradigm.cut, paradigm.aux_blocks).to(self.device) if estimate else None
        self.rope = Rope(model_cfg).to(self.device)
        del full
        self.optimizer = torch.optim.AdamW(self.part.parameters(), lr=paradigm.server_lr, weight_decay=0.0)
        self.kept = KeptActivations(paradigm.buffer_sequences)
        self.steps = self.alignments = 0
        self.aligned_version = -1
        self.fitted: Params = {}
        self.align_error = (float("nan"), float("nan"))  # the last alignment's estimate error, before and after

    def aux_names(self) -> list[str]:
        """The global model's names of the auxiliary model (`aux.*`) and of a tied output layer (`wte.weight`)."""
        if self.aux is None:
            return []
        names = [AUX + n for n, _ in self.aux.named_parameters()]
        return names + (["wte.weight"] if self.aux.head is None else [])

    def _tensors(self, acts: np.ndarray, targets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.from_numpy(np.ascontiguousarray(acts, np.float32)).to(self.device)
        return z, torch.from_numpy(np.ascontiguousarray(targets, np.int64)).to(self.device)

    def train(self, acts: np.ndarray, targets: np.ndarray, gradient: bool = False) -> tuple[float, np.ndarray | None]:
        """One AdamW step of the server part on an upload, which it then keeps: the loss before the step and, with
        `gradient`, the gradient of that loss at the cut."""
        z, y = self._tensors(acts, targets)
        z.requires_grad_(gradient)
        self.part.train()
        self.optimizer.zero_grad(set_to_none=True)
        _, loss = self.part(z, y)
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        self.kept.add(np.array(acts, np.float32), np.array(targets, np.int64))
        grad = z.grad.detach().to("cpu", torch.float32).numpy() if gradient and z.grad is not None else None
        return float(loss.detach()), grad

    @torch.no_grad()
    def evaluate(self, acts: np.ndarray, targets: np.ndarray) -> float:
        """The server part's loss on activations (the composed model's loss); nothing changes."""
        self.part.eval()
        z, y = self._tensors(acts, targets)
        return float(self.part(z, y)[1])

    def _true_gradient(self, acts: np.ndarray, targets: np.ndarray) -> torch.Tensor:
        z, y = self._tensors(acts, targets)
        z.requires_grad_(True)
        self.part.eval()
        _, loss = self.part(z, y)
        (grad,) = torch.autograd.grad(loss, z)
        return grad.detach()

    def _estimate_error(self, z: torch.Tensor, y: torch.Tensor, true: torch.Tensor, tied: torch.Tensor | None) -> Any:
        """||aux's gradient at the cut - the server's||^2 / ||the server's||^2, differentiable in aux's parameters."""
        assert self.aux is not None
        z = z.detach().requires_grad_(True)
        with sdpa_kernel(SDPBackend.MATH):  # the fused attention kernels have no double backward
            loss = lm_loss(self.aux(z, self.rope.angles(z.size(1), z.device), tied), y)
            (estimate,) = torch.autograd.grad(loss, z, create_graph=True)
        return ((estimate - true) ** 2).sum() / (true**2).sum().clamp_min(1e-30)

    def _mean_error(self, batches: list[Batch], trues: list[torch.Tensor], tied: torch.Tensor | None) -> float:
        pairs = zip(batches, trues, strict=False)  # the batches whose true gradient was computed
        return float(torch.stack([self._estimate_error(*self._tensors(*b), g, tied).detach() for b, g in pairs]).mean())

    def align(self, global_aux: Mapping[str, np.ndarray], version: int) -> Params:
        """Fit the auxiliary model of the global model (`global_aux`: its `aux.*` tensors and, tied, `wte.weight`)
        so that its gradient at the cut matches the server part's on the kept activations: paradigm.align_steps
        Adam steps, one kept upload each (newest first). The fitted `aux.*` tensors (its output layer stays as it
        is), kept as `fitted`."""
        assert self.aux is not None and self.kept.items
        with torch.no_grad():
            for name, p in self.aux.named_parameters():
                p.copy_(torch.from_numpy(np.asarray(global_aux[AUX + name])).to(p.device))
        tied = None
        if self.aux.head is None:
            tied = torch.from_numpy(np.asarray(global_aux["wte.weight"], np.float32)).to(self.device)
        batches = list(reversed(self.kept.items))
        trues = [self._true_gradient(a, t) for a, t in batches[: self.paradigm.align_steps]]
        trained = {n: p for n, p in self.aux.named_parameters() if p.requires_grad}  # not the fixed output layer
        optimizer = torch.optim.Adam(trained.values(), lr=self.paradigm.server_lr)
        self.aux.train()
        before = self._mean_error(batches, trues, tied)
        for step in range(self.paradigm.align_steps):
            i = step % len(trues)
            error = self._estimate_error(*self._tensors(*batches[i]), trues[i], tied)
            optimizer.zero_grad(set_to_none=True)
            error.backward()
            optimizer.step()
        self.align_error = (before, self._mean_error(batches, trues, tied))
        self.fitted = {AUX + n: _numpy(p).copy() for n, p in trained.items()}
        self.alignments += 1
        self.aligned_version = version
        return self.fitted

    # ---------------------------------------------------------------- state (the PS's split snapshots)
    def state(self) -> tuple[Params, dict[str, Any]]:
        """Tensors (server part, optimizer, kept activations, fitted aux) and meta, to write without pickle; on the
        CPU the tensors are views of the live state: write them before the next step."""
        tensors: Params = {f"part/{n}": _numpy(p) for n, p in self.part.named_parameters()}
        names = {id(p): n for n, p in self.part.named_parameters()}
        for p, entries in self.optimizer.state.items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{names[id(p)]}/{key}"] = _numpy(value)
        tensors.update(self.kept.state())
        tensors.update({f"fitted/{k}": v for k, v in self.fitted.items()})
        meta = {
            "paradigm": self.paradigm.describe(),
            "steps": self.steps,
            "alignments": self.alignments,
            "aligned_version": self.aligned_version,
            "align_error": list(self.align_error),
        }
        return tensors, meta

    def load_state(self, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any], source: str) -> None:
        """Take back what `state` wrote; a snapshot of another paradigm or cut is refused (CheckpointError)."""
        if meta.get("paradigm") != self.paradigm.describe():
            raise CheckpointError(
                f"{source} holds a server part of {meta.get('paradigm')}, this PS runs {self.paradigm.describe()}: "
                "start it with that paradigm, or use another ps.state_dir"
            )
        params = dict(self.part.named_parameters())
        wanted = {f"part/{n}" for n in params}
        if not wanted <= set(tensors):
            raise CheckpointError(f"{source} lacks server part tensors, e.g. {sorted(wanted - set(tensors))[:3]}")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(torch.from_numpy(np.asarray(tensors[f"part/{name}"])).to(p.device))
        self.optimizer.state.clear()
        for key, value in tensors.items():
            if key.startswith("optim/"):
                name, field = key[len("optim/") :].rsplit("/", 1)
                moved = torch.from_numpy(np.array(value, np.float32))
                self.optimizer.state[params[name]][field] = moved if field == "step" else moved.to(self.device)
        self.kept.load(tensors)
        self.fitted = {k[len("fitted/") :]: v for k, v in tensors.items() if k.startswith("fitted/")}
        self.steps, self.alignments = int(meta.get("steps", 0)), int(meta.get("alignments", 0))
        self.aligned_version = int(meta.get("aligned_version", -1))
        before, after = meta.get("align_error", [float("nan")] * 2)
        self.align_error = (float(before), float(after))

    def digest(self) -> str:
        """sha256 over the server part's names and bytes (tests compare it around bad input and restarts)."""
        h = hashlib.sha256()
        for name, p in sorted(self.part.named_parameters()):
            h.update(name.encode())
            h.update(_numpy(p).tobytes())
        return h.hexdigest()
