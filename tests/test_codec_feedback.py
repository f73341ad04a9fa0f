"""Error feedback: decoded deltas add up to the true deltas over many rounds, and the residual survives a requeue."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from geofed_hpc import codec
from geofed_hpc.config import CodecConfig


def rounds(n: int, level: float, step: float, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Deltas 0.4 step off the codec's grid (so it rounds the same way each round) with noise well below a step;
    fixed ±1 entries pin every block's range, so the grid stays put."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = (level + 0.4 * step + 0.02 * step * rng.standard_normal((64, 64))).astype(np.float32)
        x[:, 0], x[:, 1] = -1.0, 1.0
        out.append({"w": x})
    return out


def run(deltas: list[dict[str, np.ndarray]], cfg: CodecConfig, feedback: bool) -> list[float]:
    """Per round: the largest gap between the running sums of decoded and of true deltas."""
    ef = codec.ErrorFeedback()
    true_sum = np.zeros((64, 64))
    sent_sum = np.zeros((64, 64))
    gaps = []
    for d in deltas:
        true_sum += d["w"]
        if feedback:
            payload, residual = ef.encode({"w": d["w"].copy()}, cfg)
            ef.commit(residual)
        else:
            payload = codec.encode(d, cfg)
        sent_sum += codec.decode(payload)["w"]
        gaps.append(float(np.abs(sent_sum - true_sum).max()))
    return gaps


@pytest.mark.parametrize("name", ["int4", "int8", "bf16"])
def test_feedback_keeps_the_sum_of_decoded_deltas_on_the_true_sum(name: str) -> None:
    cfg = CodecConfig(name=name, block_size=64)
    # a grid point and the step there: min + k * (2 / levels) for min-max codecs, 0.5 and 2**-8 for bfloat16
    level, step = {"int4": (-1 + 9 * 2 / 15, 2 / 15), "int8": (-1 + 150 * 2 / 255, 2 / 255), "bf16": (0.5, 2**-8)}[name]
    deltas = rounds(300, level, step)
    with_ef = run(deltas, cfg, feedback=True)
    without = run(deltas, cfg, feedback=False)
    assert max(with_ef) <= step  # never more than one step behind, however many rounds
    assert without[-1] > 20 * step  # rounding the same way every round: the error grows with the rounds
    assert without[-1] > 1.8 * without[len(without) // 2]  # linearly


def test_lossless_codec_leaves_no_residual_and_a_dropped_push_keeps_the_old_one() -> None:
    ef = codec.ErrorFeedback()
    delta = {"w": np.linspace(-1, 1, 300, dtype=np.float32).reshape(3, 100)}
    payload, residual = ef.encode({"w": delta["w"].copy()}, CodecConfig(name="fp32"))
    assert residual == {}
    _, residual = ef.encode({"w": delta["w"].copy()}, CodecConfig(name="int4"))
    ef.commit(residual)
    kept = ef.residual["w"].copy()
    _, _ = ef.encode({"w": delta["w"].copy()}, CodecConfig(name="int4"))  # not committed: the push failed
    np.testing.assert_array_equal(ef.residual["w"], kept)
    d = {"w": np.zeros((3, 100), np.float32)}
    ef.encode(d, CodecConfig(name="int4"))
    np.testing.assert_array_equal(d["w"], kept)  # the residual rides on the next delta


def test_residual_of_another_shape_is_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    ef = codec.ErrorFeedback()
    ef.load({"residual/w": np.ones(4, np.float32), "model/w": np.zeros(4, np.float32)})
    assert list(ef.state()) == ["residual/w"]
    with caplog.at_level("WARNING", logger="geofed_hpc"):
        ef.encode({"w": np.zeros(5, np.float32)}, CodecConfig(name="int8"))
    assert "dropping the residual of 'w'" in caplog.text


@pytest.mark.slow
def test_site_checkpoint_keeps_the_residual_across_a_requeue(tmp_path: Path) -> None:
    from geofed_hpc.cli import compose_config
    from geofed_hpc.client.trainer import SiteTrainer

    overrides = ["site=local", "model=tiny", "data.max_tokens=20000", "data.val_batches=1", "wandb_mode=disabled"]
    cfg = compose_config([*overrides, f"run_dir={tmp_path}", "site.num_sites=1"])[0]
    first = SiteTrainer(cfg, 0, "127.0.0.1:1")
    rng = np.random.default_rng(0)
    model = first.runtime.model
    residual = {n: rng.standard_normal(p.shape).astype(np.float32) for n, p in model.named_parameters()}
    first.sync.uplink.feedback.commit(residual)
    first.ckpt.save()
    again = SiteTrainer(cfg, 0, "127.0.0.1:1")
    assert again.ckpt.load() is not None
    restored = again.sync.uplink.feedback.residual
    assert sorted(restored) == sorted(residual)
    for name, r in residual.items():
        np.testing.assert_array_equal(restored[name], r)
