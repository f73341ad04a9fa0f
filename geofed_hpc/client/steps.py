"""One local optimizer step over a site batch (rank slice, micro-batches, precision) and site-wide evaluation."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from geofed_hpc.client.microbatch import split_batch
from geofed_hpc.client.precision import Precision
from geofed_hpc.errors import GeofedError


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The lr multiplier of a site's `step`-th optimizer step (1-based) under a linear warmup of `warmup_steps`."""
    if step < 1:
        raise ValueError(f"steps count from 1, got {step}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be 0 or positive, got {warmup_steps}")
    return 1.0 if warmup_steps == 0 else min(1.0, step / warmup_steps)


@dataclass(frozen=True)
class StepPlan:
    """How one site batch of `batch_size` sequences is spread over ranks and micro-batches."""

    batch_size: int
    world_size: int
    rank: int
    micro_batch: int

    @property
    def rows(self) -> slice:
        return split_batch(self.batch_size, self.world_size, self.rank, self.micro_batch)[0]

    @property
    def micro(self) -> list[int]:
        return split_batch(self.batch_size, self.world_size, self.rank, self.micro_batch)[1]


class Stepper:
    """Runs local steps for one (possibly FSDP2-sharded) model; every rank calls it with the same site batch."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        plan: StepPlan,
        device: torch.device,
        sharded: bool,
        warmup_steps: int = 0,
    ) -> None:
        self.model, self.optimizer, self.precision, self.plan = model, optimizer, precision, plan
        self.device, self.sharded, self.warmup_steps = device, sharded, warmup_steps
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]  # the configured lr, not a resumed one
        self.scaler: Any = precision.grad_scaler(sharded)

    def _context(self) -> contextlib.AbstractContextManager[None]:
        # FSDP2 casts through its MixedPrecisionPolicy; an unwrapped model autocasts.
        return contextlib.nullcontext() if self.sharded else self.precision.autocast()

    def _site_mean(self, total: torch.Tensor) -> float:
        if self.sharded:
            dist.all_reduce(total)
        return float(total) / self.plan.batch_size

    def step(self, x: torch.Tensor, y: torch.Tensor, count: int) -> float:
        """Forward/backward over this rank's micro-batches of the site batch (x, y), then one optimizer step, the
        site's `count`-th (1-based; it sets the warmup lr).

        Each micro-batch loss is weighted n·W/B, so after FSDP's mean over W ranks the gradient is exactly the
        site-batch mean, whatever the micro-batch size and rank count. Returns the site-mean loss."""
        plan = self.plan
        factor = warmup_factor(count, self.warmup_steps)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor
        xs, ys = x[plan.rows], y[plan.rows]
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        at, micro = 0, plan.micro
        for i, n in enumerate(micro):
            if self.sharded:
                self.model.set_requires_gradient_sync(i == len(micro) - 1)  # type: ignore[operator]
            xb, yb = xs[at : at + n].to(self.device), ys[at : at + n].to(self.device)
            with self._context():
                _, loss = self.model(xb, yb)
            weighted = loss * (n * plan.world_size / plan.batch_size)
            (self.scaler.scale(weighted) if self.scaler else weighted).backward()
            total += loss.detach().double() * n
            at += n
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        mean = self._site_mean(total)
        if mean != mean:  # NaN
            raise GeofedError("training loss became NaN: lower train.lr or use train.precision=fp32")
        return mean

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean loss of one batch on this (one-process) model, in its precision, without a backward."""
        with self._context():
            _, loss = self.model(x.to(self.device), y.to(self.device))
        return loss

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over fixed batches (each split over ranks like a training batch)."""
        self.model.eval()
        losses = []
        try:
            for x, y in batches:
                plan = StepPlan(x.size(0), self.plan.world_size, self.plan.rank, self.plan.micro_batch)
                xs, ys = x[plan.rows], y[plan.rows]
                total = torch.zeros((), dtype=torch.float64, device=self.device)
                at = 0
                for n in plan.micro:
                    with self._context():
                        _, loss = self.model(xs[at : at + n].to(self.device), ys[at : at + n].to(self.device))
                    total += loss.double() * n
                    at += n
                if self.sharded:
                    dist.all_reduce(total)
                losses.append(float(total) / x.size(0))
        finally:
            self.model.train()
        return sum(losses) / len(losses)

    def scaler_state(self) -> dict[str, Any]:
        """The loss scaler's state (JSON-friendly numbers), {} without one."""
        if not self.scaler:
            return {}
        return {k: float(v) if isinstance(v, (int, float)) else v for k, v in self.scaler.state_dict().items()}

    def load_scaler_state(self, state: dict[str, Any]) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict({**self.scaler.state_dict(), **state})
