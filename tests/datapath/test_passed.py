"""What pack passes through unchanged (NOTE [Passed through]): parameters, their views, other
grad-requiring leaves, model buffers and tensors tba cannot capture come back from unpack with
autograd's own version check, which autograd skips while saved-tensor hooks are installed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tba
from tba.testing import warm_cpu_math

MODIFIED = "modified by an inplace operation"


@pytest.fixture
def off(tmp_path):
    warm_cpu_math()
    with tba.Offloader(
        tba.Config(environ={}, spill_dir=str(tmp_path), backend="posix", min_offload_bytes=1)
    ) as o:
        yield o


def stock_and_tba(off, build, between):
    """Run ``build`` (forward, returns a loss) stock and under tba, ``between`` after each
    forward; returns what each backward raised (None: nothing)."""
    got = []
    for use_tba in (False, True):
        torch.manual_seed(0)
        state = {}
        if use_tba:
            with off.step(state.get("model")):
                loss = build(state)
        else:
            loss = build(state)
        between(state)
        try:
            loss.backward()
        except RuntimeError as e:
            got.append(e)
        else:
            got.append(None)
    return got


def test_a_leaf_changed_in_place_before_backward_raises_as_stock():
    """The issue's repro: stock raises; tba gave w.grad = 20 with no error."""

    def build(s):
        s["w"] = torch.ones(3, requires_grad=True)
        return (s["w"] ** 2).sum()

    def between(s):
        with torch.no_grad():
            s["w"].mul_(10)

    with tba.Offloader(tba.Config(environ={}, backend="memory")) as o:
        stock, ours = stock_and_tba(o, build, between)
    assert stock is not None and MODIFIED in str(stock)
    assert isinstance(ours, tba.UnpackError) and isinstance(ours, RuntimeError)
    assert MODIFIED in str(ours) and "saved parameter or leaf of shape [3]" in str(ours)
    assert "is at version 1; expected version 0" in str(ours)


def test_an_optimizer_step_between_forward_and_backward_raises_as_stock(off):
    """nn.Linear saves weight.t() (a view of the parameter); SGD.step() changes it in place:
    the input's gradient would use the new weight."""

    def build(s):
        s["lin"] = lin = nn.Linear(8, 8)
        s["opt"] = torch.optim.SGD(lin.parameters(), lr=0.1)
        s["x"] = torch.randn(4, 8, requires_grad=True)
        return lin(s["x"]).pow(2).sum()

    def between(s):
        for p in s["lin"].parameters():
            p.grad = torch.ones_like(p)
        s["opt"].step()

    stock, ours = stock_and_tba(off, build, between)
    assert stock is not None and MODIFIED in str(stock)
    assert isinstance(ours, tba.UnpackError) and MODIFIED in str(ours)
    assert "optimizer.step() after loss.backward()" in str(ours)


def test_unchanged_parameters_and_buffers_give_stock_gradients(off):
    """No false alarm: BatchNorm updates its running statistics (buffers) during the forward,
    and parameters saved as themselves or as views come back as they were."""

    def run(use_tba):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Linear(32, 4))
        x = torch.randn(8, 16)
        grads = []
        for _ in range(3):
            if use_tba:
                with off.step(model):
                    loss = model(x).square().sum()
                off.synchronize()
            else:
                loss = model(x).square().sum()
            model.zero_grad()
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        return grads, [b.clone() for b in model.buffers()]

    (g0, b0), (g1, b1) = run(False), run(True)
    assert all(torch.equal(a, b) for x, y in zip(g0, g1) for a, b in zip(x, y))
    assert all(torch.equal(a, b) for a, b in zip(b0, b1))


NESTED_PROTOTYPE = "ignore:The PyTorch API of nested tensors is in prototype"


@pytest.mark.filterwarnings(NESTED_PROTOTYPE)
def test_a_nested_tensor_passes_through(off):
    """torch.nested tensors are strided but have no sizes of their own: pack crashed at
    t.shape. They stay in memory, counted as unsupported, gradients as stock's."""

    def run(use_tba):
        torch.manual_seed(0)
        parts = [torch.randn(2, 3), torch.randn(4, 3)]
        nt = torch.nested.nested_tensor(parts, requires_grad=True)
        if use_tba:
            with off.step():
                y = torch.nested.to_padded_tensor((nt * nt).sin(), 0.0).sum()
        else:
            y = torch.nested.to_padded_tensor((nt * nt).sin(), 0.0).sum()
        y.backward()
        return [g.clone() for g in nt.grad.unbind()]

    stock, ours = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(stock, ours))
    assert off.stats()["kept_reasons"].get("unsupported", 0) > 0


@pytest.mark.filterwarnings(NESTED_PROTOTYPE)
def test_a_nested_tensor_changed_in_place_raises(off):
    nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], requires_grad=True)
    with off.step():
        y = nt * 2.0
        z = y * y  # saves y (nested, not a leaf): passed through
    with torch.no_grad():
        y.mul_(3)
    with pytest.raises(tba.UnpackError, match=MODIFIED + r".*saved tensor of shape \['nested'\]"):
        torch.nested.to_padded_tensor(z, 0.0).sum().backward()
