"""NOTE [DTensor]: DTensors saved for backward are offloaded through their local shard and
rebuilt with the same mesh and placements (a real 2-rank gloo mesh, torchrun); any other tensor
subclass is kept, with one warning and kept_reasons["subclass"]."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import torch

from ..conftest import step_ctx
from ..integrations.test_ddp import torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.integration
def test_dtensor_activations_offloaded_on_a_two_rank_mesh_bit_exact(tmp_path):
    worker = os.path.join(ROOT, "tests", "datapath", "dtensor_worker.py")
    proc = torchrun(worker, str(tmp_path), str(tmp_path / "spill"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, out in enumerate(got):
        for kind in ("tp", "module"):
            res = out[kind]
            assert res["losses_equal"] and res["grads_equal"], (r, kind, res)
            assert res["bytes_offloaded"] > 0 and res["bytes_reloaded"] > 0, (r, kind, res)
            assert not {"subclass", "unsupported"} & set(res["kept_reasons"]), (r, kind, res)
        # sharded activations (tensor parallel) and batch-sharded ones came back as DTensors
        assert ["S(1)"] in out["tp"]["rebuilt"], out["tp"]["rebuilt"]
        assert ["S(0)"] in out["module"]["rebuilt"], out["module"]["rebuilt"]
    # a real all-reduce: each rank's half of the batch gives the same full loss
    assert got[0]["module"]["losses"] == got[1]["module"]["losses"]


class Tagged(torch.Tensor):
    """A trivial subclass, standing for Float8Tensor and the like."""


def test_other_subclasses_are_kept_with_one_warning(make_offloader, caplog):
    xs = [torch.randn(4096).as_subclass(Tagged) for _ in range(3)]

    def run(off):
        w = torch.ones(4096, requires_grad=True)
        with caplog.at_level(logging.WARNING, logger="tba"), step_ctx(off):
            loss = sum((x * w).sum() for x in xs)  # saves each x, a Tagged
        loss.backward()
        return w.grad

    want = run(None)
    off = make_offloader()
    assert torch.equal(run(off), want)
    st = off.stats()
    assert st["kept_reasons"].get("subclass") == 3 and "unsupported" not in st["kept_reasons"]
    warned = [r for r in caplog.records if "Tagged" in r.getMessage()]
    assert len(warned) == 1 and "kept_reasons']['subclass']" in warned[0].getMessage()
    assert f"{__name__}.Tagged" in warned[0].getMessage()


def test_no_dtensor_module_is_imported_by_tba():
    import subprocess

    code = "import tba, sys; print('torch.distributed.tensor' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert out.stdout.strip() == "False", out.stderr
