"""megatron-core parallelism on the CPU with gloo (2 processes), through megatron-core's own
``get_forward_backward_func()``: pipeline parallel 2 (1F1B), virtual pipeline (2 model chunks
per stage, interleaved), and tensor parallel 2 with sequence parallel, each bit-identical to
the same run without tba. The CPU shims are :func:`tba.testing.megatron_on_cpu`."""

from __future__ import annotations

import json
import os

import pytest

from .test_ddp import ROOT, torchrun

pytestmark = pytest.mark.integration


@pytest.mark.slow
def test_pipeline_virtual_pipeline_and_tensor_sequence_parallel_exact(tmp_path):
    worker = os.path.join(ROOT, "tests", "integrations", "megatron_worker.py")
    proc = torchrun(worker, str(tmp_path), str(tmp_path / "spill"), "pp2", "vpp", "tp2sp")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # mode: (tba steps per rank: micro-batches x chunks x 2 iterations, loss-holding ranks)
    expect = {"pp2": (8, [1]), "vpp": (16, [1]), "tp2sp": (4, [0, 1])}
    for mode, (steps, last) in expect.items():
        for rank in (0, 1):
            out = json.loads((tmp_path / f"{mode}-rank{rank}.json").read_text())
            where = f"{mode}, rank {rank}"
            assert out["grads_equal"], f"{where}: gradients differ from no offload"
            assert out["losses"] == out["ref_losses"], where
            assert len(out["losses"]) == (
                steps // (2 if mode == "vpp" else 1) if rank in last else 0
            )
            assert out["steps"] == steps, where  # each micro-batch's forward (per chunk) a step
            assert out["bytes_offloaded"] > 0, where
            # groups come from each model chunk's own blocks, never byte windows
            assert out["block_groups"], where
            assert out["grouped_models"] == (2 if mode == "vpp" else 1), where
        reloaded = [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)]
        assert sum(o["bytes_reloaded"] for o in reloaded) > 0, mode
