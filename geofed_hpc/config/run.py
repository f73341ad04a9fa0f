"""RunConfig: every section together, and the checks that span sections."""

from __future__ import annotations

from dataclasses import field, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import StrictInt

from geofed_hpc.config.codec import CodecConfig
from geofed_hpc.config.fields import Name, check
from geofed_hpc.config.model import ModelConfig
from geofed_hpc.config.ps import PSConfig
from geofed_hpc.config.section import section, to_dict
from geofed_hpc.config.site import SiteConfig
from geofed_hpc.config.train import DEFAULT_TARGETS, SPLIT_PARADIGMS, DataConfig, ParadigmConfig, TrainConfig


@section("")
class RunConfig:
    """Everything one `geofed-hpc` command needs."""

    federation: Name = "geofed"
    """One name per federation: the W&B group and the default run directory."""
    run_dir: str = "runs/geofed"
    """Fixed (never timestamped) so that a requeued job finds its checkpoints again."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """Compute nodes have no internet: offline, then `wandb sync` later."""
    verbosity: StrictInt = 0
    """-1 quiet, 0 normal, 1 debug (also --quiet / --verbose)."""
    site: SiteConfig = field(default_factory=SiteConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    paradigm: ParadigmConfig = field(default_factory=ParadigmConfig)

    def __post_init__(self) -> None:
        if not self.data.tokenizer and self.model_tokenizer():
            self.data = replace(self.data, tokenizer=self.model_tokenizer())
        if not self.paradigm.targets:
            self.paradigm = replace(self.paradigm, targets=list(DEFAULT_TARGETS[self.model.arch]))
        keep = self.codec.chunk * self.ps.downlink_density
        check(
            self.ps.downlink_density == 0 or (abs(keep - round(keep)) <= 1e-6 * keep and 1 <= round(keep)),
            "ps.downlink_density",
            f"codec.chunk x ps.downlink_density must be a whole number of values kept per chunk; "
            f"{self.codec.chunk} x {self.ps.downlink_density:g} = {keep:g}",
        )
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
        if self.paradigm.name in SPLIT_PARADIGMS:
            self._check_cut()

    def _check_cut(self) -> None:
        """fsl_sage / split: the cut, and the auxiliary model's blocks, lie inside the model."""
        layers, cut = self.model.n_layers, self.paradigm.cut
        check(
            cut < layers,
            "paradigm.cut",
            f"{cut} leaves no block for the server part: model.n_layers={layers}, use 1..{max(1, layers - 1)}",
        )
        if self.paradigm.name == "fsl_sage":
            check(
                self.paradigm.aux_blocks <= layers - cut,
                "paradigm.aux_blocks",
                f"{self.paradigm.aux_blocks} is more than the server part's {layers - cut} blocks it starts from",
            )

    def model_tokenizer(self) -> str:
        """The model's usual tokenizer: model.tokenizer, else the tokenizer.json beside model.init_from ("": none)."""
        if self.model.tokenizer:
            return self.model.tokenizer
        if self.model.init_from:
            start = Path(self.model.init_from).expanduser()
            beside = (start if start.is_dir() else start.parent) / "tokenizer.json"
            if beside.is_file():
                return str(beside)
        return ""


def model_shape(cfg: RunConfig) -> dict[str, Any]:
    """The model config a site checkpoint must match (its name and initial weights do not matter), and the paradigm
    (which adds its adapters to the model)."""
    shape = {k: v for k, v in to_dict(cfg.model).items() if k not in ("name", "init_from", "tokenizer")}
    return {**shape, "paradigm": cfg.paradigm.describe()}


def shape_difference(cfg: RunConfig, recorded: dict[str, Any] | None) -> tuple[str, Any, Any] | None:
    """(key as the command line writes it, the checkpoint's value, this run's) of the first field where a checkpoint's
    recorded model (meta "model") differs from `cfg`'s; None when they agree."""
    ours = model_shape(cfg)
    # older checkpoints: pretraining, and the defaults of fields added since
    theirs = {"paradigm": "identity", **model_shape(RunConfig()), **(recorded if recorded is not None else ours)}
    diff = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if not diff:
        return None
    key = diff[0] if diff[0] == "paradigm" else f"model.{diff[0]}"
    return key, theirs.get(diff[0]), ours.get(diff[0])
