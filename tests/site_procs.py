"""Start a site's ranks as real processes (torchrun-style RANK/WORLD_SIZE, gloo) against a PS, for tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.dist_util import free_port

ROOT = Path(__file__).resolve().parent.parent


class Site:
    """A site's rank processes; logs in `folder`/rank-N.log. Always `close()` (kills by PID what is left)."""

    def __init__(self, cfg: dict[str, Any], folder: Path, ps_address: str, world: int = 1, index: int = 0) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        cfg_file = folder / f"site-{index}.json"
        cfg_file.write_text(json.dumps(cfg))
        port = str(free_port())
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
        self.logs = [folder / f"site-{index}-rank-{r}.log" for r in range(world)]
        self.procs: list[subprocess.Popen] = []
        for rank in range(world):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WANDB_SILENT="true", OMP_NUM_THREADS="1")
            with open(self.logs[rank], "ab") as log:
                cmd = [sys.executable, "-m", "tests.site_worker", str(cfg_file), str(index), ps_address]
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))

    def wait(self, timeout: float = 300) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.close()
                raise AssertionError(f"site did not finish in {timeout}s:\n{self.output()}") from None
        return codes

    def signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, sig)

    def output(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}" for log in self.logs)

    def results(self) -> list[dict[str, Any]]:
        out = []
        for log in self.logs:
            lines = [ln for ln in log.read_text().splitlines() if ln.startswith("RESULT ")]
            out.append(json.loads(lines[-1][7:]) if lines else {})
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=30)


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def events(site_dir: Path) -> list[dict[str, Any]]:
    path = site_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
