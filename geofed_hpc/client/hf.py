"""FederatedCallback: a Hugging Face Trainer federated by geofed_hpc.Site (one callback, nothing else changes)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from geofed_hpc.client.api import Site
from geofed_hpc.config import RunConfig
from geofed_hpc.errors import ConfigError


class FederatedCallback(TrainerCallback):  # type: ignore[misc]
    """Federate a Hugging Face `Trainer`: its model joins a geofed-hpc federation through `geofed_hpc.Site`.

    ::

        from geofed_hpc import FederatedCallback

        trainer = Trainer(model, args, train_dataset=data,
                          callbacks=[FederatedCallback(overrides=["ps.address=vm.example.org:50051"])])
        trainer.train()

    When training begins the site joins (or resumes: model and optimizer state from its checkpoint), and the
    Trainer's model becomes the global model. After every optimizer step the site counts the step with the last
    logged loss (set `logging_steps=1` for every step's) and the tokens the Trainer counted
    (`include_num_input_tokens_seen`); on the PS's cadence it pushes the delta, pulls and copies the global model
    into the Trainer's parameters in place (the Trainer's optimizer keeps training them). When training ends it
    pushes the last steps and leaves: the Trainer's model is the global model.

    A requeued job's Trainer starts at `site.steps` of `max_steps` (the Trainer's own step counter is moved
    there, so the step budget is kept); the Trainer's data loader starts over. The keyword arguments are
    Site's (`config`, `overrides`, `site_index`, `ps_address`, `handle_signals`); see `help(geofed_hpc.Site)`.
    One process per site (no multi-GPU Trainer): the site's rank is the whole site.
    """

    def __init__(
        self,
        *,
        config: RunConfig | Mapping[str, Any] | str | Path | None = None,
        overrides: Iterable[str] = (),
        site_index: int | None = None,
        ps_address: str | None = None,
        handle_signals: bool = True,
    ) -> None:
        self.options: dict[str, Any] = {
            "config": config,
            "overrides": list(overrides),
            "site_index": site_index,
            "ps_address": ps_address,
            "handle_signals": handle_signals,
        }
        self.site: Site | None = None  # while training
        self.last: Site | None = None  # the site of the last training run (its steps, version, syncs)
        self._loss = math.nan
        self._tokens = 0

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if args.world_size > 1:
            raise ConfigError(
                f"FederatedCallback: the Trainer runs {args.world_size} processes; a site federates one process"
            )
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer
        self.site = self.last = Site(model, optimizer, **self.options).__enter__()  # type: ignore[arg-type]
        self._tokens = int(state.num_input_tokens_seen or 0)
        if self.site.steps:  # a requeued job: the steps done count against max_steps
            state.global_step = self.site.steps

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs and "loss" in logs:
            self._loss = float(logs["loss"])

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.site is None:
            return
        seen = int(state.num_input_tokens_seen or 0)
        tokens, self._tokens = seen - self._tokens, seen
        self.site.step(tokens=tokens, loss=self._loss)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.site is not None:
            site, self.site = self.site, None
            site.__exit__(None, None, None)
