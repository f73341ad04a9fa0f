"""A plain torch training loop federated by geofed-hpc: the lines marked `# geofed` are all it takes.

A tiny character-level language model learns the Zen of Python (shipped with Python: nothing to download). Run a
parameter server, then this script once per site:

    geofed-hpc ps up ps.port=50051 train.max_local_steps=20 &
    python examples/torch_loop.py ps.address=127.0.0.1:50051 --site-index 0 &
    python examples/torch_loop.py ps.address=127.0.0.1:50051 --site-index 1

Any `key=value` argument is a geofed-hpc setting (run_dir=..., site.name=..., ps.insecure=false ...).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import json

import torch
import torch.nn.functional as F
from torch import nn

import geofed_hpc  # geofed

with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints it
    import this
TEXT = codecs.decode(this.s, "rot13")
VOCAB = sorted(set(TEXT))
IDS = torch.tensor([VOCAB.index(c) for c in TEXT])
CONTEXT = 4


class TinyLM(nn.Module):
    """Predicts the next character from the last CONTEXT ones."""

    def __init__(self, vocab: int = len(VOCAB), dim: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(CONTEXT * dim, hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(x).flatten(1))))


def batch(step: int, seed: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `step`, the same whenever it is drawn (a resumed job draws the batches it has not trained)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(IDS) - CONTEXT - 1, (size,), generator=g)
    x = torch.stack([IDS[s : s + CONTEXT] for s in starts.tolist()])
    return x, IDS[starts + CONTEXT]


@torch.no_grad()
def evaluate(model: nn.Module) -> float:
    x, y = batch(0, seed=999_999, size=512)
    return F.cross_entropy(model(x), y).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--site-index", type=int, default=None)
    args, overrides = parser.parse_known_args()  # the rest: geofed-hpc settings, key=value

    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    with geofed_hpc.Site(model, optimizer, overrides=overrides, site_index=args.site_index) as site:  # geofed
        start_loss = evaluate(model)  # the global model the site joined at
        for step in range(site.steps, args.steps):  # geofed: a requeued job goes on where it stopped
            x, y = batch(step, site.index)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            site.step(tokens=x.numel(), loss=loss.item())  # geofed: syncs on the PS's cadence
    result = {"site": site.name, "steps": site.steps, "version": site.version, "syncs": site.syncs}
    print("RESULT " + json.dumps({**result, "start_loss": start_loss, "final_loss": evaluate(model)}), flush=True)


if __name__ == "__main__":
    main()
