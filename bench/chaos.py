"""Chaos run: a federation of 3 sites under site kills, PS crashes and a full disk; no delta lost, doubled or diverged.

    python bench/chaos.py --json bench/results/chaos.json --minutes 3   # a fault every ~20 s, ~1 in 4 on the PS

A PS (async, a snapshot every 10 versions, the journal on) runs in this process; each site runs as its own process
(tests/site_worker.py, as a Slurm task runs ClientJob). At exponentially distributed intervals (mean --interval)
one fault happens, drawn by weight:
  kill        a random site is SIGKILLed and started again after --restart-delay (checkpoint + live model)
  ps-crash    the PS stops dead (no final snapshot, nothing more written: a SIGKILL between snapshots) and a new
              one starts from its state directory; without its journal it would roll back up to 9 versions
  disk-full   the PS's next file write (journal entry, snapshot or downlink update) fails with ENOSPC

The PS records every delta it applies (site, push id, the version it made). Output:
  kills, ps_crashes, disk_full   faults injected; syncs: deltas applied by the PS
  versions_continuous     the applied deltas made versions 1..V, each exactly once
  lost_deltas             pushes a site logged as sent and accepted that the PS never applied
  double_applied          applications of a push id beyond its first
  diverged                pulls after which a site's replica was not the PS's model of that version (model digest)
  loss_first, loss_last   mean validation loss (global model, as sites evaluated it) of the first/last 3 syncs
Baseline in the same run: the loss of the federation's first syncs, against which the last ones must fall.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from geofed_hpc import faults  # noqa: E402
from geofed_hpc.config import (  # noqa: E402
    CodecConfig,
    DataConfig,
    ModelConfig,
    RunConfig,
    SiteConfig,
    TrainConfig,
    to_dict,
)
from geofed_hpc.data.prepare import prepare_shards  # noqa: E402
from geofed_hpc.errors import UnavailableError  # noqa: E402
from geofed_hpc.metrics import read_jsonl  # noqa: E402
from geofed_hpc.ps.app import ParameterServer  # noqa: E402
from tests.conftest import ps_config  # noqa: E402
from tests.site_procs import Site  # noqa: E402

SITES = 3
MODEL = ModelConfig(name="t", vocab_size=50257, context=32, d_model=32, n_layers=2, n_heads=2, d_ff=64)


def site_cfg(work: Path, shards: Path) -> dict[str, Any]:
    cfg = RunConfig(
        federation="chaos",
        run_dir=str(work / "run"),
        wandb_mode="disabled",
        site=SiteConfig(num_sites=SITES),
        model=MODEL,
        ps=ps_config(connect_timeout="60s"),
        data=DataConfig(source=str(shards), val_batches=2),
        train=TrainConfig(batch_size=4, lr=3e-3, sync_interval="60s", max_local_steps=3, max_syncs=1_000_000),
    )
    return to_dict(cfg)


class AppliedLog:
    """Wrap the PS's delta application to record (site, push id, version) of every delta it applies."""

    def __init__(self, ps: ParameterServer) -> None:
        self.rows: list[tuple[str, str, int]] = []
        self.watch(ps)

    def watch(self, ps: ParameterServer) -> None:
        """Record what `ps` applies from now on (a restarted PS replays its journal before: not counted again)."""
        logic = ps.logic
        original = logic._admit

        def recorded(session: Any, header: Any, *rest: Any) -> Any:
            reply = original(session, header, *rest)
            if reply.accepted and not reply.duplicate:
                self.rows.append((session.site, header.push_id, reply.version))
            return reply

        logic._admit = recorded  # type: ignore[method-assign]


def crash(ps: ParameterServer, cfg: RunConfig) -> ParameterServer:
    """The in-process PS stops dead, as under SIGKILL: it refuses all from now on and writes nothing more (no
    final snapshot); a new PS starts on the same port from its state directory (the snapshot and the journal)."""
    core = ps.logic.core

    def dead(*args: Any, **kwargs: Any) -> Any:
        raise UnavailableError("the parameter server crashed")

    with core._cond:  # no push is mid-transition once this is held
        for name in ("admit", "seed_from", "heartbeat", "wait_model", "join", "status"):
            setattr(core, name, dead)
        core.tick = core.finish = lambda *a, **k: None  # type: ignore[method-assign]
    ps._stop.set()
    ps._served.server.stop(0).wait()
    return ParameterServer(replace(cfg, ps=replace(cfg.ps, port=ps.port)))


def diverged(work: Path) -> int:
    """Pulls after which a site's replica was not the PS's model of that version (replica_diverged events)."""
    count = 0
    for events in (work / "run" / "sites").glob("*/events.jsonl"):
        count += sum(1 for line in events.read_text().splitlines() if '"replica_diverged"' in line)
    return count


