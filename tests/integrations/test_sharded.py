"""DeepSpeed ZeRO stage 3 and FSDP2 (``fully_shard``), 2 ranks, gloo, CPU: tba offloads on each
rank, and losses and each rank's parameter shards stay bit-identical to no offload."""

from __future__ import annotations

import json
import os

import pytest

from .test_ddp import ROOT, torchrun

pytestmark = pytest.mark.integration


@pytest.mark.slow
def test_zero3_and_fsdp2_offload_per_rank_and_stay_exact(tmp_path):
    worker = os.path.join(ROOT, "tests", "integrations", "shard_worker.py")
    proc = torchrun(
        worker, str(tmp_path), str(tmp_path / "spill"), "zero3", "fsdp2",
        env={"DS_ACCELERATOR": "cpu"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for mode in ("zero3", "fsdp2"):
        got = [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)]
        for r, out in enumerate(got):
            where = f"{mode}, rank {r}"
            assert out["losses"] == out["ref_losses"] and len(out["losses"]) == 3, where
            assert out["params_equal"] and out["shard_numel"] > 0, where
            # offload happened on this rank, and what backward needed came back from disk (or
            # from staging, when the read-ahead wanted it while its write still ran)
            assert out["bytes_offloaded"] > 0 < out["bytes_reloaded"] + out["forwarded"], where
            # the saved activations are plain tensors (FSDP2 computes with unsharded plain
            # parameters), and a DTensor would be offloaded through its local shard: nothing
            # stays behind as "unsupported" or as a kept "subclass"
            kept = out.get("kept_reasons", {})
            assert "unsupported" not in kept and "subclass" not in kept, where
        assert got[0]["losses"] != got[1]["losses"]  # different data per rank
