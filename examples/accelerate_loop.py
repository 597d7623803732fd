"""An Accelerate training loop with tba: one added line, `tba.integrations.wrap(model)`.

    python examples/accelerate_loop.py                  # small test GPT, about 10 s on a CPU
    accelerate launch examples/accelerate_loop.py       # the same, under accelerate's launcher
    TBA_SPILL_DIR=/local_nvme/tba python examples/accelerate_loop.py
    TBA_ENABLED=0 python examples/accelerate_loop.py    # off, code untouched

`Accelerator.prepare` wraps the model as the run needs (DDP, mixed precision); wrapping what it
returns puts every training forward under tba. `accelerator.backward` reads the activations
back, and `accelerator.accumulate` decides when the optimizer steps: each forward is one tba
step, whatever the accumulation.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

import tba
import tba.integrations
from tba.testing import GPT, GPTConfig


def train(
    steps: int = 8,
    batch: int = 4,
    seq: int = 128,
    hidden: int = 128,
    layers: int = 4,
    accumulate: int = 2,
    offloader: Any = "env",
) -> tuple[list[float], torch.nn.Module]:
    """``steps`` micro-batches; ``offloader``: "env" (the TBA_* environment), None (no tba), or
    a :class:`tba.Offloader`. Returns the losses and the trained model."""
    set_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=accumulate, cpu=True)
    cfg = GPTConfig(vocab=256, seq=seq, hidden=hidden, heads=4, layers=layers)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, cfg.vocab, (steps * batch, 1), generator=g)
    ids = (start + torch.arange(seq + 1)) % cfg.vocab  # each sequence counts up: learnable
    data = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    if offloader == "env":
        tba.integrations.wrap(model)  # <- the one line: every training forward is offloaded
    elif offloader is not None:
        tba.integrations.wrap(model, offloader)

    losses = []
    model.train()
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = model(x, y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses, accelerator.unwrap_model(model)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)

    losses, _ = train(args.steps, args.batch, args.seq, args.hidden, args.layers)
    enabled = tba.Config().enabled
    if enabled:
        tba.default_offloader().synchronize()  # in-flight writes count once they complete
    stats = tba.default_offloader().stats() if enabled else {}
    summary = {
        "losses": losses,
        "offload": enabled,
        "bytes_offloaded": stats.get("bytes_offloaded", 0),
        "bytes_reloaded": stats.get("bytes_reloaded", 0),
        "steps": stats.get("step", 0),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
