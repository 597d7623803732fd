"""A plain PyTorch training loop with tba: one added line, `tba.integrations.wrap(model)`.

    python examples/plain_loop.py                       # about 10 s on a 2-core CPU
    TBA_SPILL_DIR=/local_nvme/tba python examples/plain_loop.py --steps 20
    TBA_ENABLED=0 python examples/plain_loop.py         # the same loop, no offload

Settings come from the TBA_* environment (docs/configuration.md). The model is tba's small
test GPT; the data is a next-token task it can learn (each sequence counts up by a fixed stride),
so the loss goes down.
"""

from __future__ import annotations

import argparse
import json

import torch

import tba
import tba.integrations
from tba.testing import GPT, GPTConfig, strided_batches


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, seq=args.seq, hidden=args.hidden, heads=4, layers=args.layers)
    model = GPT(cfg)
    tba.integrations.wrap(model)  # <- the one line: every training forward is offloaded
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    losses = []
    for x, y in strided_batches(cfg.vocab, cfg.seq, args.batch, args.steps):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        print(f"step {len(losses):3d}  loss {losses[-1]:.4f}")

    enabled = tba.Config().enabled
    if enabled:
        tba.default_offloader().synchronize()  # in-flight writes count once they complete
    stats = tba.default_offloader().stats() if enabled else {}
    summary = {
        "losses": losses,
        "offload": enabled,
        "bytes_offloaded": stats.get("bytes_offloaded", 0),
        "bytes_reloaded": stats.get("bytes_reloaded", 0),
        "backend": stats.get("backend"),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
