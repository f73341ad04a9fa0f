"""RunConfig: every section together, and the checks that span sections."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from geofed_hpc.config.codec import CodecConfig
from geofed_hpc.config.fields import check, one_of
from geofed_hpc.config.ps import PSConfig
from geofed_hpc.config.site import SiteConfig
from geofed_hpc.config.train import DataConfig, ModelConfig, ParadigmConfig, TrainConfig


@dataclass
class RunConfig:
    """Everything one `geofed-hpc` command needs."""

    federation: str = "geofed"
    run_dir: str = "runs/geofed"
    wandb_mode: str = "offline"
    verbosity: int = 0
    site: SiteConfig = field(default_factory=SiteConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    paradigm: ParadigmConfig = field(default_factory=ParadigmConfig)

    def __post_init__(self) -> None:
        one_of(self.wandb_mode, ("offline", "online", "disabled"), "wandb_mode")
        if self.paradigm.name == "zo":
            check(
                self.train.max_local_steps >= 1,
                "train.max_local_steps",
                "paradigm=zo sends one scalar per step: set train.max_local_steps (the steps per round), e.g. 8",
            )
            check(
                self.ps.aggregation == "sync",
                "ps.aggregation",
                "paradigm=zo draws each round's directions from the global version: use ps.aggregation=sync",
            )
            check(
                self.train.warmup_steps == 0,
                "train.warmup_steps",
                "paradigm=zo takes its own steps of paradigm.zo_lr, without AdamW: set train.warmup_steps=0",
            )
        check(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", self.federation)), "federation", "use letters, digits, _ . -")
