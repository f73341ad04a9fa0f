"""A one-process site's optimizer state restored from a mapped checkpoint: its steps are bit for bit those of the
site that was never stopped, and from its first step the state is memory of its own (never the file's pages)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from geofed_hpc.ckpt import load_tensors, save_tensors
from geofed_hpc.client.group import SiteGroup
from geofed_hpc.client.precision import Precision
from geofed_hpc.client.steps import Stepper, StepPlan
from geofed_hpc.config import ModelConfig
from geofed_hpc.data import BatchSampler
from geofed_hpc.models import build_model

GPT = ModelConfig(name="t", vocab_size=128, context=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)
CPU = torch.device("cpu")


def _site(model_seed: int = 0, seed: int = 0) -> SiteGroup:
    torch.manual_seed(seed)
    model = build_model(GPT, seed=model_seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepper = Stepper(model, optimizer, Precision("fp32"), StepPlan(2, 1, 0, 2), CPU, False)
    tokens = np.random.default_rng(seed).integers(0, GPT.vocab_size, 4000).astype(np.uint16)
    return SiteGroup(stepper, BatchSampler(tokens, 2, GPT.context, seed=seed), [], 0, 1)


def _inside(tensor: torch.Tensor, arrays: dict[str, np.ndarray]) -> bool:
    lo = min(a.__array_interface__["data"][0] for a in arrays.values() if a.size)
    hi = max(a.__array_interface__["data"][0] + a.nbytes for a in arrays.values() if a.size)
    return lo <= tensor.data_ptr() < hi


def test_a_restored_optimizer_state_steps_bit_for_bit_and_leaves_the_mapped_file(tmp_path: Path) -> None:
    going = _site()
    for _ in range(3):
        going.step()
    path = tmp_path / "site.gft"
    save_tensors(
        path,
        {
            **{f"model/{k}": np.array(v, copy=True) for k, v in going.model_arrays().items()},
            **going.optimizer_arrays(),
        },
        {"draws": going.sampler.state_dict()},
    )
    file_before = path.read_bytes()

    restored = _site(model_seed=1)  # another start: its weights come from the checkpoint
    tensors, meta = load_tensors(path, mapped=True)
    restored.load_model({k[6:]: v for k, v in tensors.items() if k.startswith("model/")})
    restored.load_optimizer({k: v for k, v in tensors.items() if k.startswith("optim/")})
    restored.sampler.load_state_dict(meta["draws"])
    assert restored.state_copy is not None
    mapped_state = [v for entries in restored.optimizer.state.values() for v in entries.values()]
    assert mapped_state and all(_inside(v, tensors) for v in mapped_state)  # views until the first step
    saved = restored.optimizer_arrays()  # a save before the first step reads what was restored
    for key, value in going.optimizer_arrays().items():
        np.testing.assert_array_equal(saved[key], value)

    for _ in range(2):
        assert going.step() == restored.step()
    for (name, a), b in zip(going.model.named_parameters(), restored.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    states = [v for entries in restored.optimizer.state.values() for v in entries.values()]
    assert states and not any(_inside(v, tensors) for v in states)  # copies of their own
    for key, value in going.optimizer_arrays().items():
        np.testing.assert_array_equal(restored.optimizer_arrays()[key], value)
    assert path.read_bytes() == file_before


def test_a_second_restore_replaces_the_first_before_its_copy_is_used(tmp_path: Path) -> None:
    site = _site()
    site.step()
    path = tmp_path / "a.gft"
    save_tensors(path, site.optimizer_arrays(), {})
    first, _ = load_tensors(path, mapped=True)
    site.load_optimizer(first)
    site.step()
    second_arrays = site.optimizer_arrays()
    save_tensors(path, second_arrays, {})
    second, _ = load_tensors(path, mapped=True)
    site.load_optimizer(second)  # the first restore's copy is finished and dropped, the second's is in place
    for key, value in site.optimizer_arrays().items():
        np.testing.assert_array_equal(value, second_arrays[key])
    site.step()
    states = [v for entries in site.optimizer.state.values() for v in entries.values()]
    assert not any(_inside(v, second) or _inside(v, first) for v in states)
