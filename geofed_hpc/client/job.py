"""ClientJob: the callable submitit runs for a site, locally or under Slurm, and requeues on preemption."""

from __future__ import annotations

from typing import Any

import submitit

from geofed_hpc.config import RunConfig, from_dict
from geofed_hpc.log import logger, setup_logging


class ClientJob(submitit.helpers.Checkpointable):
    """Picklable and torch-free until called, so the launcher can submit it without importing torch.

    Its state lives in the site's fixed checkpoint directory, not on the object: a requeued job is the
    same object called again, and it resumes from that directory and the live global model.
    """

    def __init__(self, cfg: dict[str, Any], site_index: int, ps_address: str) -> None:
        self.cfg = cfg
        self.site_index = site_index
        self.ps_address = ps_address

    def __call__(self) -> dict[str, Any]:
        cfg: RunConfig = from_dict(RunConfig, self.cfg)
        setup_logging(cfg.verbosity)
        from geofed_hpc.client.trainer import SiteTrainer  # torch is imported here, inside the job

        return SiteTrainer(cfg, self.site_index, self.ps_address).run()

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        logger.info(
            "site %d: preempted or timed out; requeueing (state is in its checkpoint directory)", self.site_index
        )
        return super().checkpoint(*args, **kwargs)
