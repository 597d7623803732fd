"""One rank of the 2-process DDP test (run by torchrun from test_ddp.py).

Trains the same model twice, under DDP (gloo): without tba, then with ``tba.integrations.wrap``.
Each rank gets its own data, so the all-reduce mixes different gradients. Writes
``rank<r>.json`` into the directory given: losses of both runs (as exact hex floats), whether the
gradients and weights are bit-identical, the rank's spill directory, the spill files this process
holds open, and what it sees of the other rank's directory.
"""

from __future__ import annotations

import json
import os
import stat
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tba
import tba.integrations
from tba.testing import GPT, GPTConfig

CFG = GPTConfig(vocab=64, seq=32, hidden=64, heads=4, layers=3)
STEPS = 3


def open_spill_files(root: str) -> list[str]:
    """Regular files this process holds open under ``root`` (nameless slabs show as
    ``<dir>/#<inode> (deleted)``)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            regular = stat.S_ISREG(os.stat(f"/proc/self/fd/{fd}").st_mode)
        except OSError:
            continue
        if regular and target.startswith(root):
            out.append(target)
    return out


def train(rank: int, off: tba.Offloader | None, out: dict) -> tuple[list, list, list]:
    torch.manual_seed(0)
    model = DDP(GPT(CFG))
    if off is not None:
        tba.integrations.wrap(model.module, off)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    losses, grads = [], []
    for step in range(STEPS):
        x = torch.randint(0, CFG.vocab, (2, CFG.seq), generator=g)
        loss = model(x, x)
        if off is not None:
            off.synchronize()  # writes done: backward reads what is not still alive from disk
        loss.backward()
        if off is not None and step == 0:
            out["spill_dir"] = off.backend.spill_path
            out["open_files"] = open_spill_files(off.config.spill_dir)
            dist.barrier()  # both ranks' directories exist now
            out["dirs_seen"] = sorted(os.listdir(off.config.spill_dir))
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, grads, [p.detach().clone() for p in model.parameters()]


def main() -> None:
    out_dir, spill_root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)  # two ranks on two cores
    ref_losses, ref_grads, ref_params = train(rank, None, {})
    off = tba.Offloader(
        tba.Config(spill_dir=spill_root, min_offload_bytes=1, keep_last=0, slab_bytes="16MiB")
    )
    out: dict = {"rank": rank, "config_rank": off.config.rank}
    losses, grads, params = train(rank, off, out)
    st = off.stats()
    off.close()
    dist.barrier()
    out.update(
        ref_losses=[float(x).hex() for x in ref_losses],
        losses=[float(x).hex() for x in losses],
        grads_equal=all(
            torch.equal(a, b) for ga, gb in zip(grads, ref_grads) for a, b in zip(ga, gb)
        ),
        params_equal=all(torch.equal(a, b) for a, b in zip(params, ref_params)),
        bytes_offloaded=st["bytes_offloaded"],
        bytes_reloaded=st["bytes_reloaded"],
        dirs_after_close=sorted(os.listdir(spill_root)),
    )
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
