"""HF Trainer with the model's own gradient checkpointing and with torch_compile=True, with and
without tba's OffloadCallback (the set-up of test_hf.py: GPT-2 from a small config, dropout on,
accumulation 2)."""

from __future__ import annotations

import logging

import pytest
import torch

from .test_hf import _train

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def _callback(tmp_path):
    from tba.config import Config
    from tba.integrations.hf import OffloadCallback

    cfg = Config(spill_dir=str(tmp_path / "spill"), min_offload_bytes=1, keep_last=0)
    return OffloadCallback(config=cfg)


@pytest.mark.parametrize("reentrant", [False, True], ids=["default", "reentrant"])
def test_gradient_checkpointing_left_to_the_model(tmp_path, caplog, reentrant):
    """gradient_checkpointing=True under the default policy: exact; the checkpointed layers
    recorded as the user's, none recomputed by tba; their inputs offloaded; said once."""
    gc = {"gradient_checkpointing": True}
    if reentrant:
        gc["gradient_checkpointing_kwargs"] = {"use_reentrant": True}
    ref_losses, ref_params, _ = _train(tmp_path, [], steps=2, **gc)
    cb = _callback(tmp_path)
    with caplog.at_level(logging.INFO, logger="tba.integrations.hf"):
        losses, params, _ = _train(tmp_path, [cb], steps=2, **gc)
    st = cb.last_stats
    assert len(losses) == 2 and losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert st["group_policy"] == ["user"] * 3 and st["user_checkpointed_groups"] == 3
    assert st["recomputed_groups"] == 0 and st["bytes_offloaded"] > 0
    said = [
        r.getMessage() for r in caplog.records if "own gradient checkpointing" in r.getMessage()
    ]
    assert len(said) == 1 and said[0].startswith("tba.integrations.hf: 3 of 3 blocks"), said


def test_no_checkpointing_says_nothing(tmp_path, caplog):
    cb = _callback(tmp_path)
    with caplog.at_level(logging.INFO, logger="tba.integrations.hf"):
        _train(tmp_path, [cb], steps=1)
    assert cb.last_stats["user_checkpointed_groups"] == 0
    assert not [r for r in caplog.records if "gradient checkpointing" in r.getMessage()]


def test_torch_compile(tmp_path):
    """torch_compile=True, with the aot_eager backend (inductor's C++ build of each graph is
    too slow for this CPU's test budget): bit-identical losses and weights; tba keeps what the
    compiled model saves, and its stats say why."""
    import torch._dynamo

    compile_args = {"torch_compile": True, "torch_compile_backend": "aot_eager"}
    torch._dynamo.reset()
    ref_losses, ref_params, _ = _train(tmp_path, [], steps=2, **compile_args)
    torch._dynamo.reset()
    cb = _callback(tmp_path)
    losses, params, _ = _train(tmp_path, [cb], steps=2, **compile_args)
    st = cb.last_stats
    assert len(losses) == 2 and losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    # Trainer compiles the whole model: one region encloses every block, so what it saves
    # stays in memory, said once, with the fix (NOTE [Compiled regions])
    assert st["step"] == 4 and st["packs"] > 0 and st["bytes_offloaded"] == 0
    assert st["kept_reasons"] == {"compiled": st["packs"]}
