"""DeepSpeed with tba: the "activation_offload" section of ds_config.json, and one changed line
(`tba_ds.initialize` in place of `deepspeed.initialize`).

    python examples/deepspeed_train.py                  # one CPU process, about 10 s
    deepspeed examples/deepspeed_train.py --deepspeed_config examples/ds_config.json
    TBA_ENABLED=0 python examples/deepspeed_train.py    # off, ds_config untouched

Spill files go under {nvme_path}/activation_offload/rank{r}. DeepSpeed's "aio" block sets tba's
I/O depth and threads. Unknown keys in the section are an error that names the closest key.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import tba.integrations.deepspeed as tba_ds
from tba.testing import GPT, GPTConfig, strided_batches

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_setup() -> None:
    """Single-process CPU run without a launcher (the deepspeed launcher sets these)."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce kernel at start-up (tens of
    # seconds of C++); only inference_all_reduce uses it, so this CPU example skips the build.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deepspeed_config", default=os.path.join(HERE, "ds_config.json"))
    p.add_argument("--nvme-path", help="overrides activation_offload.nvme_path of the config")
    p.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    p.add_argument("--steps", type=int, default=16, help="micro-steps")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        cpu_setup()
    import deepspeed

    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    if args.nvme_path:
        ds_config.setdefault("activation_offload", {})["nvme_path"] = args.nvme_path
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else None)

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, seq=args.seq, hidden=args.hidden, heads=4, layers=args.layers)
    model = GPT(cfg)
    # The one line: deepspeed.initialize, then the engine's forward runs under the offloader.
    engine, _, _, _ = tba_ds.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    micro = engine.train_micro_batch_size_per_gpu()
    losses = []
    for x, y in strided_batches(cfg.vocab, cfg.seq, micro, args.steps, seed=engine.global_rank):
        loss = engine(x, y)
        engine.backward(loss)  # gradient accumulation: DeepSpeed steps every 2nd call
        engine.step()
        losses.append(loss.item())
        print(
            f"micro-step {len(losses):3d}  optimizer steps {engine.global_steps:3d}  "
            f"loss {losses[-1]:.4f}"
        )

    off = tba_ds.offloader_of(engine)
    if off is not None:
        off.synchronize()  # writes still in flight count as offloaded once they complete
    stats = off.stats() if off is not None else {}
    summary = {
        "losses": losses,
        "offload": off is not None,
        "spill_path": off.backend.spill_path if off is not None else None,
        "io_depth": off.config.io_depth if off is not None else None,
        "bytes_offloaded": stats.get("bytes_offloaded", 0),
        "bytes_reloaded": stats.get("bytes_reloaded", 0),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
