"""RunConfig: every section together, and the checks that span sections."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import StrictInt

from geofed_hpc.config.codec import CodecConfig
from geofed_hpc.config.fields import Name, check
from geofed_hpc.config.model import ModelConfig
from geofed_hpc.config.ps import PSConfig
from geofed_hpc.config.section import section, to_dict
from geofed_hpc.config.site import SiteConfig
from geofed_hpc.config.train import (
    DEFAULT_TARGETS,
    KEEP_LATEST,
    SPLIT_PARADIGMS,
    DataConfig,
    ParadigmConfig,
    TrainConfig,
)

# Bytes per parameter of what a site checkpoints (weights and optimizer state stay float32 whatever the precision).
WEIGHTS = 4
OPTIMIZER = 8  # AdamW's two moments
RESIDUAL = 4  # error feedback: what the codec lost rides on the next push (none with codec=fp32, which loses nothing)
BASE = 4  # a checkpoint taken with unpushed work (a stop mid-interval) keeps the global model it started from


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
    script: list[str] = field(default_factory=list)
    """`launch script=train.py ARGS`: each site's job runs this Python script with its arguments (a loop federated
    by geofed_hpc.Site) instead of the project's own loop; set by the command line, never in a config file."""

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
        check(
            not self.train.overlap or self.paradigm.name not in ("zo", *SPLIT_PARADIGMS),
            "train.overlap",
            f"paradigm={self.paradigm.name} ties each round to the version it starts from, so the next interval cannot "
            "train while a push is out: set train.overlap=false",
        )
        if self.paradigm.name in SPLIT_PARADIGMS:
            check(
                self.model.arch != "hf",
                "paradigm",
                f"{self.paradigm.name} cuts one of this project's models (model.arch gpt2 or llama) into parts; "
                "model=hf trains with identity, lora, hybrid_lora, ravan or zo",
            )
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
        """The model's usual tokenizer: model.tokenizer, else the tokenizer.json in model=hf's folder (model.path),
        else the one beside model.init_from ("": none)."""
        if self.model.tokenizer:
            return self.model.tokenizer
        if self.model.arch == "hf" and (Path(self.model.path).expanduser() / "tokenizer.json").is_file():
            return str(Path(self.model.path).expanduser() / "tokenizer.json")
        if self.model.init_from:
            start = Path(self.model.init_from).expanduser()
            beside = (start if start.is_dir() else start.parent) / "tokenizer.json"
            if beside.is_file():
                return str(beside)
        return ""


# Settings that are secrets: never in what a run shares (W&B's run config, which `wandb sync` uploads).
SECRET_KEYS = (("ps", "enroll_token"), ("ps", "peer_secret"), ("site", "token"))
HIDDEN = "(hidden)"


def shareable(cfg: RunConfig) -> dict[str, Any]:
    """`cfg` as a plain dict for W&B and reports, without its secrets: tokens and peer secrets hidden, the
    password of a site.proxy URL removed."""
    out = to_dict(cfg)
    for section_name, key in SECRET_KEYS:
        if out[section_name][key]:
            out[section_name][key] = HIDDEN
    proxy = out["site"]["proxy"]
    if "@" in proxy:
        scheme, _, rest = proxy.partition("://")
        userinfo, _, where = rest.rpartition("@")
        out["site"]["proxy"] = f"{scheme}://{userinfo.split(':', 1)[0]}:{HIDDEN}@{where}"
    return out


def model_shape(cfg: RunConfig) -> dict[str, Any]:
    """The model config a site checkpoint must match (its name and initial weights do not matter), and the paradigm
    (which adds its adapters to the model)."""
    shape = {k: v for k, v in to_dict(cfg.model).items() if k not in ("name", "init_from", "tokenizer", "train")}
    return {**shape, "paradigm": cfg.paradigm.describe()}


def shape_difference(cfg: RunConfig, recorded: dict[str, Any] | None) -> tuple[str, Any, Any] | None:
    """(key as the command line writes it, the checkpoint's value, this run's) of the first field where a checkpoint's
    recorded model (meta "model") differs from `cfg`'s; None when they agree. model.path (model=hf's folder) is
    recorded, for `export hf`, but may move: its config.json's shape is compared."""
    ours = model_shape(cfg)
    # older checkpoints: pretraining, and the defaults of fields added since
    theirs = {"paradigm": "identity", **model_shape(RunConfig()), **(recorded if recorded is not None else ours)}
    diff = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k) and k != "path")
    if not diff:
        return None
    key = diff[0] if diff[0] == "paradigm" else f"model.{diff[0]}"
    return key, theirs.get(diff[0]), ours.get(diff[0])


