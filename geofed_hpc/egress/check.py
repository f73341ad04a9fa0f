"""`site check`'s probe of the paths to the PS, run where the jobs run (a compute node), and its saved result, which
`launch`'s preflight reads: a site whose site.egress holds no path that worked is refused, naming one that did."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from geofed_hpc.config import RunConfig
from geofed_hpc.errors import GeofedError
from geofed_hpc.log import logger

CHECK_FILE = "egress-check.json"  # <run_dir>/egress-check.json: the last `site check` from a compute node
WHY_MAX = 400  # characters of a path's failure kept in the result
Level = Literal["ok", "warning", "error"]


@dataclass
class PathResult:
    """One path as the probe found it: it works (with the PS's round trip in ms), or why not."""

    path: str
    ok: bool
    rtt_ms: float = 0.0
    why: str = ""
    in_egress: bool = True

    def line(self) -> str:
        tail = "" if self.in_egress else " (not in site.egress)"
        if self.ok:
            return f"{self.path:<8} works: round trip {self.rtt_ms:.1f} ms{tail}"
        return f"{self.path:<8} does not work: {self.why}{tail}"


def candidates(cfg: RunConfig) -> list[str]:
    """site.egress in order, then the other paths this site file configures (tried, so a refusal can name them)."""
    site = cfg.site
    configured = {"direct": True, "proxy": bool(site.proxy), "relay": bool(site.relay), "tunnel": bool(site.tunnel)}
    configured["spool"] = bool(getattr(site, "spool", ""))
    return [*site.egress, *(p for p, given in configured.items() if given and p not in site.egress)]


def probe(cfg: RunConfig, address: str, timeout: timedelta) -> list[PathResult]:
    """Try each candidate path against the PS at `address`: each opened, probed and closed again."""
    from geofed_hpc.egress.paths import try_path

    results = []
    for name in candidates(cfg):
        try:
            route, rtt = try_path(name, cfg, address, timeout)
            route.close()
            results.append(PathResult(name, True, round(rtt * 1e3, 2), in_egress=name in cfg.site.egress))
        except GeofedError as exc:
            why = "".join(c if c.isprintable() else "?" for c in str(exc))[:WHY_MAX]
            results.append(PathResult(name, False, why=why, in_egress=name in cfg.site.egress))
    return results


def probe_job(plain: dict[str, Any], address: str, timeout_s: float) -> dict[str, Any]:
    """What the probe job runs on the compute node (its config as a plain dict): the result to save."""
    from geofed_hpc.config import from_dict

    cfg = from_dict(RunConfig, plain)
    results = probe(cfg, address, timedelta(seconds=timeout_s))
    return {"site": cfg.site.name, "address": address, "node": socket.gethostname(), "at": time.time(),
            "paths": [asdict(r) for r in results]}  # fmt: skip


def save(run_dir: Path, result: dict[str, Any]) -> Path:
    """Write the result atomically into <run_dir>/egress-check.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CHECK_FILE
    tmp = run_dir / f".{CHECK_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)
    return path


def load(run_dir: Path) -> dict[str, Any] | None:
    """The last saved result, or None (none yet, or unreadable: said in the log)."""
    path = run_dir / CHECK_FILE
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text())
        [PathResult(**p) for p in value["paths"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("egress: ignoring %s: %s", path, exc)
        return None
    return value if isinstance(value, dict) else None


def results_of(saved: dict[str, Any]) -> list[PathResult]:
    return [PathResult(**p) for p in saved["paths"]]


def verdict(cfg: RunConfig, address: str, saved: dict[str, Any] | None) -> tuple[Level, str]:
    """(level, line) of the preflight's egress check from the last saved probe: an error when no path of site.egress
    worked from a compute node, naming one that did (or what to set up)."""
    egress = ",".join(cfg.site.egress)
    if saved is None:
        return "ok", f"site.egress=[{egress}] (no `site check` from a compute node yet: each job tries them in order)"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(saved.get("at", 0))))
    if saved.get("address") != address:
        return "warning", f"the last `site check` ({when}) probed {saved.get('address')}, not {address}: run it again"
    results = results_of(saved)
    works = [r for r in results if r.ok and r.path in cfg.site.egress]
    if works:
        first, node = works[0], saved["node"]
        return "ok", f"jobs reach the PS by {first.path} ({first.rtt_ms:.1f} ms; `site check` {when} on {node})"
    failed = "; ".join(f"{r.path}: {r.why}" for r in results if r.path in cfg.site.egress)
    others = [r.path for r in results if r.ok]
    if others:
        use = f"set site.egress=[{others[0]}] (it worked from {saved['node']})"
    else:
        use = "set up a proxy, relay or tunnel (README: when compute nodes cannot reach the internet), then site check"
    return "error", f"site.egress: no path of [{egress}] reaches the PS from a compute node ({failed}): {use}"
