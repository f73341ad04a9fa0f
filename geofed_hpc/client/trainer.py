"""One site's loop: join, pull, train for a wall-clock interval, push the delta, pull, checkpoint."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from geofed_hpc import codec
from geofed_hpc.ckpt import CheckpointStore
from geofed_hpc.client.params import Arrays, delta, exchanged_arrays, load_arrays
from geofed_hpc.config import CodecConfig, RunConfig, to_dict
from geofed_hpc.data import BatchSampler, eval_batches, load_tokens, site_shard, split_tokens
from geofed_hpc.errors import AuthError, StaleError
from geofed_hpc.log import logger
from geofed_hpc.metrics import Recorder
from geofed_hpc.models import build_model
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient

EXTRA_PULL_WAIT = timedelta(seconds=30)


@dataclass
class SyncResult:
    version: int
    local_steps: int
    train_loss: float
    val_loss: float
    bytes_sent: int
    raw_bytes: int


class SiteTrainer:
    """Trains one site's model and keeps it in step with the parameter server."""

    def __init__(self, cfg: RunConfig, site_index: int, ps_address: str) -> None:
        self.cfg = cfg
        self.index = site_index
        self.name = f"{cfg.site.name}-{site_index}"
        self.ps_address = ps_address
        self.dir = Path(cfg.run_dir) / "sites" / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        torch.set_num_threads(cfg.train.threads)
        torch.manual_seed(cfg.train.seed * 1000 + site_index)

        tokens = load_tokens(cfg.data)
        train, val = split_tokens(tokens, cfg.data.val_fraction)
        shard = site_shard(train, site_index, cfg.site.num_sites)
        self.sampler = BatchSampler(
            shard, cfg.train.batch_size, cfg.model.context, seed=cfg.train.seed * 1000 + site_index
        )
        self.val = eval_batches(val, cfg.train.batch_size, cfg.model.context, cfg.data.val_batches)
        self.model = build_model(cfg.model, seed=cfg.train.seed)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
        )
        self.store = CheckpointStore(self.dir / "ckpt", prefix="site", keep=2)
        self.base: Arrays = {}
        self.version = 0
        self.syncs = 0
        self.tokens_seen = 0
        self.session = m.JoinReply("", "", 0, False)

    # ---------------------------------------------------------------- checkpoints
    def _save(self) -> None:
        tensors: dict[str, np.ndarray] = {f"model/{k}": v for k, v in exchanged_arrays(self.model).items()}
        names = {id(p): n for n, p in self.model.named_parameters()}
        for p, state in self.optimizer.state.items():
            for key, value in state.items():
                tensors[f"optim/{names[id(p)]}/{key}"] = value.detach().cpu().numpy().astype(np.float32)
        meta = {
            "version": self.version,
            "syncs": self.syncs,
            "tokens_seen": self.tokens_seen,
            "sampler": self.sampler.state_dict(),
            "session_id": self.session.session_id,
            "rejoin_token": self.session.rejoin_token,
        }
        self.store.save(self.syncs, tensors, meta)

    def _load(self) -> dict[str, Any] | None:
        loaded = self.store.load_latest()
        if loaded is None:
            return None
        tensors, meta, path = loaded
        load_arrays(self.model, {k[6:]: v for k, v in tensors.items() if k.startswith("model/")})
        params = dict(self.model.named_parameters())
        for key, value in tensors.items():
            if key.startswith("optim/"):
                name, field = key[6:].rsplit("/", 1)
                self.optimizer.state[params[name]][field] = torch.from_numpy(value.copy())
        self.sampler.load_state_dict(meta["sampler"])
        self.syncs, self.tokens_seen = int(meta["syncs"]), int(meta["tokens_seen"])
        logger.info(
            "%s: loaded local checkpoint %s (version %d, %d syncs)", self.name, path, meta["version"], self.syncs
        )
        return meta

    # ---------------------------------------------------------------- protocol steps
    def _join(self, client: PSClient, meta: dict[str, Any] | None) -> m.JoinReply:
        if meta and meta.get("session_id"):
            try:
                return client.join(m.JoinRequest(self.name, meta["rejoin_token"], resume_session=meta["session_id"]))
            except AuthError as exc:
                logger.info("%s: rejoin refused (%s); enrolling again", self.name, exc)
        return client.join(m.JoinRequest(self.name, self.cfg.site.token))

    def _pull(self, client: PSClient, min_version: int, wait: timedelta) -> None:
        header, payload = client.pull_model(self.session.session_id, min_version, wait)
        arrays = codec.decode(payload)
        load_arrays(self.model, arrays)
        self.base, self.version = arrays, header.version

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = [float(self.model(x, y)[1]) for x, y in self.val]
        self.model.train()
        return sum(losses) / len(losses)

    def _train_interval(self, settings: m.RunSettings) -> tuple[int, float]:
        deadline = time.monotonic() + settings.sync_interval_s
        steps, loss_sum = 0, 0.0
        while True:
            x, y = self.sampler.next_batch()
            _, loss = self.model(x, y)
            assert loss is not None
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            steps += 1
            loss_sum += float(loss)
            self.tokens_seen += x.numel()
            if settings.max_local_steps and steps >= settings.max_local_steps:
                break
            if settings.sync_interval_s > 0 and time.monotonic() >= deadline:
                break
        return steps, loss_sum / steps

    def _push(self, client: PSClient, settings: m.RunSettings, steps: int, loss: float) -> tuple[int, int]:
        d = delta(exchanged_arrays(self.model), self.base)
        payload = codec.encode(d, CodecConfig(name=settings.codec, block_size=settings.block_size))
        header = m.PushHeader(
            self.session.session_id,
            self.version,
            steps,
            steps * self.sampler_tokens(),
            settings.codec,
            0,
            b"",
            "",
            train_loss=loss,
        )
        reply = client.push_delta(header, payload)
        if not reply.accepted:
            logger.warning("%s: push not applied: %s", self.name, reply.reason)
        return len(payload), sum(v.nbytes for v in d.values())

    def sampler_tokens(self) -> int:
        return self.cfg.train.batch_size * self.cfg.model.context

    # ---------------------------------------------------------------- main loop
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        meta = self._load()
        with (
            PSClient(cfg.ps, self.ps_address) as client,
            Recorder(
                Path(cfg.run_dir) / "metrics",
                self.name,
                job_type="site",
                group=cfg.federation,
                wandb_mode=cfg.wandb_mode,
                config=to_dict(cfg),
            ) as rec,
        ):
            client.connect()
            self.session = self._join(client, meta)
            settings = self.session.settings
            if not self.session.initialized:
                init = codec.encode(exchanged_arrays(self.model), CodecConfig(name="fp32"))
                client.push_delta(m.PushHeader(self.session.session_id, 0, 0, 0, "fp32", 0, b"", "", init=True), init)
            resume = (
                "local" if meta and int(meta["version"]) == self.session.version else ("global" if meta else "fresh")
            )
            self._pull(client, 0, timedelta(0))
            rec.log({"resume/source": resume, "sync/version": self.version})
            if self.syncs == 0:
                rec.log({"val/loss": self.evaluate(), "sync/version": self.version, "sync/index": 0})
            results = []
            while not cfg.train.max_syncs or self.syncs < cfg.train.max_syncs:
                t0 = time.monotonic()
                steps, train_loss = self._train_interval(settings)
                train_s = time.monotonic() - t0
                t1 = time.monotonic()
                try:
                    sent, raw = self._push(client, settings, steps, train_loss)
                    push_s = time.monotonic() - t1
                    wait = cfg.ps.round_timeout + EXTRA_PULL_WAIT
                    self._pull(client, self.version + 1, wait)
                except StaleError as exc:
                    logger.warning("%s: %s; dropping this delta and pulling the latest model", self.name, exc)
                    sent, raw, push_s = 0, 0, time.monotonic() - t1
                    self._pull(client, 0, timedelta(0))
                self.syncs += 1
                val_loss = self.evaluate()
                result = SyncResult(self.version, steps, train_loss, val_loss, sent, raw)
                results.append(result)
                rec.log(
                    {
                        "sync/index": self.syncs,
                        "sync/version": self.version,
                        "sync/local_steps": steps,
                        "train/loss": train_loss,
                        "val/loss": val_loss,
                        "train/tokens": self.tokens_seen,
                        "train/tokens_per_s": steps * self.sampler_tokens() / max(train_s, 1e-9),
                        "sync/bytes_sent": sent,
                        "sync/compression_ratio": raw / sent if sent else math.nan,
                        "sync/push_seconds": push_s,
                    }
                )
                self._save()
            client.heartbeat(m.HeartbeatRequest(self.session.session_id, self.version, leaving=True))
        final = results[-1].val_loss if results else math.nan
        logger.info("%s: done after %d syncs at version %d, val loss %.4f", self.name, self.syncs, self.version, final)
        return {"site": self.name, "syncs": self.syncs, "version": self.version, "val_loss": final}
