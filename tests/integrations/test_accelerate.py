"""examples/accelerate_loop.py: a real accelerate.Accelerator loop (prepare, accumulate,
accelerator.backward) with tba.integrations.wrap, against the same loop without tba."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def example(name: str):
    path = os.path.join(ROOT, "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TINY = {"steps": 4, "batch": 2, "seq": 32, "hidden": 32, "layers": 3, "accumulate": 2}


def test_accelerate_loop_identical(tmp_path):
    from tba import Config, Offloader

    loop = example("accelerate_loop")
    ref_losses, ref_model = loop.train(**TINY, offloader=None)
    off = Offloader(Config(spill_dir=str(tmp_path / "spill"), min_offload_bytes=1, keep_last=0))
    try:
        losses, model = loop.train(**TINY, offloader=off)
        off.synchronize()
        st = off.stats()
    finally:
        off.close()
    assert len(losses) == TINY["steps"] and losses == ref_losses  # exact floats
    ref = dict(ref_model.named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in model.named_parameters())
    assert st["step"] == TINY["steps"]  # one tba step per forward, accumulation 2 included
    assert st["bytes_offloaded"] > 0 and st["peak_disk_bytes"] > 0
