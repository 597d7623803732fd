"""One rank of the ZeRO-3 and FSDP2 tests (torchrun, 2 processes, gloo, CPU).

``zero3``: DeepSpeed ZeRO stage 3, first with ``deepspeed.initialize``, then with
``tba.integrations.deepspeed.initialize``. ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on
each block and the model, first alone, then with ``tba.integrations.wrap``. Each rank gets its own
data. Every forward is followed by ``off.synchronize()``, so backward reads from disk. Writes
``<mode>-rank<r>.json``: both runs' losses (exact hex floats), whether this rank's parameter
shards are bit-identical after training, and tba's counters summed over the steps.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tba.testing import GPT, GPTConfig, warm_cpu_math  # noqa: E402

CFG = GPTConfig(vocab=64, seq=32, hidden=64, heads=4, layers=2)
STEPS = 3
KEYS = ("bytes_offloaded", "bytes_reloaded", "forwarded", "tensors_offloaded", "tensors_kept")
KEYS += ("saved_bytes",)


def batches(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = torch.randint(0, CFG.vocab, (2, CFG.seq), generator=g)
        yield x, x


def local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard: a DTensor's local tensor, else the tensor (ZeRO-3's ds_tensor)."""
    p = getattr(p, "ds_tensor", p)
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


def record(totals: dict, st: dict) -> None:
    for k in KEYS:
        totals[k] = totals.get(k, 0) + st[k]
    for reason, n in st["kept_reasons"].items():
        totals.setdefault("kept_reasons", {})
        totals["kept_reasons"][reason] = totals["kept_reasons"].get(reason, 0) + n


def zero3(rank: int, spill: str, use_tba: bool, totals: dict):
    import deepspeed

    import tba.integrations.deepspeed as tba_ds

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }
    if use_tba:
        config["activation_offload"] = {"nvme_path": spill, "min_offload_bytes": 1, "keep_last": 0}
    torch.manual_seed(0)
    model = GPT(CFG)
    init = tba_ds.initialize if use_tba else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=config)
    off = tba_ds.offloader_of(engine)
    losses = []
    for x, y in batches(rank):
        loss = engine(x, y)
        if off is not None:
            off.synchronize()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss).hex())
        if off is not None:
            record(totals, off.stats())
    params = [local(p) for p in engine.module.parameters()]
    if use_tba:
        tba_ds.disable(engine)
    return losses, params


def fsdp2(rank: int, spill: str, use_tba: bool, totals: dict):
    from torch.distributed.fsdp import fully_shard

    import tba
    import tba.integrations

    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    off = None
    if use_tba:
        off = tba.Offloader(tba.Config(spill_dir=spill, min_offload_bytes=1, keep_last=0))
        tba.integrations.wrap(model, off)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches(rank):
        loss = model(x, y)
        if off is not None:
            off.synchronize()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss).hex())
        if off is not None:
            record(totals, off.stats())
    params = [local(p) for p in model.parameters()]
    if off is not None:
        off.close()
    return losses, params


def main() -> None:
    warm_cpu_math()  # NOTE [First-call math]
    out_dir, spill = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    import deepspeed

    from tests.integrations._frameworks import deepspeed_cpu

    deepspeed_cpu()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    for mode in sys.argv[3:]:
        run = {"zero3": zero3, "fsdp2": fsdp2}[mode]
        ref_losses, ref_params = run(rank, spill, False, {})
        totals: dict = {}
        losses, params = run(rank, spill, True, totals)
        out = {
            "rank": rank,
            "ref_losses": ref_losses,
            "losses": losses,
            "params_equal": len(params) == len(ref_params) > 0
            and all(torch.equal(a, b) for a, b in zip(params, ref_params)),
            "shard_numel": sum(p.numel() for p in params),
            **totals,
        }
        with open(os.path.join(out_dir, f"{mode}-rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
