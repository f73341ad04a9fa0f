"""`launch script=train.py ARGS`: a site's job runs the user's script (federated by geofed_hpc.Site) as a child."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from geofed_hpc.ckpt import atomic_write_bytes
from geofed_hpc.ckpt.atomic import PRIVATE_FILE
from geofed_hpc.config import RunConfig, to_dict
from geofed_hpc.errors import LaunchError
from geofed_hpc.log import logger

# What the job hands the script; geofed_hpc.Site() reads them when it is given no config, site index or address.
CONFIG_ENV = "GEOFED_HPC_CONFIG"  # the composed config (JSON): the site file, ps.*, the command line's overrides
SITE_INDEX_ENV = "GEOFED_HPC_SITE_INDEX"  # which of the site's jobs this is (site.num_sites of them)
PS_ADDRESS_ENV = "GEOFED_HPC_PS_ADDRESS"  # host:port of the parameter server (the embedded one of a local launch)


def exit_reason(code: int) -> str:
    """`exited with code 3`, or `was killed by SIGKILL` for a negative return code."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ScriptRunner:
    """Runs `cfg.script` (the script, then its arguments) with this interpreter, its output in the job's log. A stop
    signal (Slurm's USR2 before a preemption or time limit, SIGTERM) goes on to the script, whose Site checkpoints at
    its next step and exits; then the job leaves as client/job.py's StopHandler says (USR2: requeued, and the script
    resumes from its checkpoint). The script exiting non-zero on its own is a LaunchError naming it and the code."""

    def __init__(self, cfg: RunConfig, site_index: int, ps_address: str) -> None:
        if not cfg.script:
            raise LaunchError("no script to run (launch script=train.py [ARGS])")
        self.cfg, self.site_index, self.ps_address = cfg, site_index, ps_address
        self.name = f"{cfg.site.name}-{site_index}"
        self.on_stop: Callable[[int], None] = _exit_for
        self._signal: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def stop_signal(self) -> int | None:
        return self._signal

    def request_stop(self, signum: int) -> bool:
        """Pass the signal on to the script; the job stops when the script has (False: not at once)."""
        self._signal = signum
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signum)
            return False
        return True  # the script has not started, or has ended: stop now

    def checkpoint_after_error(self) -> None:
        """The script keeps its own checkpoints: nothing to add."""

    def environment(self, config_file: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update({CONFIG_ENV: str(config_file), SITE_INDEX_ENV: str(self.site_index)})
        if self.ps_address:
            env[PS_ADDRESS_ENV] = self.ps_address
        return env

    def run(self) -> dict[str, Any]:
        script, *args = self.cfg.script
        directory = Path(self.cfg.run_dir) / "sites" / self.name
        directory.mkdir(parents=True, exist_ok=True)
        config_file = directory / "config.json"  # 0600: it holds the site's token
        atomic_write_bytes(config_file, json.dumps(to_dict(self.cfg)).encode(), mode=PRIVATE_FILE)
        logger.info("%s: running %s %s", self.name, script, " ".join(args))
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._proc = subprocess.Popen([sys.executable, script, *args], env=self.environment(config_file))
        code = self._proc.wait()
        if self._signal is not None:  # the script checkpointed and left as asked: requeue or exit as the job does
            logger.info("%s: %s %s after %s", self.name, script, exit_reason(code), signal.Signals(self._signal).name)
            self.on_stop(self._signal)
            raise SystemExit(128 + self._signal)
        if code != 0:
            raise LaunchError(f"script {script} {exit_reason(code)}")
        return {"site": self.name, "script": script}


def _exit_for(signum: int) -> None:
    raise SystemExit(128 + signum)
