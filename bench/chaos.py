"""Chaos run: a federation of 3 sites under site kills, PS crashes and a full disk; no delta lost, doubled or diverged.

    python bench/chaos.py --json bench/results/chaos.json --minutes 3   # 9 faults: 5 kills, 2 PS crashes, 2 disk full

A PS (async, a snapshot every 10 versions, the journal on) runs in this process; each site runs as its own process
(tests/site_worker.py, as a Slurm task runs ClientJob). The faults are planned before the run starts, not drawn as
it goes: --minutes * 60 / --interval of them (at least one of each kind), shared among the kinds by weight
(--site-kills 3, --ps-crashes 1, --disk-full 1: in 3 minutes at the default 20 s, 5 kills, 2 PS crashes and 2 full
disks, about 1 in 4 a PS crash), in an order shuffled by --seed, one in each --interval slot at a time jittered
within it; kills take the sites in turn (shuffled), so every site is killed once before any twice. The plan is
printed at the start, and the same --seed plans the same run.
  kill        a site is SIGKILLed and started again after --restart-delay (checkpoint + live model)
  ps-crash    the PS stops dead (no final snapshot, nothing more written: a SIGKILL between snapshots) and a new
              one starts from its state directory; without its journal it would roll back up to 9 versions
  disk-full   the PS's next file write (journal entry, snapshot or downlink update) fails with ENOSPC; a round whose
              update could not be written stays open and is closed again later, with any delta that came meanwhile

The PS records every delta it applies: its site, its push id and the version its round made (a round closed again
after a full disk makes one version from several deltas). Output:
  kills, ps_crashes, disk_full   faults injected (`planned`: the plan per kind); syncs: deltas applied by the PS
  versions_continuous     the PS's versions are 1..V without a gap, each made by at least one applied delta, each
                          push id applied once (`continuity`, unit-tested in tests/test_chaos_bench.py); where not,
                          unmade_versions and stray_versions name the versions; versions_of_several_deltas: rounds
                          closed again after a full disk
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
from dataclasses import dataclass, replace
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


KINDS = ("kill", "ps-crash", "disk-full")


@dataclass(frozen=True)
class Fault:
    at: float  # seconds from the start
    kind: str  # one of KINDS
    victim: int = -1  # the site a kill takes (-1: the PS's faults)


def plan_faults(minutes: float, interval: float, weights: dict[str, float], seed: int, sites: int) -> list[Fault]:
    """The run's faults, in time order: minutes * 60 / interval of them, at least one of each kind weighted above 0,
    shared among the kinds by weight (largest remainder), the order shuffled by `seed`; fault i falls in slot i of
    equal slots over the run, jittered within its middle 70%; kills take the sites in turn, shuffled."""
    rng = random.Random(seed)
    kinds = [k for k in KINDS if weights.get(k, 0) > 0]
    if not kinds:
        return []
    n = max(len(kinds), int(minutes * 60 / interval + 1e-9))
    total = sum(weights[k] for k in kinds)
    share = {k: n * weights[k] / total for k in kinds}
    counts = {k: max(1, int(share[k])) for k in kinds}
    for k in sorted(kinds, key=lambda k: (counts[k] - share[k], KINDS.index(k))):  # largest remainder first
        if sum(counts.values()) >= n:
            break
        counts[k] += 1
    while sum(counts.values()) > n:  # the "at least one" of a light kind came out of the heaviest
        heaviest = max((k for k in kinds if counts[k] > 1), key=lambda k: counts[k] - share[k])
        counts[heaviest] -= 1
    order = [k for k in kinds for _ in range(counts[k])]
    rng.shuffle(order)
    turns: list[int] = []
    slot = minutes * 60 / n
    plan = []
    for i, kind in enumerate(order):
        at = (i + 0.5 + rng.uniform(-0.35, 0.35)) * slot
        victim = -1
        if kind == "kill":
            if not turns:
                turns = rng.sample(range(sites), sites)
            victim = turns.pop()
        plan.append(Fault(round(at, 1), kind, victim))
    return plan


@dataclass(frozen=True)
class Continuity:
    continuous: bool  # versions 1..final without a gap, each made by at least one delta, each push id once
    doubled: int  # applications of a push id beyond its first
    unmade: list[int]  # versions in 1..final that no applied delta made
    strays: list[int]  # versions deltas are said to have made outside 1..final
    shared: int  # versions made by several deltas (a round closed again after a full disk)


def continuity(rows: list[tuple[str, str, int]], final_version: int) -> Continuity:
    """Check the PS's applied deltas, (site, push id, version its round made), against its final version: it made
    versions 1..final_version, each from one round of one or more deltas (a round closed again after a full disk
    holds all that came meanwhile), and applied each push once."""
    made = Counter(v for _, _, v in rows)
    unmade = sorted(set(range(1, final_version + 1)) - set(made))
    strays = sorted(v for v in made if not 1 <= v <= final_version)
    doubled = sum(n - 1 for n in Counter(pid for _, pid, _ in rows).values() if n > 1)
    shared = sum(1 for n in made.values() if n > 1)
    return Continuity(not unmade and not strays and not doubled, doubled, unmade, strays, shared)


class AppliedLog:
    """Wrap the PS's rounds to record (site, push id, version made) of every delta it applies: a delta is folded into
    the open round when its push is accepted, and makes a version when that round closes (then or later: a round
    whose update could not be written is closed again, maybe with more deltas, maybe by the PS restarted from its
    journal)."""

    def __init__(self, ps: ParameterServer) -> None:
        self.rows: list[tuple[str, str, int]] = []
        self.sites: dict[str, str] = {}  # push id -> site, of the deltas folded (journaled) so far
        self.watch(ps)

    def watch(self, ps: ParameterServer) -> None:
        """Record what `ps` applies from now on. A restarted PS replays its journal before: the rounds the crashed one
        closed, not counted again; the round open at the crash (its update could not be written) is closed as the
        PS starts when it is ready (async: at once), counted here with the version it made, else when it closes."""
        core = ps.logic.core
        done = {pid for _, pid, _ in self.rows}
        if not core.strategy.count:  # no round open: what was folded and never closed was closed while starting
            made = [(site, pid, core.model.version) for pid, site in self.sites.items() if pid not in done]
            self.rows.extend(row for row in made if core.ledger.state(row[1]) == "applied")
        fold, close, take = core._fold, core._close_round, core.strategy.take
        taken: list[list[str]] = []

        def folded(prepared: Any, header: Any, site: str, *rest: Any) -> Any:
            self.sites[header.push_id] = site
            return fold(prepared, header, site, *rest)

        def took() -> Any:
            totals = take()
            taken.append(list(totals.push_ids))
            return totals

        def closed(*args: Any, **kwargs: Any) -> bool:
            taken.clear()
            moved = close(*args, **kwargs)
            if moved and taken:  # the round's deltas made this version
                self.rows.extend((self.sites.get(pid, "?"), pid, core.model.version) for pid in taken[-1])
            return moved

        core._fold = folded  # type: ignore[method-assign, assignment]
        core.strategy.take = took  # type: ignore[method-assign]
        core._close_round = closed  # type: ignore[method-assign]


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
    p.add_argument("--interval", type=float, default=20.0, help="seconds between planned faults (jittered)")
    p.add_argument("--site-kills", type=float, default=3.0, help="weight of site SIGKILLs among the faults")
    p.add_argument("--ps-crashes", type=float, default=1.0, help="weight of PS crashes (restart from its state)")
    p.add_argument("--disk-full", type=float, default=1.0, help="weight of ENOSPC on the PS's next file write")
    p.add_argument("--restart-delay", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = p.parse_args()
    weights = {"kill": args.site_kills, "ps-crash": args.ps_crashes, "disk-full": args.disk_full}
    plan = plan_faults(args.minutes, args.interval, weights, args.seed, SITES)
    planned = Counter(f.kind for f in plan)
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
    print(f"chaos: {SITES} sites, {args.minutes:g} min, {len(plan)} faults planned, one per ~{args.interval:g}s "
          f"(seed {args.seed}): {planned['kill']} kills, {planned['ps-crash']} PS crashes, "
          f"{planned['disk-full']} disk full; work in {work}")  # fmt: skip
    for f in plan:
        print(f"  plan t={f.at:6.1f}s {f.kind}" + (f" local-{f.victim}" if f.kind == "kill" else ""), flush=True)
    start = time.monotonic()
    end = start + args.minutes * 60
    try:
        for f in plan:
            time.sleep(max(0.0, start + f.at - time.monotonic()))  # a kill's restart may run past the next one's time
            counts[f.kind] += 1
            at = f"  t={time.monotonic() - start:6.1f}s"
            if f.kind == "kill":
                victim = f.victim
                sites[victim].signal(signal.SIGKILL)
                sites[victim].wait(timeout=60)
                print(f"{at} kill local-{victim} (PS version {ps.logic.version})", flush=True)
                time.sleep(args.restart_delay)
                sites[victim] = Site(cfg, work / "logs", ps.address, index=victim)
            elif f.kind == "ps-crash":
                before = ps.logic.version
                ps = crash(ps, run_cfg)
                applied.watch(ps)
                print(f"{at} PS crash at version {before}: back at {ps.logic.version}", flush=True)
            else:
                faults.install("atomic.write@1=enospc")
                print(f"{at} disk full for the PS's next write (PS version {ps.logic.version})", flush=True)
        time.sleep(max(0.0, end - time.monotonic()))
    finally:
        faults.install("")
        for s in sites.values():
            s.close()
        ps.stop()

    check = continuity(applied.rows, ps.logic.version)
    continuous, doubled = check.continuous, check.doubled
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
        "planned": {"kills": planned["kill"], "ps_crashes": planned["ps-crash"], "disk_full": planned["disk-full"]},
        "seed": args.seed,
        "unmade_versions": check.unmade,
        "stray_versions": check.strays,
        "versions_of_several_deltas": check.shared,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": [result]}, indent=1))
    print(f"{'site':<10}{'applied':>9}{'logged':>9}")
    for site in sorted(claimed):
        print(f"{site:<10}{per_site.get(site, 0):>9}{claimed[site]:>9}")
    print(f"kills {counts['kill']}  PS crashes {counts['ps-crash']}  disk full {counts['disk-full']}  "
          f"syncs {result['syncs']} ({check.shared} version(s) of several deltas)  versions continuous {continuous}"
          + (f" (made by no delta: {check.unmade}; outside 1..{ps.logic.version}: {check.strays})"
             if check.unmade or check.strays else ""))  # fmt: skip
    print(f"lost {lost}  double-applied {doubled}  diverged {drifted}  (target: 0, 0 and 0)")
    print(f"validation loss {result['loss_first']:.4f} (first 3 syncs) -> {result['loss_last']:.4f} (last 3)  "
          f"(target: falling); wrote {args.json}")  # fmt: skip
    return 0 if continuous and not lost and not doubled and not drifted else 1


if __name__ == "__main__":
    sys.exit(main())
