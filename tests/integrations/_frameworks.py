"""Test-only set-up to run the real frameworks on a CPU-only machine, in the pytest process.

Each shim below is the narrowest change that lets a framework's own code run here; none
replaces the framework's computation.
"""

from __future__ import annotations

import contextlib
import socket

import torch
import torch.distributed as dist

from tba.config import RECOMPUTED
from tba.testing import megatron_on_cpu


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world_of_one(tmp_path) -> None:
    """A gloo process group of one rank (DeepSpeed and megatron-core need one)."""
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path}/pg-store", rank=0, world_size=1
        )


def deepspeed_cpu() -> None:
    """DeepSpeed on the CPU without a 40-80 s C++ build.

    DeepSpeed's CPU communication backend JIT-compiles a shared-memory all-reduce kernel
    (``deepspeed_shm_comm``) when it starts. Only ``inference_all_reduce`` uses it; training
    collectives go through torch.distributed (gloo here) either way. Marking it incompatible
    makes DeepSpeed skip the build, as it does on platforms where the kernel cannot build.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


@contextlib.contextmanager
def megatron_recompute_on_cpu():
    """What megatron-core needs on the CPU when a layer is recomputed in backward: its own
    ``recompute_granularity`` or tba's ``TBA_POLICY=recompute``.

    - the recompute runs inside autograd's backward, where the ``device="cuda"`` factory shim of
      :func:`tba.testing.megatron_on_cpu` (a TorchFunctionMode) is not active, and the default
      causal mask is built with ``device="cuda"``: built on the CPU here, the same mask;
    - its checkpoint (``tensor_parallel.checkpoint``) stashes and restores the CUDA RNG state
      beside the CPU one: nothing to stash without CUDA (the CPU state, which dropout draws from
      here, is still stashed and restored by megatron-core).
    """
    import torch
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom

    saved = (
        fused_softmax.get_default_causal_mask,
        mrandom._get_cuda_rng_state,
        mrandom._set_cuda_rng_state,
    )
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(
        torch.ones(sq, sq), diagonal=1
    ).bool()
    mrandom._get_cuda_rng_state = lambda *a, **k: None
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    try:
        yield
    finally:
        (
            fused_softmax.get_default_causal_mask,
            mrandom._get_cuda_rng_state,
            mrandom._set_cuda_rng_state,
        ) = saved


@contextlib.contextmanager
def megatron_cpu(tmp_path):
    """megatron-core (TP=1, PP=1) in this process on the CPU, with the shims of
    :func:`tba.testing.megatron_on_cpu` and :func:`megatron_recompute_on_cpu`."""
    from megatron.core import parallel_state

    init_world_of_one(tmp_path)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        with megatron_on_cpu(), megatron_recompute_on_cpu():
            yield
    finally:
        parallel_state.destroy_model_parallel()


# -- block policies (NOTE [Block policy] in tba/datapath/blocks/recompute.py) ----------------------
# Alternate blocks, as TBA_BLOCK_POLICY / Config(block_policy=...) force them; a model with fewer
# blocks takes the first ones, and with keep_last 0 a block not named is offloaded.
MIXED = ("recompute", "offload", "selective", "offload")
POLICY_CONFIG = {  # Config / ds_config fields
    "recompute": {"policy": "recompute"},
    "auto": {"policy": "auto"},
    "mixed": {"block_policy": ",".join(MIXED)},
}
POLICY_ENV = {  # the same, as TBA_* variables
    "recompute": {"TBA_POLICY": "recompute"},
    "auto": {"TBA_POLICY": "auto"},
    "mixed": {"TBA_BLOCK_POLICY": ",".join(MIXED)},
}


def policy_problems(st: dict, policy: str, blocks: int) -> list[str]:
    """What is wrong with a step's ``stats()`` after training under ``policy`` (a key of
    POLICY_CONFIG) on a model of ``blocks`` blocks: the blocks ran as the policy says (for auto:
    as a decision made after a measured step says, whatever it chose), and no spill extent is
    left on disk. Empty when all is well; a list so that a worker can report it."""
    actions, rec = st["group_policy"], st["recomputed_groups"]
    bad = []
    if len(actions) != blocks:
        bad.append(f"group_policy {actions} does not name the {blocks} blocks")
    if policy == "recompute" and (set(actions) != {"recompute"} or rec != blocks):
        bad.append(f"recompute: group_policy {actions}, recomputed_groups {rec}")
    recomputed = len([a for a in actions if a in RECOMPUTED])
    if policy == "mixed" and (actions != list(MIXED[:blocks]) or rec != recomputed):
        bad.append(f"mixed: group_policy {actions}, recomputed_groups {rec}")
    if policy == "auto":
        decision = st["policy_decision"]
        if decision.get("actions") != actions or "step" not in decision:
            bad.append(f"auto: no decision ran this step's blocks: {decision}, ran {actions}")
        if rec != recomputed:
            bad.append(f"auto: recomputed_groups {rec} for {actions}")
    if st["disk_bytes_in_use"] != 0:
        bad.append(f"{st['disk_bytes_in_use']} bytes still on disk after training")
    return bad


def bf16_step(model, ids, off=None):
    """One forward and backward of an HF causal LM under CPU bf16 autocast, inside ``off``'s
    step when given (its writes waited for); the loss and the trainable parameters' gradients."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if off is None:
            loss = model(input_ids=ids, labels=ids).loss
        else:
            with off.step(model):
                loss = model(input_ids=ids, labels=ids).loss
            off.synchronize()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads
