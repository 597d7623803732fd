"""tba.integrations.hf: a real transformers GPT-2 (random init from a small config, no download)
trained with Trainer on the CPU, with and without OffloadCallback."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 12, seq: int = 32, vocab: int = 128):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _train(tmp_path, callbacks, steps: int = 3, **more_args):
    """``more_args``: more TrainingArguments, e.g. the user's own gradient checkpointing."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=128,
        n_positions=32,
        n_embd=64,
        n_layer=3,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )  # dropout on (0.1): the masks are saved and offloaded too
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **more_args,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = [p.detach().clone() for p in model.parameters()]
    return losses, params, model


def test_trainer_identical_losses_and_weights(tmp_path):
    from tba.config import Config
    from tba.integrations.hf import OffloadCallback

    ref_losses, ref_params, _ = _train(tmp_path, [])
    cb = OffloadCallback(
        config=Config(spill_dir=str(tmp_path / "spill"), min_offload_bytes=1, keep_last=0)
    )
    losses, params, model = _train(tmp_path, [cb])
    st = cb.last_stats
    # written to disk; how much comes back from disk rather than from staging (writes still in
    # flight when backward starts) depends on timing with a model this small
    assert st["bytes_offloaded"] > 0 and st["peak_disk_bytes"] > 0
    assert len(losses) == 3 and losses == ref_losses  # exact floats
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert "forward" not in model.__dict__  # unwrapped after training
    assert cb.offloader.closed


def test_env_only_and_kill_switch(tmp_path, monkeypatch):
    from tba.integrations.hf import OffloadCallback

    monkeypatch.setenv("TBA_ENABLED", "1")
    monkeypatch.setenv("TBA_SPILL_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("TBA_MIN_OFFLOAD_BYTES", "1")
    cb = OffloadCallback()
    _train(tmp_path, [cb], steps=1)
    assert cb.last_stats["bytes_offloaded"] > 0
    assert cb.offloader.config.spill_dir == str(tmp_path / "env")
    monkeypatch.setenv("TBA_ENABLED", "0")
    cb = OffloadCallback()
    _train(tmp_path, [cb], steps=1)
    assert cb.offloader is None and cb.last_stats is None


# -- block policies (NOTE [Block policy] in tba/datapath/blocks/recompute.py) ----------------------
def _policy_callback(tmp_path, **policy):
    from tba.config import Config
    from tba.integrations.hf import OffloadCallback

    cfg = Config(spill_dir=str(tmp_path / "spill"), min_offload_bytes=1, keep_last=0, **policy)
    return OffloadCallback(config=cfg)


@pytest.mark.parametrize("policy", ["recompute", "auto", "mixed"])
def test_trainer_exact_under_block_policies(tmp_path, policy):
    """Config(policy=recompute / auto) and Config(block_policy=...) alternating recompute and
    offload, through Trainer (gradient accumulation 2, dropout on): the logged losses and the
    weights after two optimizer steps are bit-identical to Trainer without tba; the GPT-2 blocks
    ran as the policy says."""
    from ._frameworks import POLICY_CONFIG, policy_problems

    ref_losses, ref_params, _ = _train(tmp_path, [], steps=2)
    cb = _policy_callback(tmp_path, **POLICY_CONFIG[policy])
    losses, params, model = _train(tmp_path, [cb], steps=2)
    assert policy_problems(cb.last_stats, policy, 3) == []
    assert len(losses) == 2 and losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert "forward" not in model.__dict__ and cb.offloader.closed


class NotLeftAsUser(AssertionError):
    """The user's checkpointed blocks are not recorded as ``user``."""


@pytest.mark.parametrize("reentrant", [False, True], ids=["default", "reentrant"])
def test_recompute_leaves_gradient_checkpointing_to_the_user(tmp_path, reentrant):
    """Trainer's gradient_checkpointing=True (gradient_checkpointing_enable) with
    TBA_POLICY=recompute: exact (asserted first; a difference fails this test outright), and
    the user's checkpointed layers left as they are (``user``)."""
    gc = {"gradient_checkpointing": True}
    if reentrant:
        gc["gradient_checkpointing_kwargs"] = {"use_reentrant": True}
    ref_losses, ref_params, _ = _train(tmp_path, [], steps=2, **gc)
    cb = _policy_callback(tmp_path, policy="recompute")
    losses, params, _ = _train(tmp_path, [cb], steps=2, **gc)
    st = cb.last_stats
    assert len(losses) == 2 and losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert st["disk_bytes_in_use"] == 0
    if st["group_policy"] != ["user"] * 3 or st["recomputed_groups"] != 0:
        raise NotLeftAsUser(f"{st['group_policy']}, recomputed_groups {st['recomputed_groups']}")
