"""DDP under torchrun with tba: each rank wraps its model, and spills into its own directory.

    examples/torchrun.sh                                   # 2 processes on this node, about 15 s
    torchrun --nproc-per-node=2 examples/ddp_torchrun.py   # the same, by hand

Every rank makes `<TBA_SPILL_DIR>/<host>-<pid>-rank<r>/`: point TBA_SPILL_DIR at a node-local
NVMe drive (never a shared filesystem); ranks never share files or extents. TBA_RANK defaults to
torchrun's $RANK. Uses gloo, so it runs on CPU-only machines; with GPUs use nccl.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

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

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(max(1, torch.get_num_threads() // dist.get_world_size()))
    torch.manual_seed(0)  # the same initial weights on every rank
    cfg = GPTConfig(vocab=256, seq=args.seq, hidden=args.hidden, heads=4, layers=args.layers)
    model = DDP(GPT(cfg))
    tba.integrations.wrap(model.module)  # <- tba (wrapping the DDP module works too)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for x, y in strided_batches(cfg.vocab, cfg.seq, args.batch, args.steps, seed=rank):
        loss = model(x, y)
        loss.backward()  # DDP all-reduces while tba reads activations back
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if rank == 0:
            print(f"step {len(losses):3d}  loss {losses[-1]:.4f}")

    summary = {"rank": rank, "losses": losses, "offload": tba.Config().enabled}
    if summary["offload"]:
        off = tba.default_offloader()
        off.synchronize()  # writes still in flight count as offloaded once they complete
        st = off.stats()
        summary.update(
            spill_path=off.backend.spill_path,
            bytes_offloaded=st["bytes_offloaded"],
            bytes_reloaded=st["bytes_reloaded"],
        )
    print(json.dumps(summary), flush=True)
    # Free DDP before the process group. Otherwise DDP's reducer holds the group's last
    # reference, and freeing it later (when this frame is cleared) runs the gloo group's
    # destructor with the GIL held while a gloo worker may need the GIL to free its last
    # finished work: an occasional hang at exit in torch itself, with or without tba.
    del model, opt
    gc.collect()
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
