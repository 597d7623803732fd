"""One rank of the 2-process DTensor test (run by torchrun from tests/datapath/test_dtensor.py).

A tensor-parallel MLP (``parallelize_module``: the first Linear column-wise, the second
row-wise, so the saved activations are DTensors sharded on the hidden dimension) and a
``distribute_module`` Linear fed a ``distribute_tensor`` input, each trained for two steps
without tba and with it, on a 2-rank gloo mesh. Writes this rank's results as JSON.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import (
    DTensor,
    Shard,
    distribute_module,
    distribute_tensor,
    init_device_mesh,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import tba
from tba.datapath.capture.dtensor import DTensorHandle
from tba.testing import warm_cpu_math


class MLP(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.fc1 = nn.Linear(h, 4 * h)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def build(kind: str, mesh):
    torch.manual_seed(0)
    if kind == "tp":
        model = nn.Sequential(MLP(64), MLP(64))
        plan = {}
        for i in range(2):
            plan[f"{i}.fc1"] = ColwiseParallel()
            plan[f"{i}.fc2"] = RowwiseParallel()
        return parallelize_module(model, mesh, plan)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    return distribute_module(model, mesh)  # parameters replicated as DTensors


def batch(kind: str, step: int, mesh):
    g = torch.Generator().manual_seed(100 + step)  # the same on both ranks
    x = torch.randn(32, 64, generator=g)
    if kind == "tp":
        return x
    return distribute_tensor(x, mesh, [Shard(0)])  # each rank its half of the batch


def loss_of(out):
    if isinstance(out, DTensor):
        out = out.full_tensor()
    return out.square().mean()


def train(kind: str, mesh, off):
    model = build(kind, mesh)
    losses, grads = [], []
    for step in range(2):
        x = batch(kind, step, mesh)
        if off is None:
            loss = loss_of(model(x))
        else:
            with off.step(model):
                loss = loss_of(model(x))
                off.synchronize()  # written before backward: backward reads from disk
        del x
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    return losses, grads


def main() -> None:
    warm_cpu_math()  # NOTE [First-call math]
    out_dir, spill = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    result = {"rank": rank}
    dtensor_packs = []
    real_rebuild = DTensorHandle.rebuild

    def rebuild(self, local):
        got = real_rebuild(self, local)
        dtensor_packs.append([str(p) for p in got.placements])
        return got

    DTensorHandle.rebuild = rebuild
    for kind in ("tp", "module"):
        ref_losses, ref_grads = train(kind, mesh, None)
        cfg = tba.Config(
            environ={},
            spill_dir=spill,
            min_offload_bytes=1,
            keep_last=0,
            coalesce_bytes=0,
            staging_bytes="8MiB",
            prefetch_bytes="2MiB",
            slab_bytes="8MiB",
            min_free_bytes=0,
        )
        dtensor_packs.clear()
        with tba.Offloader(cfg) as off:
            losses, grads = train(kind, mesh, off)
            st = off.stats()
        result[kind] = {
            "losses_equal": losses == ref_losses,
            "grads_equal": all(
                torch.equal(a, b) for ga, gb in zip(grads, ref_grads) for a, b in zip(ga, gb)
            ),
            "bytes_offloaded": st["bytes_offloaded"],
            "bytes_reloaded": st["bytes_reloaded"],
            "kept_reasons": st["kept_reasons"],
            "rebuilt": dtensor_packs[:],
            "losses": losses,
        }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