def site_rows(work: Path, index: int) -> list[dict[str, Any]]:
    path = work / "run" / "metrics" / f"local-{index}.metrics.jsonl"
    return [r for r in read_jsonl(path) if "train/loss" in r] if path.exists() else []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("chaos.json"))
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--interval", type=float, default=20.0, help="mean seconds between faults")
    p.add_argument("--site-kills", type=float, default=3.0, help="weight of site SIGKILLs among the faults")
    p.add_argument("--ps-crashes", type=float, default=1.0, help="weight of PS crashes (restart from its state)")
    p.add_argument("--disk-full", type=float, default=1.0, help="weight of ENOSPC on the PS's next file write")
    p.add_argument("--restart-delay", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    work = args.work or Path(tempfile.mkdtemp(prefix="geofed-chaos-"))
    shards = work / "shards"
    prepare_shards(DataConfig(tokenizer="gpt2", source="bible", max_tokens=200_000, val_fraction=0.05), shards, SITES)
    train = TrainConfig(sync_interval="60s", max_local_steps=3)
    ps_cfg = ps_config(aggregation="async", state_dir=str(work / "ps"), max_staleness=16, snapshot_every=10)
    run_cfg = replace(RunConfig(), ps=ps_cfg, train=train, codec=CodecConfig(name="int8"))
    ps = ParameterServer(run_cfg)
    applied = AppliedLog(ps)
    cfg = site_cfg(work, shards)
    sites = {i: Site(cfg, work / "logs", ps.address, index=i) for i in range(SITES)}
    counts = Counter[str]()
    weights = {"kill": args.site_kills, "ps-crash": args.ps_crashes, "disk-full": args.disk_full}
    end = time.monotonic() + args.minutes * 60
    print(f"chaos: {SITES} sites, {args.minutes:g} min, a fault every ~{args.interval:g}s {weights}; work in {work}")
    try:
        while True:
            wait = rng.expovariate(1.0 / args.interval)
            if time.monotonic() + wait >= end:
                time.sleep(max(0.0, end - time.monotonic()))
                break
            time.sleep(wait)
            fault = rng.choices(list(weights), weights=list(weights.values()))[0]
            counts[fault] += 1
            at = f"  t={args.minutes * 60 - (end - time.monotonic()):6.1f}s"
            if fault == "kill":
                victim = rng.randrange(SITES)
                sites[victim].signal(signal.SIGKILL)
                sites[victim].wait(timeout=60)
                print(f"{at} kill local-{victim} (PS version {ps.logic.version})", flush=True)
                time.sleep(args.restart_delay)
                sites[victim] = Site(cfg, work / "logs", ps.address, index=victim)
            elif fault == "ps-crash":
                before = ps.logic.version
                ps = crash(ps, run_cfg)
                applied.watch(ps)
                print(f"{at} PS crash at version {before}: back at {ps.logic.version}", flush=True)
            else:
                faults.install("atomic.write@1=enospc")
                print(f"{at} disk full for the PS's next write (PS version {ps.logic.version})", flush=True)
    finally:
        faults.install("")
        for s in sites.values():
            s.close()
        ps.stop()

    versions = sorted(v for _, _, v in applied.rows)
    continuous = versions == list(range(1, len(versions) + 1)) and ps.logic.version == len(versions)
    doubled = sum(n - 1 for n in Counter(pid for _, pid, _ in applied.rows).values() if n > 1)
    per_site = Counter(site for site, _, _ in applied.rows)
    rows = {i: site_rows(work, i) for i in range(SITES)}
    # A row with bytes sent is a push the site saw accepted; the PS must hold at least that many from it.
    claimed = {f"local-{i}": sum(1 for r in rs if r.get("sync/bytes_sent", 0) > 0) for i, rs in rows.items()}
    lost = sum(max(0, n - per_site.get(site, 0)) for site, n in claimed.items())
    ordered = sorted((r for rs in rows.values() for r in rs), key=lambda r: r["time"])
    vals = [float(r["val/loss"]) for r in ordered if r.get("val/loss", 0) > 0]
    drifted = diverged(work)
    result = {
        "kills": counts["kill"],
        "ps_crashes": counts["ps-crash"],
        "disk_full": counts["disk-full"],
        "syncs": len(applied.rows),
        "versions_continuous": continuous,
        "lost_deltas": lost,
        "double_applied": doubled,
        "diverged": drifted,
        "loss_first": sum(vals[:3]) / max(1, len(vals[:3])),
        "loss_last": sum(vals[-3:]) / max(1, len(vals[-3:])),
        "final_version": ps.logic.version,
        "applied_per_site": dict(per_site),
        "claimed_per_site": claimed,
        "minutes": args.minutes,
        "mean_fault_interval_s": args.interval,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": [result]}, indent=1))
    print(f"{'site':<10}{'applied':>9}{'logged':>9}")
    for site in sorted(claimed):
        print(f"{site:<10}{per_site.get(site, 0):>9}{claimed[site]:>9}")
    print(f"kills {counts['kill']}  PS crashes {counts['ps-crash']}  disk full {counts['disk-full']}  "
          f"syncs {result['syncs']}  versions continuous {continuous}")  # fmt: skip
    print(f"lost {lost}  double-applied {doubled}  diverged {drifted}  (target: 0, 0 and 0)")
    print(f"validation loss {result['loss_first']:.4f} (first 3 syncs) -> {result['loss_last']:.4f} (last 3)  "
          f"(target: falling); wrote {args.json}")  # fmt: skip
    return 0 if continuous and not lost and not doubled and not drifted else 1


if __name__ == "__main__":
    sys.exit(main())
