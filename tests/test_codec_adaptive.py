"""Link-adaptive codec choice: it follows the measured push rate, and a throttled link makes a site switch codec."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from geofed_hpc.codec import LinkAdaptive
from geofed_hpc.config import CodecConfig
from geofed_hpc.rpc import messages as m
from geofed_hpc.rpc.client import PSClient

MB = 1e6
N = 10_000_000  # parameters per push


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_first_push_probes_with_the_cheapest_codec(caplog: pytest.LogCaptureFixture) -> None:
    link = LinkAdaptive(CodecConfig(name="adaptive"), "osc-0")
    with caplog.at_level("INFO", logger="geofed_hpc"):
        assert link.choose(N, 30.0) == "int4"
    assert "osc-0: codec none -> int4 (no push measured yet: probing the link" in caplog.text
    link.probe(100 * MB, 1.0)  # a separate transfer seeds the rate as well
    assert link.choose(N, 30.0) == "fp32"


def test_throttled_rate_moves_the_choice_down_and_recovery_moves_it_up(caplog: pytest.LogCaptureFixture) -> None:
    link = LinkAdaptive(CodecConfig(name="adaptive", adaptive_fraction=0.1, adaptive_ema=0.5))
    link.observe("int4", int(0.5 * N), N, 0.05)  # the probe: 100 MB/s
    assert link.choose(N, 30.0) == "fp32"  # 40 MB in 0.4 s fits 3 s
    chosen = []
    with caplog.at_level("INFO", logger="geofed_hpc"):
        for _ in range(8):  # the link drops to 5 MB/s
            name = link.choose(N, 30.0)
            chosen.append(name)
            size = {"fp32": 4.0, "int16": 2.0, "bf16": 1.5, "int8": 0.9, "int4": 0.4}[name] * N
            link.observe(name, int(size), N, size / (5 * MB))
    assert chosen[0] == "fp32" and chosen[-1] == "int8"  # 0.9 * 10 MB at 5 MB/s = 1.8 s <= 3 s; bf16 needs 3 s+
    assert "codec fp32 -> " in caplog.text and "measured push rate" in caplog.text and "MB/s" in caplog.text
    for _ in range(8):  # back to 100 MB/s
        name = link.choose(N, 30.0)
        link.observe(name, int(N), N, N / (100 * MB))
    assert link.choose(N, 30.0) == "fp32"


def test_no_flapping_at_the_edge_of_the_budget() -> None:
    link = LinkAdaptive(CodecConfig(name="adaptive", adaptive_codecs=["int16", "int8"], adaptive_ema=1.0))
    link.observe("int8", N, N, 1.0)
    link.bits["int16"] = 16.0
    rate = 16 * N / 8 / 2.95  # int16 predicted at 2.95 s: inside the 3 s budget, outside the 2.4 s headroom
    link.observe("int8", N, N, N / rate)
    assert link.choose(N, 30.0) == "int8"  # moving up needs the headroom
    link.current = "int16"
    assert link.choose(N, 30.0) == "int16"  # staying only needs the budget


def test_without_an_interval_the_time_between_pushes_sets_the_budget() -> None:
    clock = Clock()
    link = LinkAdaptive(CodecConfig(name="adaptive"), clock=clock)
    link.observe("int4", N // 2, N, 0.05)
    clock.now = 1.0  # pushes one second apart, 0.1 s allowed: only int4 (0.05 s) fits
    assert link.choose(N, 0.0) == "int4"
    clock.now = 100.0  # a hundred seconds apart: fp32 (0.4 s) fits
    assert link.choose(N, 0.0) == "fp32"


class LinkTime:
    """The uplink's clock (its module's `time`): it moves only by what the modeled link takes, never by how fast
    this machine encodes or sends, so the codec chosen is the same on a busy machine and an idle one."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
        self.now += seconds


class ThrottledClient(PSClient):
    """A real client over a modeled uplink: each push (really sent over loopback) takes len(payload) / rate
    seconds on `clock`."""

    rate = 100 * MB
    clock = LinkTime()

    def push_delta(self, header: m.PushHeader, payload: bytes, budget: timedelta | None = None) -> m.PushReply:
        reply = super().push_delta(header, payload, budget)
        self.clock.now += len(payload) / self.rate
        return reply


@pytest.mark.slow
def test_a_site_switches_codec_when_its_uplink_is_throttled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from geofed_hpc.cli import compose_config
    from geofed_hpc.client import uplink
    from geofed_hpc.client.trainer import SiteTrainer
    from geofed_hpc.ps.app import ParameterServer

    # ~0.8M parameters; 3 s allowed per push (0.1 of 30 s), 2.4 s to move up: fp32 at 100 MB/s fits easily
    overrides = ["site=local", "model=tiny", "model.d_model=16", "model.d_ff=64", "train.sync_interval=30s"]
    overrides += ["codec=adaptive", "codec.adaptive_ema=1"]
    overrides += ["data.max_tokens=20000", "data.val_batches=1", "wandb_mode=disabled", f"run_dir={tmp_path}"]
    overrides += ["site.num_sites=1", "ps.downlink_codec=fp32"]
    cfg = compose_config(overrides)[0]
    server = ParameterServer(cfg)
    used = []
    try:
        trainer = SiteTrainer(cfg, 0, server.address)
        sync, model = trainer.sync, trainer.runtime.model
        with ThrottledClient(cfg.ps, server.address) as client, caplog.at_level("INFO", logger="geofed_hpc"):
            client.clock = LinkTime()
            monkeypatch.setattr(uplink, "time", client.clock)  # the push times the site measures: the link's
            sync.link.client = client
            client.connect()
            settings = sync.link.join().settings
            assert settings.codec == "adaptive"
            sync.link.seed(sync.replica.seed_arrays(), 0)
            sync.pull(0, timedelta(0))
            numel = sum(p.numel() for p in model.parameters())
            for push in range(5):
                if push == 3:
                    client.rate = 1.0 * numel  # a byte per parameter per second: fp32 takes 4 s, over budget
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p) * 1e-3)
                version = sync.version
                sync.push(1, 1.0)
                used.append(sync.uplink.link.current)
                sync.pull(version + 1, timedelta(seconds=30))
                assert sync.version == version + 1  # the PS decoded and applied every codec
    finally:
        server.stop()
    # the probe, then up as the fast link is measured; push 3 (chosen before it) is the first at 1 B/parameter/s
    assert used[:4] == ["int4", "fp32", "fp32", "fp32"], used
    assert used[4] in ("int16", "bf16", "int8", "int4"), used  # fp32 now needs 4 s > 3 s
    assert "codec fp32 -> " + used[4] in caplog.text and "measured push rate" in caplog.text
    residual = trainer.sync.uplink.feedback.residual
    assert residual and all(np.isfinite(r).all() for r in residual.values())
