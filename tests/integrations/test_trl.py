"""examples/trl_sft_lora.py: a real trl.SFTTrainer with a PEFT LoRA adapter on a small random
Llama, with and without tba's OffloadCallback."""

from __future__ import annotations

import pytest
import torch

from .test_accelerate import example

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

for _pkg in ("trl", "peft", "datasets"):
    pytest.importorskip(_pkg)

TINY = {"steps": 2, "batch": 2, "hidden": 32, "layers": 3}


def _lora(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_sft_lora_identical(tmp_path):
    from tba.config import Config
    from tba.integrations.hf import OffloadCallback

    sft = example("trl_sft_lora")
    ref_losses, ref_model = sft.train(**TINY, output_dir=str(tmp_path / "ref"))
    cfg = Config(spill_dir=str(tmp_path / "spill"), min_offload_bytes=1, keep_last=0)
    cb = OffloadCallback(config=cfg)
    losses, model = sft.train(**TINY, callbacks=[cb], output_dir=str(tmp_path / "tba"))
    st = cb.last_stats
    ref, got = _lora(ref_model), _lora(model)
    assert len(ref) == 4 * TINY["layers"]  # A and B of q_proj and v_proj in every layer
    assert len(losses) == TINY["steps"] and losses == ref_losses  # exact floats
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref)
    assert any(not torch.equal(got[n], 0 * got[n]) for n in got if "lora_B" in n)  # it trained
    assert st["step"] == 2 * TINY["steps"]  # one tba step per micro-batch (accumulation 2)
    assert st["bytes_offloaded"] > 0 and st["peak_disk_bytes"] > 0
    # SFTConfig turns gradient checkpointing on by default: tba leaves those layers to it
    assert st["user_checkpointed_groups"] == TINY["layers"] and st["recomputed_groups"] == 0
