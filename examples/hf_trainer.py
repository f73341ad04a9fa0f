"""A Hugging Face Trainer fine-tuning a causal LM, federated by geofed-hpc: the lines marked `# geofed` do it all.

A tiny GPT-2, built from a config (nothing to download), learns the Zen of Python character by character. Run a
parameter server, then this script once per site:

    geofed-hpc ps up ps.port=50051 train.max_local_steps=10 &
    python examples/hf_trainer.py ps.address=127.0.0.1:50051 --site-index 0 &
    python examples/hf_trainer.py ps.address=127.0.0.1:50051 --site-index 1

With a model of your own, load it as usual (`AutoModelForCausalLM.from_pretrained(folder)`): nothing else changes.
Any `key=value` argument is a geofed-hpc setting (run_dir=..., site.name=..., ps.insecure=false ...).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import json
import os
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from geofed_hpc import FederatedCallback  # geofed

with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints it
    import this
TEXT = codecs.decode(this.s, "rot13")
VOCAB = sorted(set(TEXT))
IDS = torch.tensor([VOCAB.index(c) for c in TEXT])
LENGTH = 32


class Windows(torch.utils.data.Dataset):
    """Windows of LENGTH characters; each site reads its own half of the text."""

    def __init__(self, site: int, sites: int = 2) -> None:
        part = len(IDS) // sites
        self.ids = IDS[site * part : (site + 1) * part]

    def __len__(self) -> int:
        return len(self.ids) - LENGTH

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.ids[i : i + LENGTH]
        return {"input_ids": window, "labels": window}


@torch.no_grad()
def evaluate(model: GPT2LMHeadModel) -> float:
    starts = range(0, len(IDS) - LENGTH, 7)
    batch = torch.stack([IDS[s : s + LENGTH] for s in starts])
    model.eval()
    loss = model(input_ids=batch, labels=batch).loss.item()
    model.train()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--site-index", type=int, default=0)
    args, overrides = parser.parse_known_args()  # the rest: geofed-hpc settings, key=value

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(VOCAB), n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    start_loss = evaluate(model)
    run_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("run_dir=")), "runs/hf")
    training = TrainingArguments(
        output_dir=str(Path(run_dir) / f"trainer-{args.site_index}"),
        max_steps=args.steps,
        per_device_train_batch_size=16,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=args.site_index,
        include_num_input_tokens_seen=True,
        dataloader_drop_last=True,
    )
    federated = FederatedCallback(overrides=overrides, site_index=args.site_index)  # geofed
    trainer = Trainer(model, training, train_dataset=Windows(args.site_index), callbacks=[federated])  # geofed
    trainer.train()
    site = federated.last
    result = {"site": site.name, "steps": site.steps, "version": site.version, "syncs": site.syncs}
    print("RESULT " + json.dumps({**result, "start_loss": start_loss, "final_loss": evaluate(model)}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
