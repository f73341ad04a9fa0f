"""WAN benchmark: sync time and bytes on the wire per codec over the two emulated links (root; CUBIC)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from importlib import resources
from pathlib import Path
from typing import Any

from geofed_hpc.testing.federation import TINY, WanFederation
from geofed_hpc.testing.wan import FAR, NEAR, Wan, exit_on_sigterm, unavailable_reason

LINKS = {"near": NEAR, "far": FAR}
BASELINE = "fp32"  # lossless: what every other codec is compared against, measured in the same run


def codecs() -> list[str]:
    """Every option of the `codec` config group (conf/codec/*.yaml), the baseline first."""
    folder = resources.files("geofed_hpc.conf") / "codec"
    names = sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))
    return sorted(names, key=lambda n: n != BASELINE)


def run_codec(codec: str, workdir: Path, syncs: int, interval: str, cc: str) -> list[dict[str, Any]]:
    """One federation (PS + both sites at once) with `codec`; a row per link."""
    with Wan(LINKS, workdir / "wan", congestion_control=cc) as wan:
        fed = WanFederation(wan, workdir, codec=codec, sync_interval=interval, max_syncs=syncs)
        fed.start_ps()
        for site in LINKS:
            fed.launch(site)
        start: dict[str, dict[str, Any]] = {}

        def snapshot() -> None:  # wire counters once a site has joined, seeded and pulled (its sync-0 record)
            for site in LINKS:
                if site not in start and any(r.get("sync/index") == 0 for r in fed.records(site)):
                    start[site] = wan.counters(site)

        codes = fed.wait(timedelta(minutes=15), snapshot)
        if any(codes.values()):
            raise SystemExit(f"{codec}: a site failed {codes}:\n{fed.logs()}")
        rows = []
        for site, link in LINKS.items():
            end, records, syncs_done = wan.counters(site), fed.records(site), fed.syncs(site)
            times = [r["time"] for r in records if r.get("sync/index") is not None]
            gaps = [b - a - parse_s(interval) for a, b in zip(times, times[1:], strict=False)]
            n = len(syncs_done)
            rows.append(
                {
                    "codec": codec,
                    "link": site,
                    "link_spec": link.describe(),
                    "syncs": n,
                    "sync_s_median": statistics.median(gaps),
                    "push_s_median": statistics.median(r["sync/push_seconds"] for r in syncs_done),
                    "payload_up_bytes_per_sync": statistics.mean(r["sync/bytes_sent"] for r in syncs_done),
                    "wire_up_bytes_per_sync": (end["up"]["bytes"] - start[site]["up"]["bytes"]) / n,
                    "wire_down_bytes_per_sync": (end["down"]["bytes"] - start[site]["down"]["bytes"]) / n,
                    "wire_up_bytes_join": start[site]["up"]["bytes"],
                    "wire_down_bytes_join": start[site]["down"]["bytes"],
                    "packets_lost": end["up"]["lost"] + end["down"]["lost"],
                    "val_loss_last": syncs_done[-1]["val/loss"],
                }
            )
        return rows


def parse_s(text: str) -> float:
    return float(text.rstrip("s"))


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, default=Path("bench/results/wan.json"))
    parser.add_argument("--codecs", nargs="*", default=None, help="default: every conf/codec option")
    parser.add_argument("--syncs", type=int, default=4)
    parser.add_argument("--sync-interval", default="2s", help="local training between syncs, in seconds (e.g. 2s)")
    parser.add_argument("--cc", default="cubic", help="TCP congestion control in every namespace")
    parser.add_argument("--show", action="store_true", help="only print the table of an existing --json file")
    args = parser.parse_args()
    if args.show:
        print_table(json.loads(args.json.read_text()), args.json)
        return
    reason = unavailable_reason()
    if reason:
        sys.exit(f"bench/wan.py: {reason}")
    names = args.codecs or codecs()
    rows: list[dict[str, Any]] = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="geofed-wan-bench-") as tmp:
        for codec in names:
            rows += run_codec(codec, Path(tmp) / codec, args.syncs, args.sync_interval, args.cc)
    base = {r["link"]: r for r in rows if r["codec"] == BASELINE}
    for r in rows:
        b = base.get(r["link"])
        r["wire_bytes_vs_baseline"] = (
            (r["wire_up_bytes_per_sync"] + r["wire_down_bytes_per_sync"])
            / (b["wire_up_bytes_per_sync"] + b["wire_down_bytes_per_sync"])
            if b
            else None
        )
        r["sync_time_vs_baseline"] = r["sync_s_median"] / b["sync_s_median"] if b else None
    out = {
        "bench": "wan",
        "baseline": BASELINE,
        "congestion_control": args.cc,
        "model": TINY,
        "sync_interval": args.sync_interval,
        "seconds": time.time() - started,
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    print_table(out, args.json)


def print_table(out: dict[str, Any], path: Path) -> None:
    base = out["baseline"]
    print(f"{'codec':<11}{'link':<6}{'syncs':>6}{'sync s':>8}{'push s':>8}{'payload up':>12}{'wire up':>11}"
          f"{'wire down':>11}{'lost':>6}{'wire vs ' + base:>14}{'time vs ' + base:>14}")  # fmt: skip
    for r in out["rows"]:
        rel = lambda v: f"{v:.2f}x" if v is not None else "-"  # noqa: E731
        print(
            f"{r['codec']:<11}{r['link']:<6}{r['syncs']:>6}{r['sync_s_median']:>8.2f}{r['push_s_median']:>8.2f}"
            f"{r['payload_up_bytes_per_sync'] / 1024:>8.0f} KiB{r['wire_up_bytes_per_sync'] / 1024:>7.0f} KiB"
            f"{r['wire_down_bytes_per_sync'] / 1024:>7.0f} KiB{r['packets_lost']:>6}"
            f"{rel(r['wire_bytes_vs_baseline']):>14}{rel(r['sync_time_vs_baseline']):>14}"
        )
    links = "; ".join(f"{r['link']} {r['link_spec']}" for r in out["rows"] if r["codec"] == out["rows"][0]["codec"])
    print(f"links: {links}; TCP {out['congestion_control']}; {path}")


if __name__ == "__main__":
    main()
