"""Rejoin benchmark: a >= 300M-parameter site on CPU is SIGKILLed after a sync and restarted; time to ready.

    python bench/rejoin.py --json rejoin.json            # GPT-2 Medium shape at context 128 (353.9M parameters)

A local PS runs in this process; the site runs as its own process (this script with --site), exactly as a Slurm
task runs ClientJob. Timeline: the site trains until its first sync is checkpointed, then SIGKILL, then
  live   restart with the PS up: spawn -> "ready" (model, optimizer, sampler, error feedback restored; joined;
         the checkpoint holds the PS's current model, so nothing is pulled)
  first  the first training step after that restart ("ready" -> "first_step")
  fresh  baseline in the same run: a new site (no checkpoint) joins the live PS and pulls the full model
  cold   PS stopped: spawn -> "restored" (everything restored from the local checkpoint; the site then waits
         for the PS to come back before it trains)
Output: {"params", "live_s", "cold_s", "first_step_s", "ckpt_mb", "fresh_s", ...} and a table.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def site_main(cfg_file: str, index: str, address: str) -> None:
    from geofed_hpc.client.job import ClientJob

    ClientJob(json.loads(Path(cfg_file).read_text()), int(index), address)()


class SiteProcess:
    def __init__(self, cfg_file: Path, index: int, address: str, log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "RANK", "WORLD_SIZE"))}
        self.started = time.time()
        with open(log, "ab") as out:
            cmd = [sys.executable, __file__, "--site", str(cfg_file), str(index), address]
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.log = log

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)


def events(site_dir: Path, since: float) -> list[dict[str, Any]]:
    path = site_dir / "events.jsonl"
    if not path.exists():
        return []
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in out if e["time"] >= since]


def wait_event(site: SiteProcess, site_dir: Path, name: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in events(site_dir, site.started):
            if e["event"] == name:
                return e
        if site.proc.poll() is not None:
            raise SystemExit(f"site exited ({site.proc.returncode}) before {name!r}; see {site.log}")
        time.sleep(0.05)
    raise SystemExit(f"no {name!r} event after {timeout}s; see {site.log}")


def wait_file(path: Path, site: SiteProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if site.proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"no {path.name} (site exit code {site.proc.poll()}); see {site.log}")
        time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("rejoin.json"))
    p.add_argument("--model", default="gpt2_medium")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--site", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.site:
        site_main(*args.site)
        return

    from geofed_hpc.cli import compose_config
    from geofed_hpc.config import CodecConfig, DataConfig, PSConfig, TrainConfig, to_dict
    from geofed_hpc.data.prepare import prepare_shards
    from geofed_hpc.models import build_model, num_params
    from geofed_hpc.ps.app import ParameterServer

    work = args.work or Path(tempfile.mkdtemp(prefix="rejoin-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.work is None:  # its checkpoints are about 10 GB: a temporary folder goes when the bench ends, however
        atexit.register(shutil.rmtree, work, True)
    base, _ = compose_config([f"model={args.model}", f"model.context={args.context}", f"run_dir={work / 'run'}"])
    n = num_params(build_model(base.model, seed=0, device="meta"))
    prepare_shards(
        DataConfig(tokenizer="gpt2", source="bible", max_tokens=60000, cache_dir=str(work / "cache")), work / "data", 2
    )
    ps_cfg = PSConfig(host="127.0.0.1", port=0, state_dir=str(work / "ps"), round_timeout="10m")
    train = TrainConfig(
        batch_size=1, sync_interval="1h", max_local_steps=1, max_syncs=1000, threads=os.cpu_count() or 1
    )
    data = DataConfig(source=str(work / "data"), val_batches=1)
    cfg = replace(base, wandb_mode="disabled", ps=ps_cfg, codec=CodecConfig(name="int8"), train=train, data=data)
    cfg = replace(cfg, site=replace(cfg.site, num_sites=2))
    cfg_file = work / "site.json"
    cfg_file.write_text(json.dumps(to_dict(cfg)))
    ps = ParameterServer(cfg)
    site_dir = work / "run" / "sites" / "local-0"
    log = work / "site.log"
    print(f"{n:,} parameters; work in {work}", flush=True)

    first = SiteProcess(cfg_file, 0, ps.address, log)
    wait_file(site_dir / "ckpt" / "site-000000001.gft", first, 3600)
    time.sleep(1.0)  # let the checkpoint's pruning and the best-k link finish
    first.kill()
    ckpt = site_dir / "ckpt" / "site-000000001.gft"
    ckpt_mb = ckpt.stat().st_size / 2**20

    live = SiteProcess(cfg_file, 0, ps.address, log)
    ready = wait_event(live, site_dir, "ready", 1800)
    stepped = wait_event(live, site_dir, "first_step", 1800)
    live.kill()
    live_s, first_step_s = ready["time"] - live.started, stepped["time"] - ready["time"]

    fresh = SiteProcess(cfg_file, 1, ps.address, log)
    fresh_ready = wait_event(fresh, work / "run" / "sites" / "local-1", "ready", 1800)
    fresh.kill()
    fresh_s = fresh_ready["time"] - fresh.started

    ps.stop()
    cold = SiteProcess(cfg_file, 0, ps.address, log)
    restored = wait_event(cold, site_dir, "restored", 1800)
    cold.kill()
    cold_s = restored["time"] - cold.started

    result = {
        "params": n,
        "live_s": round(live_s, 2),
        "cold_s": round(cold_s, 2),
        "first_step_s": round(first_step_s, 2),
        "ckpt_mb": round(ckpt_mb, 1),
        "fresh_s": round(fresh_s, 2),
        "live_source": ready["source"],
        "live_in_trainer_s": ready["seconds"],
        "cold_in_trainer_s": restored["seconds"],
        "model": f"{args.model} context {args.context}",
        "cpus": os.cpu_count(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is not in the checkout
    args.json.write_text(json.dumps({"rows": [result]}, indent=1))
    print(f"{'path':<34}{'seconds':>9}")
    print(f"{'live PS (rejoin, no pull)':<34}{live_s:>9.2f}   target <= 5")
    print(f"{'cold (local checkpoint only)':<34}{cold_s:>9.2f}   target <= 10")
    print(f"{'first training step':<34}{first_step_s:>9.2f}")
    print(f"{'baseline: fresh join + full pull':<34}{fresh_s:>9.2f}")
    print(f"checkpoint {ckpt_mb:.0f} MiB, {n:,} parameters; wrote {args.json}")


if __name__ == "__main__":
    main()
