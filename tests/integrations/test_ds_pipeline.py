"""DeepSpeed's PipelineEngine (2 stages, 1F1B, gloo, 2 processes) runs every micro-batch's
forward under tba on every stage (NOTE [Pipeline engine] in tba/integrations/_ds_pipeline.py),
and a pipeline engine tba cannot hook into is refused, never trained without offload."""

from __future__ import annotations

import json
import os

import pytest
import torch

import tba
from tba.integrations import _ds_pipeline

from .test_ddp import ROOT, torchrun

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.mark.slow
def test_two_stages_offload_on_every_stage_and_stay_exact(tmp_path):
    worker = os.path.join(ROOT, "tests", "integrations", "ds_pipe_worker.py")
    proc = torchrun(worker, str(tmp_path), str(tmp_path / "spill"), env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in (0, 1):
        out = json.loads((tmp_path / f"stage{stage}.json").read_text())
        assert out["forward_pass_replaced"]
        assert len(out["losses"]) == 4 and out["losses"] == out["ref_losses"], f"stage {stage}"
        assert out["params_equal"], f"stage {stage}: weights differ from no offload"
        steps = out["steps"]
        assert len(steps) == 16  # 4 optimizer steps x 4 micro-batches, one tba step each
        # back from disk, or from staging when the read-ahead wanted it while its write ran
        assert all(s["bytes_offloaded"] > 0 < s["bytes_reloaded"] + s["forwarded"] for s in steps)
        # after the first optimizer step (warm-up), backward never waits for an unissued read
        assert [s["sync_loads"] for s in steps[4:]] == [0] * 12


def _bare_engine(cls):
    """A PipelineEngine subclass instance without DeepSpeed's set-up (no process group)."""
    engine = object.__new__(cls)
    torch.nn.Module.__init__(engine)
    engine.module = torch.nn.Linear(2, 2)
    return engine


def test_a_pipeline_engine_without_the_forward_entry_is_refused(tmp_path):
    from deepspeed.runtime.pipe.engine import PipelineEngine

    class Elsewhere(PipelineEngine):
        _INSTRUCTION_MAP = {}  # a DeepSpeed that dispatches its schedule another way

    with tba.Offloader(tba.Config(spill_dir=str(tmp_path))) as off:
        engine = _bare_engine(Elsewhere)
        assert _ds_pipeline.is_pipeline_engine(engine)
        with pytest.raises(tba.UsageError, match=r"no _INSTRUCTION_MAP entry for ForwardPass"):
            _ds_pipeline.enable_pipeline(engine, off, owned=False)

        class Bypass(PipelineEngine):
            def train_batch(self, data_iter=None):
                return torch.zeros(())  # runs no ForwardPass through the map

        engine = _bare_engine(Bypass)
        _ds_pipeline.enable_pipeline(engine, off, owned=False)
        with pytest.raises(tba.UsageError, match=r"train_batch ran without calling the Forward"):
            engine.train_batch()
        assert _ds_pipeline.disable_pipeline(engine) and "train_batch" not in engine.__dict__
