"""Continue a token sequence with one of our models: greedy, or sampled at a temperature."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_id: int | None = None,
    seed: int = 0,
) -> list[int]:
    """The new ids after `ids`: the most likely next token each step (temperature 0), or one drawn from
    softmax(logits / temperature); the model sees the last model.cfg.context tokens; stops after `eos_id`."""
    context = int(getattr(model, "cfg").context)  # noqa: B009 (nn.Module types its attributes loosely)
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    new: list[int] = []
    model.eval()
    for _ in range(max_new_tokens):
        logits = model(x[:, -context:])[0][0, -1].float().cpu()
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator))
        new.append(token)
        if token == eos_id:
            break
        x = torch.cat([x, torch.tensor([[token]], device=device)], dim=1)
    return new
