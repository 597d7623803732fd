"""Megatron with tba: the --tba-* flags and a wrapped forward_step, on a megatron-core GPTModel.

    python examples/megatron_gpt.py --tba-activation-offload --tba-spill-dir /var/tmp/tba  # ~10 s
    python examples/megatron_gpt.py --tba-activation-offload --tba-keep-last 1 --help

In Megatron-LM the same two pieces go to pretrain():

    pretrain(datasets_provider, model_provider, ModelType.encoder_or_decoder,
             wrap_forward_step(forward_step), extra_args_provider=add_args)

This script has no Megatron-LM (megatron-core alone ships no pretrain()), so it parses the flags
itself and drives megatron-core's own schedule, get_forward_backward_func(), with TP=1, PP=1 and
2 micro-batches per step. It runs on the CPU (gloo), with three CPU-only shims marked below.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist

from tba.integrations.megatron import add_args, offloader, wrap_forward_step
from tba.testing import CudaFactoriesOnCpu, MegatronNoBuffer, strided_batches


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--num-micro-batches", type=int, default=2)
    p.add_argument("--train-iters", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=256)
    return add_args(p).parse_args(argv)  # what Megatron-LM does with extra_args_provider


def setup_cpu() -> contextlib.AbstractContextManager:
    from megatron.core import parallel_state, tensor_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    parallel_state._GLOBAL_MEMORY_BUFFER = MegatronNoBuffer()  # CPU shim 1: it allocates on a GPU
    # CPU shim 2: no CUDA RNG states to fork
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    return CudaFactoriesOnCpu()  # CPU shim 3: the schedule allocates with device="cuda"


def build_model(args: argparse.Namespace):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        use_cpu_initialization=True,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
    )


def forward_step(data_iterator, model):
    """An ordinary Megatron forward_step: one micro-batch through the model."""
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, None, labels=labels)

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach().clone()}  # the schedule scales loss in place

    return output, loss_func


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with setup_cpu():
        torch.manual_seed(0)
        model = build_model(args)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        step_func = wrap_forward_step(forward_step, args=args)  # <- tba
        data = strided_batches(args.vocab_size, args.seq_length, args.micro_batch_size)
        losses = []
        for it in range(args.train_iters):
            out = get_forward_backward_func()(
                forward_step_func=step_func,
                data_iterator=data,
                model=[model],
                num_microbatches=args.num_micro_batches,
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
            )
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(sum(float(d["lm loss"]) for d in out) / len(out))
            print(f"iteration {it + 1:3d}  lm loss {losses[-1]:.4f}")
    off = offloader(step_func)
    if off is not None:
        off.synchronize()  # writes still in flight count as offloaded once they complete
    stats = off.stats() if off is not None else {}
    summary = {
        "losses": losses,
        "offload": off is not None,
        "spill_path": off.backend.spill_path if off is not None else None,
        "keep_last": off.config.keep_last if off is not None else None,
        "bytes_offloaded": stats.get("bytes_offloaded", 0),
        "bytes_reloaded": stats.get("bytes_reloaded", 0),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
