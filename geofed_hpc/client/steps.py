"""One local optimizer step over a site batch (rank slice, micro-batches, precision) and site-wide evaluation."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.exc import TorchDynamoException
from torch.distributed.tensor import DTensor

from geofed_hpc.client.microbatch import split_batch
from geofed_hpc.client.precision import Precision
from geofed_hpc.client.schedule import LRSchedule
from geofed_hpc.client.schedule import warmup_factor as warmup_factor
from geofed_hpc.errors import ConfigError, GeofedError
from geofed_hpc.log import logger


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


@dataclass(frozen=True)
class StepRules:
    """What every optimizer step obeys: the lr schedule, the gradient norm clip (None: off), how many steps in a
    row may be skipped for a NaN/Inf loss or gradient norm before the site stops, and whether blocks are
    compiled (a compile failure then says how to turn it off)."""

    schedule: LRSchedule = LRSchedule()
    grad_clip: float | None = None
    max_bad_steps: int = 5
    compiled: bool = False


class Stepper:
    """Runs local steps for one (possibly FSDP2-sharded) model; every rank calls it with the same site batch.

    `reprobe(n)` (one-process GPU sites): after an out-of-memory error mid-run at micro-batch n, the size to
    retry with (probed again below n); it is used once, a second out-of-memory error stops the site."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        plan: StepPlan,
        device: torch.device,
        sharded: bool,
        warmup_steps: int = 0,
        rules: StepRules | None = None,
    ) -> None:
        self.model, self.optimizer, self.precision, self.plan = model, optimizer, precision, plan
        self.device, self.sharded = device, sharded
        self.rules = rules or StepRules(LRSchedule(warmup=warmup_steps))
        self.warmup_steps = self.rules.schedule.warmup
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]  # the configured lr, not a resumed one
        self.scaler: Any = precision.grad_scaler(sharded)
        self.grad_norm = math.nan  # of the last step, before clipping
        self.skipped = 0  # steps skipped for a NaN/Inf loss or gradient norm, this process's lifetime
        self.bad_run = 0  # ... of them in a row, up to now
        self.reprobe: Callable[[int], int] | None = None

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        """Around a forward: autocast for an unwrapped model (FSDP2 casts through its MixedPrecisionPolicy)."""
        with self._compile_errors(), contextlib.nullcontext() if self.sharded else self.precision.autocast():
            yield

    @contextlib.contextmanager
    def _compile_errors(self) -> Iterator[None]:
        """A failure of torch.compile (train.compile), said as a config error."""
        try:
            yield
        except TorchDynamoException as exc:
            if not self.rules.compiled:
                raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"train.compile: torch.compile failed here ({first}); set train.compile=false") from exc

    def _site_mean(self, total: torch.Tensor) -> float:
        if self.sharded:
            dist.all_reduce(total)
        return float(total) / self.plan.batch_size

    def step(self, x: torch.Tensor, y: torch.Tensor, count: int) -> float:
        """Forward/backward over this rank's micro-batches of the site batch (x, y), then one optimizer step, the
        site's `count`-th (1-based; it sets the scheduled lr).

        Each micro-batch loss is weighted n·W/B, so after FSDP's mean over W ranks the gradient is exactly the
        site-batch mean, whatever the micro-batch size and rank count. Returns the site-mean loss (NaN or Inf for
        a step that was skipped)."""
        factor = self.rules.schedule.factor(count)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor
        try:
            total = self._accumulate(x, y)
        except torch.cuda.OutOfMemoryError as exc:
            self._after_oom(exc)
            total = self._accumulate(x, y)
        mean = self._site_mean(total)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        self.grad_norm = self._clip()
        if not math.isfinite(mean) or (not self.scaler and not math.isfinite(self.grad_norm)):
            self._skip(count, mean)
            return mean
        self.bad_run = 0
        if self.scaler:
            self.scaler.step(self.optimizer)  # skips the step itself when fp16 gradients overflowed
            self.scaler.update()
        else:
            self.optimizer.step()
        return mean

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches; the sum of their losses times their sizes."""
        plan = self.plan
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
            with self._compile_errors():
                (self.scaler.scale(weighted) if self.scaler else weighted).backward()
            total += loss.detach().double() * n
            at += n
        return total

    def _after_oom(self, exc: BaseException) -> None:
        """Out of GPU memory mid-run: probe again below the current micro-batch, once (one-process sites)."""
        micro = self.plan.micro_batch
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        if self.reprobe is None or self.sharded:
            raise GeofedError(
                f"out of GPU memory at micro-batch {micro} mid-run; set train.micro_batch below {micro} "
                "(several ranks cannot probe again in step)"
            ) from exc
        reprobe, self.reprobe = self.reprobe, None
        smaller = reprobe(micro)
        logger.warning("out of GPU memory at micro-batch %d mid-run; probed again: micro-batch %d", micro, smaller)
        self.plan = StepPlan(self.plan.batch_size, self.plan.world_size, self.plan.rank, smaller)

    def _clip(self) -> float:
        """The global gradient norm over every rank's shards (clipped to train.grad_clip when it is set)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if self.rules.grad_clip is not None:
            params = [p for p in self.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, self.rules.grad_clip, norm, foreach=True)
        return float(norm)

    def _skip(self, count: int, loss: float) -> None:
        """A NaN/Inf loss or gradient norm: no update for this batch; too many in a row stop the site."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler:
            self.scaler.update()
        self.skipped += 1
        self.bad_run += 1
        logger.warning(
            "site step %d skipped: loss %s, gradient norm %s (%d in a row)", count, loss, self.grad_norm, self.bad_run
        )
        if self.bad_run >= self.rules.max_bad_steps:
            raise GeofedError(
                f"training loss or gradient norm was NaN/Inf in {self.bad_run} steps in a row (the last at site "
                f"step {count}, train.max_bad_steps={self.rules.max_bad_steps}): lower train.lr, set "
                "train.grad_clip, or use train.precision=fp32"
            )

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
