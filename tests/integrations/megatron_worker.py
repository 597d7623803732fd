"""One rank of the megatron-core parallelism tests (torchrun, 2 processes, gloo, CPU).

Modes, each trained without tba and then with ``wrap_forward_step`` (keep_last 0, every saved
tensor above 1 byte offloaded, writes awaited after each forward so that backward reads from
disk), through megatron-core's own schedule, ``get_forward_backward_func()``:

- ``pp2``: pipeline parallel 2 (1F1B), 4 micro-batches;
- ``vpp``: pipeline parallel 2 with 2 model chunks per stage (interleaved 1F1B), 4 micro-batches;
- ``tp2sp``: tensor parallel 2 with sequence parallel, 2 micro-batches.

Writes ``<mode>-rank<r>.json``: the losses this rank saw (exact hex floats), whether every
gradient of this rank's parameters is bit-identical at each iteration, tba's counters summed over
its steps, and the models (chunks) whose blocks grouped them.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tba.testing import megatron_on_cpu, warm_cpu_math  # noqa: E402

SEQ, VOCAB, MB, ITERS = 16, 64, 2, 2
MODES = {  # mode: (tp, pp, vp, micro-batches, layers)
    "pp2": (1, 2, None, 4, 4),
    "vpp": (1, 2, 2, 4, 4),
    "tp2sp": (2, 1, None, 2, 2),
}


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm in a sequence-parallel model. megatron-core's own torch norm refuses
    sequence parallel (its fused ones need apex or Transformer Engine): each rank normalises its
    own slice of the sequence, so the weights' gradients are partial sums that Megatron-LM adds up
    across the tensor-parallel group for parameters marked ``sequence_parallel``, as here."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = True


def layer_spec(sequence_parallel: bool, layers: int):
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    spec = get_gpt_layer_local_spec()
    if not sequence_parallel:
        return spec
    sub: TransformerLayerSubmodules = spec.submodules
    norms = {"input_layernorm": SequenceParallelLayerNorm}
    if sub.pre_mlp_layernorm is sub.input_layernorm:
        norms["pre_mlp_layernorm"] = SequenceParallelLayerNorm
    spec = dataclasses.replace(spec, submodules=dataclasses.replace(sub, **norms))
    return TransformerBlockSubmodules(
        layer_specs=[spec] * layers, layer_norm=SequenceParallelLayerNorm
    )


def build(mode: str) -> list:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp, pp, vp, _, layers = MODES[mode]
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        sequence_parallel=tp > 1,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=False,
    )
    chunks = []
    for v in range(vp or 1):
        vp_stage = v if vp else None
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=layer_spec(tp > 1, layers),
                vocab_size=VOCAB,
                max_sequence_length=SEQ,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=False,
                vp_stage=vp_stage,
            )
        )
    return chunks


def forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, None, labels=labels)

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def train(mode: str, step_func) -> tuple[list, list]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _, _, vp, micro, _ = MODES[mode]
    chunks = build(mode)
    g = torch.Generator().manual_seed(1)  # every rank draws the same batches
    losses, grads = [], []
    for _ in range(ITERS):
        data = [
            (
                torch.randint(0, VOCAB, (MB, SEQ), generator=g),
                torch.randint(0, VOCAB, (MB, SEQ), generator=g),
            )
            for _ in range(micro)
        ]
        iters = [iter(data) for _ in chunks] if vp else iter(data)
        out = get_forward_backward_func()(
            forward_step_func=step_func,
            data_iterator=iters,
            model=chunks,
            num_microbatches=micro,
            seq_length=SEQ,
            micro_batch_size=MB,
        )
        losses += [float(d["loss"]).hex() for d in out]
        grads.append([p.grad.clone() for c in chunks for p in c.parameters()])
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    return losses, grads


def train_with_tba(mode: str, spill: str) -> tuple[list, list, list, set]:
    """``train`` under ``wrap_forward_step``; also each tba step's state, and the models (model
    chunks) whose blocks grouped a step."""
    import tba
    from tba.integrations import megatron as tba_mg

    off = tba.Offloader(tba.Config(spill_dir=spill, min_offload_bytes=1, keep_last=0))
    wrapped = tba_mg.wrap_forward_step(forward_step, offloader=off)
    states, groups_of = [], set()

    def then_sync(data_iterator, model):
        out = wrapped(data_iterator, model)
        off.synchronize()  # writes done: backward reads from disk
        states.append(off._last)
        if off.groups.n_blocks:
            groups_of.add(id(model))
        return out

    losses, grads = train(mode, then_sync)
    off.close()
    return losses, grads, states, groups_of


def main() -> None:
    warm_cpu_math()  # NOTE [First-call math]
    from megatron.core import parallel_state as ps

    out_dir, spill = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for mode in sys.argv[3:]:
        tp, pp, vp, _, _ = MODES[mode]
        ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp)
        with megatron_on_cpu():
            ref_losses, ref_grads = train(mode, forward_step)
            losses, grads, states, groups_of = train_with_tba(mode, spill)
        ps.destroy_model_parallel()
        steps = [st.snapshot(0) for st in states]
        out = {
            "rank": rank,
            "ref_losses": ref_losses,
            "losses": losses,
            "grads_equal": len(grads) == len(ref_grads) == ITERS
            and all(
                len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))
                for a, b in zip(grads, ref_grads)
            ),
            "steps": len(steps),
            "bytes_offloaded": sum(s["bytes_offloaded"] for s in steps),
            "bytes_reloaded": sum(s["bytes_reloaded"] for s in steps),
            "sync_loads": sum(s["sync_loads"] for s in steps),
            "forwarded": sum(s["forwarded"] for s in steps),
            "kept_reasons": sorted({r for s in steps for r in s["kept_reasons"]}),
            "grouped_models": len(groups_of),
            "block_groups": all(s["groups"] > 1 for s in steps),
        }
        with open(os.path.join(out_dir, f"{mode}-rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
