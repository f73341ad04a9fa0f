"""`data prepare`, `report` and `wandb sync`: what goes into a run directory and what comes out of it."""

from __future__ import annotations

from pathlib import Path

from geofed_hpc.config import RunConfig
from geofed_hpc.paths import writable_dir


def cmd_data_prepare(cfg: RunConfig) -> int:
    from geofed_hpc.data.prepare import prepare_shards
    from geofed_hpc.data.tokenizer import run_tokenizer

    out = writable_dir(Path(cfg.run_dir).expanduser() / "data", "run_dir", make=False)  # made only on success
    tok = run_tokenizer(cfg)
    index = prepare_shards(cfg.data, out, cfg.site.shards, tok)
    tokens = sum(s.tokens for s in index.train) + (index.val.tokens if index.val else 0)
    print(
        f"{tokens:,} {index.dtype} tokens (largest id {index.max_id:,}, tokenizer {tok.name}) in {len(index.train)} "
        f"site shards + validation under {out}"
    )
    print(
        f"train with: data.source={cfg.data.shards_url or out}"
        + ("" if tok.name == "gpt2" else f" data.tokenizer={tok.name}")
    )
    return 0


def cmd_report(cfg: RunConfig) -> int:
    from geofed_hpc.metrics.report import write_report

    run_dir = Path(cfg.run_dir).expanduser()
    if run_dir.is_dir():  # report.png goes beside the metrics
        writable_dir(run_dir, "report RUN_DIR")
    path, text = write_report(run_dir)
    print(text)
    print(f"wrote {path}")
    return 0


def cmd_wandb_sync(cfg: RunConfig) -> int:
    from geofed_hpc.metrics.wandb_sync import sync_offline_runs

    return sync_offline_runs(Path(cfg.run_dir).expanduser())
