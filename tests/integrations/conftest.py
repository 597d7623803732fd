"""Integration tests: real DeepSpeed, megatron-core, transformers and torchrun, on the CPU."""

from __future__ import annotations

import os

import pytest

import tba


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No TBA_* variable leaks in from the caller; the process-wide Offloader does not leak out."""
    for key in list(os.environ):
        if key.startswith("TBA_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield
    default = tba._default
    if default is not None and not default.closed:
        default.close()


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """A gloo process group of one rank for the module's tests; destroyed afterwards."""
    import torch.distributed as dist

    from ._frameworks import init_world_of_one

    made = not dist.is_initialized()
    init_world_of_one(tmp_path_factory.mktemp("dist"))
    yield
    if made and dist.is_initialized():
        dist.destroy_process_group()
