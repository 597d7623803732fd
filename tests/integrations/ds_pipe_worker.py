"""One stage of the 2-stage DeepSpeed pipeline test (torchrun, 2 processes, gloo).

Trains a ``PipelineModule`` twice with ``train_batch`` (1F1B, 4 micro-batches per step, 4
steps): with ``deepspeed.initialize``, then with ``tba.integrations.deepspeed.initialize``.
Each ForwardPass is followed by ``off.synchronize()`` (added to the engine's instruction map
after tba's own entry), so that backward reads from disk. Writes ``stage<r>.json``: both runs'
losses (exact hex floats), whether the stage's weights are bit-identical, and tba's counters of
every micro-batch step (each forward is one tba step).
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tba.testing import warm_cpu_math  # noqa: E402
from tests.integrations._frameworks import deepspeed_cpu  # noqa: E402

H, ROWS, MICRO, STEPS = 64, 256, 4, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(H, 4 * H)
        self.down = nn.Linear(4 * H, H)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def batches(seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(ROWS, H, generator=g), torch.randn(ROWS, H, generator=g)


def train(init, ds_config: dict, steps: list | None = None) -> tuple[list, list, object]:
    from deepspeed.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    model = PipelineModule(
        layers=[LayerSpec(Block) for _ in range(8)],
        num_stages=2,
        loss_fn=nn.functional.mse_loss,
        partition_method="uniform",
        activation_checkpoint_interval=0,
    )
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=ds_config)
    if steps is not None:  # after each forward: wait for the writes, remember the step
        from deepspeed.runtime.pipe import schedule

        import tba.integrations.deepspeed as tba_ds

        table = engine.__dict__["_INSTRUCTION_MAP"]  # tba's copy (NOTE [Pipeline engine])
        off, tba_forward = tba_ds.offloader_of(engine), table[schedule.ForwardPass]

        def forward_then_sync(self, *args, **kwargs):
            tba_forward(self, *args, **kwargs)
            off.synchronize()
            steps.append(off._last)

        table[schedule.ForwardPass] = forward_then_sync
    data = batches(1)
    losses = [float(engine.train_batch(data)).hex() for _ in range(STEPS)]
    return losses, [p.detach().clone() for p in engine.module.parameters()], engine


def main() -> None:
    warm_cpu_math()  # NOTE [First-call math]
    out_dir, spill = sys.argv[1], sys.argv[2]
    import deepspeed
    from deepspeed.runtime.pipe import schedule

    import tba.integrations.deepspeed as tba_ds

    deepspeed_cpu()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.set_num_threads(1)
    base = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**6,
    }
    ref_losses, ref_params, _ = train(deepspeed.initialize, base)
    section = {
        "nvme_path": spill,
        "min_offload_bytes": 1,
        "keep_last": 0,
        "prefetch_bytes": "1MiB",  # less than one micro-batch saves: plan order matters
    }
    states: list = []
    losses, params, engine = train(
        tba_ds.initialize, {**base, "activation_offload": section}, states
    )
    replaced = schedule.ForwardPass in engine.__dict__.get("_INSTRUCTION_MAP", {})
    tba_ds.disable(engine)
    steps = [st.snapshot(0) for st in states]
    out = {
        "rank": rank,
        "ref_losses": ref_losses,
        "losses": losses,
        "params_equal": len(params) == len(ref_params)
        and all(torch.equal(a, b) for a, b in zip(params, ref_params)),
        "forward_pass_replaced": replaced,
        "steps": [
            {
                k: st[k]
                for k in ("bytes_offloaded", "bytes_reloaded", "forwarded", "sync_loads", "packs")
            }
            for st in steps
        ],
    }
    with open(os.path.join(out_dir, f"stage{rank}.json"), "w") as f:
        json.dump(out, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
