"""Test-only set-up to run the real frameworks on a CPU-only machine, in the pytest process.

Each shim below is the narrowest change that lets a framework's own code run here; none
replaces the framework's computation.
"""

from __future__ import annotations

import contextlib
import socket

import torch.distributed as dist

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
def megatron_cpu(tmp_path):
    """megatron-core (TP=1, PP=1) in this process on the CPU, with the shims of
    :func:`tba.testing.megatron_on_cpu`."""
    from megatron.core import parallel_state

    init_world_of_one(tmp_path)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        with megatron_on_cpu():
            yield
    finally:
        parallel_state.destroy_model_parallel()
