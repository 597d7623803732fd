"""tba.integrations.wrap: the one line for a plain PyTorch loop."""

from __future__ import annotations

import pytest
import torch

import tba
import tba.integrations
from tba.testing import GPT, GPTConfig

pytestmark = pytest.mark.integration

CFG = GPTConfig(vocab=64, seq=32, hidden=64, heads=4, layers=3)


def _loop(wrap: bool = False, off: tba.Offloader | None = None, steps: int = 3):
    """``wrap``: ``tba.integrations.wrap(model, off)``; with ``off``, its writes are waited for
    between forward and backward, so that backward reads from disk."""
    torch.manual_seed(0)
    model = GPT(CFG)
    if wrap:
        tba.integrations.wrap(model, off)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for _ in range(steps):
        x = torch.randint(0, CFG.vocab, (2, CFG.seq), generator=g)
        loss = model(x, x)
        if off is not None:
            off.synchronize()
        loss.backward()
        grads += [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, grads, model


def _cfg(tmp_path, **kw) -> tba.Config:
    kw = {"spill_dir": str(tmp_path), "min_offload_bytes": 1, "keep_last": 0, **kw}
    return tba.Config(**kw)


def test_wrapped_loop_is_exact(tmp_path):
    ref_losses, ref_grads, _ = _loop()
    with tba.Offloader(_cfg(tmp_path)) as off:
        losses, grads, model = _loop(True, off)
        st = off.stats()
        # back from disk, or from staging when the read-ahead wanted it while its write ran
        assert st["bytes_offloaded"] > 0 and st["bytes_reloaded"] + st["forwarded"] > 0
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert len(grads) == len(ref_grads) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert tba.integrations.is_wrapped(model)
    tba.integrations.unwrap(model)
    assert not tba.integrations.is_wrapped(model) and "forward" not in model.__dict__


def test_env_only_default_offloader(tmp_path, monkeypatch):
    monkeypatch.setenv("TBA_SPILL_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("TBA_MIN_OFFLOAD_BYTES", "1")
    _loop(True)
    off = tba.default_offloader()
    off.synchronize()  # writes are counted once they land (NOTE [Counted once])
    assert off.stats()["bytes_offloaded"] > 0
    assert off.backend.spill_path.startswith(str(tmp_path / "env"))


def test_kill_switch_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TBA_ENABLED", "0")
    monkeypatch.setenv("TBA_SPILL_DIR", str(tmp_path / "off"))
    _loop(True)
    assert tba._default is None or tba._default.closed
    assert not (tmp_path / "off").exists()


def test_no_grad_forward_and_an_open_step_are_left_alone(tmp_path):
    with tba.Offloader(_cfg(tmp_path)) as off:
        torch.manual_seed(0)
        model = tba.integrations.wrap(GPT(CFG), off)
        x = torch.randint(0, CFG.vocab, (2, CFG.seq))
        with torch.no_grad():
            model(x, x)
        assert off.stats()["tensors_offloaded"] == 0 and off._steps == 0
        with off.step(model):  # the caller's own step wins; the wrapper does not nest one
            loss = model(x, x)
        loss.backward()
        off.synchronize()  # writes are counted once they land (NOTE [Counted once])
        assert off._steps == 1 and off.stats()["tensors_offloaded"] > 0
        # wrapping again replaces the wrapper (one step per forward, not two)
        tba.integrations.wrap(model, off)
        model(x, x).backward()
        assert off._steps == 2
