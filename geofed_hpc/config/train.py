"""What a site trains on and how: `data.*`, `train.*`, `paradigm.*`."""

from __future__ import annotations

import glob
import typing
from dataclasses import field
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, StrictBool, StrictFloat, StrictInt

from geofed_hpc.config.fields import Duration, OneOrMany, check, choice
from geofed_hpc.config.section import section
from geofed_hpc.errors import ConfigError

# A site keeps its newest this many full checkpoints (model, optimizer state, all a resume needs) beside the best.
KEEP_LATEST = 2
ZeroOrMore = Annotated[StrictInt, Field(ge=0)]
AtLeastOne = Annotated[StrictInt, Field(ge=1)]
Positive = Annotated[StrictFloat, Field(gt=0)]
Fraction = Annotated[StrictFloat, Field(ge=0, le=1)]


def _auto_or_count(value: Any) -> Any:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"expected auto or a whole number of sequences (1 or more), got {value!r}")


def _positive_or_none(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a positive number or null (no clipping), got {value!r}")
    if not value > 0:
        raise ValueError(f"must be positive (null: no clipping), got {value:g}")
    return float(value)


# `auto` or a number of sequences; `auto`: probed on a GPU, from a memory budget on CPU.
MicroBatch = Annotated[Literal["auto"] | StrictInt, BeforeValidator(_auto_or_count)]
# A positive float, or None for "off".
PositiveOrNone = Annotated[StrictFloat | None, BeforeValidator(_positive_or_none)]


@section("data")
class DataConfig:
    """Training text and tokenizer."""

    source: str = "bible"
    """`bible` (shipped, offline); a file, folder or glob of .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet files;
    a folder written by Hugging Face `datasets` save_to_disk; SQuAD v1.1 JSON; or a `data prepare` folder. The
    files, globs and prepared folders may be s3:// URLs too (s3://bucket/corpus/*.jsonl.zst, s3://bucket/shards)."""
    shards_url: str = ""
    """`data prepare` also uploads the shards it made to this URL (s3://bucket/prefix), index.json last: every site
    then trains with data.source=<that URL>, fetching only its own shards (checked) into the token cache."""
    tokenizer: str = ""
    """gpt2 (GPT-2's BPE, shipped), or the path of any Hugging Face tokenizer.json ("": the model's tokenizer)."""
    text_field: str = "text"
    """The field of each .jsonl record, .parquet column or save_to_disk column that holds the text."""
    workers: ZeroOrMore = 0
    """Threads that tokenize in `data prepare`, a core each (0: one per CPU core)."""
    cache_dir: str = ""
    """Token cache ("": $GEOFED_CACHE or ~/.cache/geofed_hpc)."""
    val_fraction: Annotated[StrictFloat, Field(gt=0, lt=0.5)] = 0.02
    """The tail of the corpus held out for validation, the same for every site."""
    max_tokens: ZeroOrMore = 0
    """Use only the first N tokens (0: all)."""
    val_batches: AtLeastOne = 8
    """Batches of the validation tail each evaluation reads."""
    val_batch_size: ZeroOrMore = 0
    """Sequences per validation batch (0: train.batch_size)."""

    def __post_init__(self) -> None:
        if self.source != "bible" and not self.source.startswith("s3://"):  # a bucket is checked when read
            path = Path(self.source).expanduser()
            check(
                path.exists() or (glob.has_magic(self.source) and any(glob.iglob(str(path), recursive=True))),
                "data.source",
                f"{self.source!r} is neither 'bible' nor an existing file, folder or glob of text files",
            )


@section("train")
class TrainConfig:
    """Local training and the sync cadence (Algorithm 1: H local steps or T seconds)."""

    lr: Positive = 3e-3
    """AdamW learning rate (the peak of the schedule)."""
    warmup_steps: ZeroOrMore = 0
    """Linear lr warmup over a site's first optimizer steps (its lifetime count, which survives requeues):
    step n trains at lr x n / warmup_steps. 0: the full lr from the first step."""
    schedule: Literal["constant", "cosine", "wsd"] = "constant"
    """The lr after the warmup, over a site's lifetime steps: constant; cosine (down to lr x min_lr_ratio at
    total_steps); wsd (warmup-stable-decay: constant, then a linear decay over the last decay_fraction of
    total_steps). After total_steps the lr stays at its last value."""
    total_steps: ZeroOrMore = 0
    """The site's planned optimizer steps over all its jobs and requeues (cosine and wsd need it)."""
    min_lr_ratio: Fraction = 0.1
    """cosine, wsd: the lr at total_steps, as a fraction of lr."""
    decay_fraction: Annotated[StrictFloat, Field(gt=0, le=1)] = 0.2
    """wsd: the share of total_steps at its end over which the lr decays."""
    weight_decay: StrictFloat = 0.0
    """AdamW weight decay, on the matrices of the blocks and an untied output layer only (never on norms, biases
    or embeddings)."""
    grad_clip: PositiveOrNone = None
    """Clip the global gradient norm (over every rank's shard) to this before each step (null: no clipping)."""
    max_bad_steps: AtLeastOne = 5
    """A step whose loss or gradient norm is NaN or Inf is skipped (and counted); this many in a row stop the
    site with an error."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: this task's GPU when torch sees one, else the CPU; cuda: stop at start when there is none."""
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Compute precision (weights, gradients and optimizer state stay float32). auto: bf16 on GPUs that have
    it, fp16 with loss scaling on older GPUs, fp32 on CPU."""
    micro_batch: MicroBatch = "auto"
    """Sequences per forward/backward on each rank (the batch is accumulated over micro-batches). auto: the
    largest that fits, probed on a GPU (cached per GPU model), from a memory budget on CPU."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in the backward pass, per block: full (keep only each block's input) or selective
    (keep the matrix products, recompute norms, activations and softmax)."""
    compile: StrictBool = False
    """torch.compile each block (needs a C++ compiler on CPU; the first steps are slower while it compiles)."""
    batch_size: AtLeastOne = 8
    """Sequences per optimizer step on each site."""
    sync_interval: Duration = timedelta(seconds=30)
    """Wall-clock time between syncs (T)."""
    max_local_steps: ZeroOrMore = 0
    """Sync after this many local steps (H) if that comes first (0: no cap)."""
    max_syncs: ZeroOrMore = 0
    """Stop after this many syncs (0: until the job is stopped)."""
    seed: StrictInt = 0
    """Seed of the site's randomness."""
    threads: AtLeastOne = 1
    """Torch CPU threads per site process."""
    eval_every: ZeroOrMore = 0
    """Also evaluate the local model every this many local steps (0: only the global model, at each sync)."""
    eval_interval: Duration = timedelta(0)
    """Wall-clock time between evaluations of the pulled global model: a sync evaluates when at least this long
    has passed since the last evaluation began (0s: after every sync)."""
    eval_budget: Annotated[StrictFloat, Field(gt=0, le=1)] = 1.0
    """The most of a site's wall-clock its evaluations of the pulled global model may take. Below 1, a sync
    evaluates only when the time since the last evaluation began is at least that evaluation's seconds divided by
    this (0.05: at most 5%), and the last sync of a run (train.max_syncs) always evaluates; train.eval_interval still
    applies. 1: every sync evaluates (train.eval_interval permitting)."""
    keep_best: ZeroOrMore = 3
    """Checkpoints with the lowest validation loss kept under sites/<site>/ckpt/best (0: none). They hold the model's
    weights only (4 bytes a parameter; optimizer state and the rest of what a resume needs are in the two latest,
    about 16 bytes a parameter each): 3 keep a 1B model's site near 55 GB of scratch, a 3.3M one near 0.15 GB."""
    background_checkpoint: StrictBool = True
    """Write the checkpoint after each sync on a background thread while the next interval trains (one-process
    sites; multi-rank sites write their DCP shards at once). Its state is staged in host memory first: a second
    copy of the model and optimizer state, about 16 bytes a parameter. false: training waits for the write."""
    checkpoint_mirror: str = ""
    """An object store URL (s3://bucket/prefix; a folder works too) the site's checkpoints are mirrored to, each
    uploaded in the background once it is on local disk (training never waits; a newer checkpoint supersedes one not
    yet started) and visible there only once complete. A site whose checkpoint folder is empty (scratch purged)
    resumes from the newest complete mirror. Credentials and endpoint: the standard AWS_* variables, ~/.aws or an
    instance role, as for ps.state_dir. Checkpoints hold the site's session: keep the bucket private. "": none."""
    overlap: StrictBool = False
    """Overlapped syncs: at a sync the site hands its delta to a background sender (push, then pull of the version it
    makes) and trains on; when that version arrives it moves onto it at the next step boundary, keeping the steps
    trained since the push (local <- new global + (local now - local at push); docs/overlap.md). At most one push in
    flight: an interval that ends first waits for it. Costs two more copies of the exchanged model in host memory
    (8 bytes a parameter) and a global update that lands up to one interval late. Not for zo, fsl_sage or split."""
    slowdown: Annotated[StrictFloat, Field(ge=1, le=1000)] = 1.0
    """Emulated slower hardware: after each optimizer step, sleep a fixed emulated time, (slowdown - 1) x the median
    compute time of the site's first steps (its first interval, before its first push; measured once, at most 50
    steps; until then each step sleeps (slowdown - 1) x its own compute). A step is its real compute, measured as it
    runs, plus that fixed time: one slowed by other work on shared cores (a sync sender's threads) counts as slower,
    but the emulated accelerator time is not multiplied by host contention (1: full speed, 4: about a quarter of this
    machine's speed)."""
    step_time: Duration = timedelta(0)
    """Emulated accelerator time: a fixed sleep after each optimizer step, on top of train.slowdown's (0s: none).
    The same on every site and every run, whatever the load when it starts (benchmarks compare runs with it)."""

    def __post_init__(self) -> None:
        check(
            self.sync_interval.total_seconds() > 0 or self.max_local_steps > 0,
            "train.sync_interval",
            "set a positive sync interval or train.max_local_steps",
        )
        if self.schedule != "constant":
            check(
                self.total_steps > 0,
                "train.total_steps",
                f"schedule={self.schedule} needs the site's planned optimizer steps over the whole run, e.g. 10000",
            )
        if self.total_steps:
            check(
                self.total_steps > self.warmup_steps,
                "train.total_steps",
                f"{self.total_steps} is not more than train.warmup_steps ({self.warmup_steps}): "
                "the schedule would end inside its warmup",
            )


Paradigm = Literal["identity", "lora", "hybrid_lora", "ravan", "zo", "fsl_sage", "split"]
PARADIGMS: tuple[str, ...] = typing.get_args(Paradigm)
# Split learning: the model is cut after paradigm.cut blocks; the server part trains beside the PS.
SPLIT_PARADIGMS = ("fsl_sage", "split")
# Codecs of cut-layer activations and gradients on the wire.
ACT_CODECS = ("fp32", "bf16", "int16", "int8")
# The layers lora, hybrid_lora and ravan adapt when paradigm.targets is empty, per model.arch.
DEFAULT_TARGETS: dict[str, list[str]] = {
    "gpt2": ["attn.qkv", "attn.proj"],
    "llama": ["attn.q", "attn.k", "attn.v", "attn.o"],
    "hf": ["attention"],  # the linear layers of each decoder layer's attention, whatever the family calls them
}
# A target that names no layer but every nn.Linear of each decoder layer's attention module (q_proj, k_proj, v_proj,
# o_proj in Llama, Qwen2, Mistral, Gemma; qkv_proj, o_proj in Phi-3; ...).
ATTENTION_TARGET = "attention"


@section("paradigm")
class ParadigmConfig:
    """The reparametrization phi(theta) that sites train and exchange (Algorithm 1): identity (pretraining),
    lora (FedIT), hybrid_lora (base exchanged, private adapters), ravan (shared frozen A, B; heads H
    exchanged), zo (zeroth-order: a seed from the PS, one scalar per step back), fsl_sage (federated split
    learning: the client part and an auxiliary model exchanged, the server part beside the PS) and split (the
    same without the auxiliary model: every step waits for the server's gradient)."""

    name: Paradigm = "identity"
    """What is trained and exchanged."""
    targets: Annotated[list[str], OneOrMany] = field(default_factory=list)
    """lora / hybrid_lora / ravan: the nn.Linear layers to adapt, by name, dotted suffix (attn.qkv matches
    blocks.0.attn.qkv, blocks.1.attn.qkv, ...; q_proj matches model.layers.0.self_attn.q_proj, ...) or glob pattern
    (*.mlp.*_proj), or `attention`: every linear layer of each decoder layer's attention; [] (the default): the
    model family's attention layers (gpt2: attn.qkv, attn.proj; llama: attn.q, attn.k, attn.v, attn.o; hf:
    attention). An output layer tied to the token embedding (lm_head) is adapted on both ends, its tensors held by
    the embedding (wte.lora_a, ...)."""
    rank: AtLeastOne = 4
    """Adapter rank."""
    alpha: Positive = 8.0
    """The update is (alpha / rank) B A x."""
    heads: AtLeastOne = 4
    """ravan: heads H_i per layer."""
    base_steps: ZeroOrMore = 2
    """hybrid_lora: steps on the base weights per round, then ..."""
    adapter_steps: ZeroOrMore = 2
    """... steps on the private adapters."""
    seed: StrictInt = 0
    """Adapter init; zo: the PS's seed for the random directions."""
    zo_eps: Positive = 1e-3
    """zo: perturbation size of the two forward passes."""
    zo_lr: Positive = 1e-4
    """zo: step size along each direction."""
    cut: AtLeastOne = 1
    """fsl_sage / split: sites hold the embeddings and the first `cut` blocks (the client part); the other blocks,
    the final norm and the output layer (the server part) train beside the PS. 1 .. model.n_layers - 1."""
    aux_blocks: AtLeastOne = 1
    """fsl_sage: blocks of each site's auxiliary model, which estimates the server part's gradient at the cut; it
    starts as a copy of the server part's first blocks, final norm and output layer."""
    server_update_interval: AtLeastOne = 4
    """fsl_sage: a site uploads its cut-layer activations (and targets) every this many local steps."""
    aux_local: bool = False
    """fsl_sage: a site also trains its auxiliary model on its own loss (as CSE-FSL does). Off (FSL-SAGE's way):
    only alignment changes it, so between alignments it adds next to nothing to a push or a pull."""
    align_interval: AtLeastOne = 2
    """fsl_sage: every this many rounds (global versions) the server fits the auxiliary model to the true
    cut-layer gradients of the activations it keeps (alignment)."""
    act_codec: Annotated[str, choice(ACT_CODECS)] = "bf16"
    """fsl_sage / split: the codec of cut-layer activations and gradients on the wire, and of the fitted auxiliary
    model that fsl_sage's sites fetch after an alignment."""
    server_lr: Positive = 3e-3
    """fsl_sage / split, on the PS: AdamW learning rate of the server part and of alignment."""
    align_steps: AtLeastOne = 8
    """fsl_sage, on the PS: optimizer steps of one alignment."""
    buffer_sequences: AtLeastOne = 512
    """fsl_sage / split, on the PS: uploaded sequences the server keeps for alignment (the oldest go first); one
    upload of more sequences is refused."""

    def __post_init__(self) -> None:
        check(self.base_steps + self.adapter_steps >= 1, "paradigm.base_steps", "base + adapter steps must be >= 1")

    def describe(self) -> str:
        """The paradigm and the settings every replica must share, as one line (compared at Join)."""
        targets = "+".join(self.targets)
        if self.name == "lora":
            return f"lora(rank={self.rank}, alpha={self.alpha:g}, targets={targets})"
        if self.name == "hybrid_lora":
            return f"hybrid_lora(rank={self.rank}, alpha={self.alpha:g}, targets={targets})"
        if self.name == "ravan":
            return f"ravan(heads={self.heads}, rank={self.rank}, alpha={self.alpha:g}, targets={targets})"
        if self.name == "zo":
            return f"zo(eps={self.zo_eps:g}, lr={self.zo_lr:g})"
        if self.name == "fsl_sage":
            return (
                f"fsl_sage(cut={self.cut}, aux_blocks={self.aux_blocks}, server_update_interval="
                f"{self.server_update_interval}, align_interval={self.align_interval}, act_codec={self.act_codec})"
            )
        if self.name == "split":
            return f"split(cut={self.cut}, act_codec={self.act_codec})"
        return "identity"

    @classmethod
    def from_description(cls, text: str) -> ParadigmConfig:
        """The paradigm `describe()` wrote (as recorded in checkpoints and snapshots); ValueError if unreadable."""
        name, _, rest = text.partition("(")
        fields: dict[str, Any] = {"name": name.strip()}
        for item in filter(None, (part.strip() for part in rest.rstrip(")").split(","))):
            key, _, value = item.partition("=")
            if key == "targets":
                fields[key] = [t for t in value.split("+") if t]
            elif key in ("rank", "heads", "cut", "aux_blocks", "server_update_interval", "align_interval"):
                fields[key] = int(value)
            elif key == "act_codec":
                fields[key] = value
            elif key in ("alpha", "eps", "lr"):
                fields[{"eps": "zo_eps", "lr": "zo_lr"}.get(key, key)] = float(value)
        try:
            return cls(**fields)
        except ConfigError as exc:
            raise ValueError(f"not a paradigm description: {text!r} ({exc})") from None
