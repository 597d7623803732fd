"""tba.integrations.lightning: a real lightning.Trainer on the CPU training tba's test GPT, with
and without OffloadCallback, under automatic (accumulation 1 and 2) and manual optimization."""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's advice on workers, logging
]

L = pytest.importorskip("lightning.pytorch")

BATCHES = 4  # micro-batches per fit: each is one training forward, so one tba step


def _module(manual: bool, direct: bool = True):
    from tba.testing import GPT, GPTConfig

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.gpt = GPT(GPTConfig(vocab=64, seq=16, hidden=32, heads=4, layers=3))
            self.automatic_optimization = not manual
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            # direct: the submodule itself (a step opens at its pre-hook); otherwise one level
            # deeper, which the callback cannot see
            loss = self.gpt(x, y) if direct else self.gpt.forward(x, y)
            self.losses.append(loss.item())
            if not manual:
                return loss
            opt = self.optimizers()
            self.manual_backward(loss / 2)
            if batch_idx % 2 == 1:  # accumulate two micro-batches by hand
                opt.step()
                opt.zero_grad()
            return None

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Module()


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (BATCHES * 2, 16), generator=g)
    y = torch.randint(0, 64, (BATCHES * 2, 16), generator=g)
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(ds, batch_size=2, shuffle=False)


def _fit(callbacks, manual=False, accumulate=1, direct=True):
    L.seed_everything(0, verbose=False)
    module = _module(manual, direct)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
    )
    trainer.fit(module, _data())
    params = [p.detach().clone() for p in module.parameters()]
    return module.losses, params, module


def _callback(tmp_path):
    from tba.config import Config
    from tba.integrations.lightning import OffloadCallback

    # every size offloaded, no block kept: everything is written and read back
    return OffloadCallback(
        config=Config(spill_dir=str(tmp_path / "spill"), min_offload_bytes=1, keep_last=0)
    )


@pytest.mark.parametrize(
    "manual,accumulate",
    [(False, 1), (False, 2), (True, 1)],
    ids=["automatic", "accumulate2", "manual"],
)
def test_fit_identical_losses_and_weights(tmp_path, manual, accumulate):
    ref_losses, ref_params, _ = _fit([], manual, accumulate)
    cb = _callback(tmp_path)
    losses, params, module = _fit([cb], manual, accumulate)
    st = cb.last_stats
    assert len(losses) == BATCHES and losses == ref_losses  # exact floats
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    # one tba step per training forward, whatever the accumulation (NOTE [Lightning steps])
    assert cb.steps == BATCHES and st["step"] == BATCHES
    assert st["bytes_offloaded"] > 0 and st["peak_disk_bytes"] > 0
    assert st["groups"] >= 3  # the GPT's blocks were found through the LightningModule
    assert "training_step" not in module.__dict__  # unwrapped after fit
    assert module.gpt._forward_pre_hooks == {} and cb.offloader.closed


def test_a_forward_out_of_sight_is_said(tmp_path, caplog):
    """A training_step that calls the model below its direct submodules runs without tba: the
    same result, and one warning, not a silent no-op."""
    ref_losses, ref_params, _ = _fit([], direct=False)
    cb = _callback(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tba.integrations.lightning"):
        losses, params, _ = _fit([cb], direct=False)
    assert losses == ref_losses and all(torch.equal(a, b) for a, b in zip(params, ref_params))
    said = [r for r in caplog.records if "ran no forward under tba" in r.getMessage()]
    assert len(said) == 1 and cb.steps == 0


def test_kill_switch(tmp_path, monkeypatch):
    from tba.integrations.lightning import OffloadCallback

    monkeypatch.setenv("TBA_ENABLED", "0")
    cb = OffloadCallback()
    _, _, module = _fit([cb])
    assert cb.offloader is None and cb.last_stats is None and cb.steps == 0
    assert "training_step" not in module.__dict__


def test_missing_package_is_a_typed_error():
    from tba.errors import TBAError
    from tba.integrations.lightning import LightningMissing, callback_class

    with pytest.raises(LightningMissing, match="pip install lightning") as got:
        callback_class("no_such_lightning")
    assert isinstance(got.value, TBAError) and isinstance(got.value, ImportError)


def test_pytorch_lightning_name(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from tba.integrations.lightning import callback_class

    cls = callback_class("pytorch_lightning")
    assert issubclass(cls, pl.Callback) and cls is callback_class("pytorch_lightning")
