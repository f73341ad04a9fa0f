"""A restored optimizer state copied out of its mapped checkpoint on a thread, beside the site's join and first step."""

from __future__ import annotations

import threading

import torch

from geofed_hpc.log import logger


class StateCopy:
    """The optimizer's state as loaded: views of a mapped checkpoint (ckpt/tensorfile.py, `mapped`). A thread copies
    every tensor into memory of its own while the site joins and runs its first forward and backward; the copies
    replace the views just before the optimizer's first step (a step pre-hook) or before anything replaces the
    state (`finish`). Until then nothing writes the state, so the copies are exactly the views. Without it the
    first step would copy each page it writes (copy-on-write), and the mapping, with the file's blocks, would live
    as long as the optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._views = {p: dict(entries) for p, entries in optimizer.state.items()}
        self._copies: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self._error: BaseException | None = None
        self._hook: torch.utils.hooks.RemovableHandle | None = optimizer.register_step_pre_hook(self._before_step)
        self._thread = threading.Thread(target=self._run, name="optimizer-state-copy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with torch.no_grad():
                for p, entries in self._views.items():
                    self._copies[p] = {k: v.clone() for k, v in entries.items()}
        except BaseException as exc:  # noqa: BLE001 - reported by finish(); the views stay (still correct)
            self._error = exc

    def _before_step(self, *_: object) -> None:
        self.finish()

    def finish(self) -> None:
        """Wait for the copies and put them in place of the views (once; later calls return at once)."""
        if self._hook is None:
            return
        self._hook.remove()
        self._hook = None
        self._thread.join()
        if self._error is not None:
            logger.warning("optimizer state stays mapped from the checkpoint (its copy failed: %s)", self._error)
        else:
            for p, entries in self._copies.items():
                self.optimizer.state[p] = entries
        self._views, self._copies = {}, {}