def size(n: float) -> str:
    """Bytes as MiB below a GiB, else GiB."""
    return f"{n / 2**20:.0f} MiB" if n < 2**30 else f"{n / 2**30:.1f} GiB"


def duration(delta: timedelta) -> str:
    """90s, 5m, 6m30s, 2h, 1h30m: how durations are written in the config."""
    hours, rest = divmod(int(delta.total_seconds()), 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "") + (f"{secs}s" if secs else "") or "0s"


@dataclass(frozen=True)
class Footprint:
    """A site's checkpoints: KEEP_LATEST full ones (all a resume needs) and train.keep_best of the weights alone."""

    params: int
    full_per_param: int
    best_kept: int
    sites: int

    @property
    def full(self) -> int:
        """Bytes of one full checkpoint."""
        return self.params * self.full_per_param

    @property
    def weights(self) -> int:
        """Bytes of one best checkpoint (the weights only)."""
        return self.params * WEIGHTS

    @property
    def per_site(self) -> int:
        """What a site holds once its latest and best checkpoints are all there."""
        return KEEP_LATEST * self.full + self.best_kept * self.weights

    @property
    def peak_per_site(self) -> int:
        """At most, for a moment: one more latest being written before the oldest goes, each with its base."""
        return (KEEP_LATEST + 1) * (self.full + self.params * BASE) + self.best_kept * self.weights

    def describe(self) -> str:
        """One line: per site, what it is made of, and the whole run directory's share when several sites write."""
        parts = "weights, AdamW state" + (", codec residual" if self.full_per_param > WEIGHTS + OPTIMIZER else "")
        more = f"; {self.sites} sites here: {size(self.sites * self.per_site)}" if self.sites > 1 else ""
        return (
            f"checkpoints per site {size(self.per_site)}: {KEEP_LATEST} latest x {size(self.full)} "
            f"({self.full_per_param} bytes x {self.params:,} parameters: {parts}) + {self.best_kept} best x "
            f"{size(self.weights)} (weights only, train.keep_best); up to {size(self.peak_per_site)} while one is "
            f"written{more}"
        )


def footprint(cfg: RunConfig) -> Footprint:
    """The checkpoints each site of `cfg` keeps (adapters add a little; fsl_sage and split sites hold only their part
    of the model, so at most this)."""
    per_param = WEIGHTS + OPTIMIZER + (0 if cfg.codec.name == "fp32" else RESIDUAL)
    return Footprint(cfg.model.param_count(), per_param, cfg.train.keep_best, cfg.site.num_sites)


def run_plan(cfg: RunConfig) -> str:
    """What the run will do, in one line: syncs x interval (wall-clock hours), the jobs that takes on a Slurm site,
    tokens (per step: the steps per sync follow each site's speed, which nothing here knows) and the data."""
    train, site, model = cfg.train, cfg.site, cfg.model
    step_tokens = train.batch_size * model.context
    timed = train.sync_interval.total_seconds() > 0
    cadence = f"every {duration(train.sync_interval)}" if timed else f"every {train.max_local_steps} steps"
    if timed and train.max_local_steps:
        cadence += f" or {train.max_local_steps} steps"
    if train.max_syncs and timed:
        hours = train.max_syncs * train.sync_interval.total_seconds() / 3600
        length = f"{train.max_syncs} syncs {cadence} ≈ {hours:.3g} h per site"
        if site.executor == "slurm":
            jobs = math.ceil(hours * 3600 / max(60.0, (site.timeout - site.signal_delay).total_seconds()))
            allowed = site.max_requeues + 1
            length += f" ({jobs} job{'s' * (jobs != 1)} of {duration(site.timeout)}"
            length += ")" if jobs <= allowed else f": more than site.max_requeues={site.max_requeues} allows, relaunch)"
    elif train.max_syncs:
        length = f"{train.max_syncs} syncs {cadence}"
    else:
        length = f"syncs {cadence} until the jobs stop (train.max_syncs=0)"
    if train.max_local_steps:
        most = train.max_local_steps * step_tokens
        tokens = f"at most {most:,} tokens per site a sync" + (
            f", {train.max_syncs * most:,} in all" if train.max_syncs else ""
        )
    else:
        tokens = f"{step_tokens:,} tokens a step per site, steps per sync as fast as the site trains (not known yet)"
    data = cfg.data.source + (" (the demo corpus, about 1M tokens)" if cfg.data.source == "bible" else "")
    data += f", its first {cfg.data.max_tokens:,} tokens" if cfg.data.max_tokens else ""
    return f"this run: {length}; {tokens}; data {data}"
