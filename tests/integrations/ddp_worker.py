"""One rank of the 2-process DDP test (run by torchrun from test_ddp.py).

Trains the same model twice, under DDP (gloo): without tba, then with ``tba.integrations.wrap``.
Each rank gets its own data, so the all-reduce mixes different gradients. Writes
``rank<r>.json`` into the directory given: losses of both runs (as exact hex floats), whether the
gradients and weights are bit-identical, the rank's spill directory, the spill files this process
holds open, and what it sees of the other rank's directory.

With block policies after the directories (``recompute``, ``auto``, ``mixed``: keys of
``POLICY_CONFIG`` in _frameworks.py), trains a model with dropout instead, without tba and then
once per policy, and writes ``<policy>-rank<r>.json``: both runs' losses, whether gradients and
weights are bit-identical, and what is wrong with the last step's block actions (empty: nothing).
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
from tba.testing import GPT, GPTConfig, warm_cpu_math

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


def train(
    rank: int, off: tba.Offloader | None, out: dict | None, cfg: GPTConfig = CFG
) -> tuple[list, list, list]:
    torch.manual_seed(0)
    model = DDP(GPT(cfg))
    if off is not None:
        tba.integrations.wrap(model.module, off)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    losses, grads = [], []
    for step in range(STEPS):
        x = torch.randint(0, cfg.vocab, (2, cfg.seq), generator=g)
        loss = model(x, x)
        if off is not None:
            off.synchronize()  # writes done: backward reads what is not still alive from disk
        loss.backward()
        if off is not None and step == 0 and out is not None:
            out["spill_dir"] = off.backend.spill_path
            out["open_files"] = open_spill_files(off.config.spill_dir)
            dist.barrier()  # both ranks' directories exist now
            out["dirs_seen"] = sorted(os.listdir(off.config.spill_dir))
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, grads, [p.detach().clone() for p in model.parameters()]


def equal(a: list, b: list) -> bool:
    return len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))


def policies(rank: int, out_dir: str, spill_root: str, names: list[str]) -> None:
    """Each block policy against one run without tba, dropout on (recompute replays masks)."""
    from tests.integrations._frameworks import POLICY_CONFIG, policy_problems

    cfg = GPTConfig(**{**vars(CFG), "dropout": 0.1})
    ref_losses, ref_grads, ref_params = train(rank, None, {}, cfg)
    for name in names:
        off = tba.Offloader(
            tba.Config(
                spill_dir=spill_root, min_offload_bytes=1, keep_last=0, **POLICY_CONFIG[name]
            )
        )
        losses, grads, params = train(rank, off, None, cfg)  # no directory probes
        off.synchronize()
        problems = policy_problems(off.stats(), name, cfg.layers)
        off.close()
        out = {
            "ref_losses": [float(x).hex() for x in ref_losses],
            "losses": [float(x).hex() for x in losses],
            "grads_equal": len(grads) == len(ref_grads) == STEPS
            and all(equal(a, b) for a, b in zip(grads, ref_grads)),
            "params_equal": equal(params, ref_params),
            "problems": problems,
        }
        with open(os.path.join(out_dir, f"{name}-rank{rank}.json"), "w") as f:
            json.dump(out, f)


def main() -> None:
    warm_cpu_math()  # NOTE [First-call math]
    out_dir, spill_root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)  # two ranks on two cores
    if sys.argv[3:]:
        policies(rank, out_dir, spill_root, sys.argv[3:])
        dist.destroy_process_group()
        return
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
        forwarded=st["forwarded"],
        dirs_after_close=sorted(os.listdir(spill_root)),
    )
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
