"""Shared fixtures: offloaders on a per-test spill dir, isolated from the caller's TBA_* env."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import tba
from tba.testing import warm_cpu_math


def no_cuda_reason() -> str:
    """Why ``gpu``-marked tests skip here, for the GPU check's dry run (docs/gpu.md)."""
    if torch.version.cuda is None:
        return f"needs a CUDA device: torch {torch.__version__} is a CPU build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"needs a CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none "
        f"(no GPU or driver{'' if visible is None else f', CUDA_VISIBLE_DEVICES={visible!r}'})"
    )


def pytest_configure(config):
    warm_cpu_math()  # before any bit-exact reference (NOTE [First-call math])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=no_cuda_reason())
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _torch_global_modes():
    """Give every test torch's global modes as it found them: a framework that turns on
    deterministic algorithms (Lightning's ``deterministic=True``) would otherwise leave torch
    filling every new tensor for the rest of the run, and a forked child hangs in that fill."""
    det = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    threads = torch.get_num_threads()
    yield
    if torch.are_deterministic_algorithms_enabled() != det:
        torch.use_deterministic_algorithms(det, warn_only=warn_only)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _cpu_tests_see_a_cpu_host(request, monkeypatch):
    """A test not marked ``gpu`` runs as on a machine without CUDA, on a GPU host too (the GPU
    check runs the CPU suite there): no host tier wraps its disk backend, so a test that swaps
    the disk's syscalls (``off.backend._preadv``) reaches them. Tests of the tier say
    ``cuda_present`` themselves (tests/datapath/test_host_tier.py's ``gpu_host``)."""
    if "gpu" not in request.keywords:
        from tba.datapath import offloader

        monkeypatch.setattr(offloader, "cuda_present", lambda: False)


@pytest.fixture
def spill_dir(tmp_path):
    return str(tmp_path / "spill")


@pytest.fixture(params=["coalesce", "single"])
def make_offloader(request, spill_dir):
    """Build Offloaders with test-sized defaults; all are closed at teardown.

    Every test runs twice: with small tensors coalesced into batches (the default), and with
    coalescing off, so each small tensor takes the stand-alone path (its own block and extent).
    """
    made: list[tba.Offloader] = []

    def make(**kw) -> tba.Offloader:
        if request.param == "single":
            kw.setdefault("coalesce_bytes", 0)
        kw.setdefault("spill_dir", spill_dir)
        kw.setdefault("min_offload_bytes", 1)
        kw.setdefault("staging_bytes", "32MiB")
        kw.setdefault("prefetch_bytes", "8MiB")
        kw.setdefault("slab_bytes", "16MiB")
        kw.setdefault("min_free_bytes", 0)
        kw.setdefault("keep_last", 0)
        off = tba.Offloader(tba.Config(environ={}, **kw))
        made.append(off)
        return off

    yield make
    for off in made:
        off.close()


def step_ctx(off, model=None):
    return off.step(model) if off is not None else contextlib.nullcontext()
