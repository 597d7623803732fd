"""MSLayerNorm / MSRMSNorm: affine-free norms that save only rstd beyond their shared output."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tba.layers as L

from ._support import SavedBytes, saved_bytes


def grads(fn, x, dy):
    xt = x.clone().requires_grad_()
    y = fn(xt)
    y.backward(dy)
    return y, xt.grad


@pytest.mark.parametrize("shape", [(24,), (3, 8)])
def test_ms_layernorm_matches_affine_free_layernorm(shape):
    x = torch.randn(5, 6, *shape) * 2 + 0.5
    dy = torch.randn_like(x)
    y1, g1 = grads(L.MSLayerNorm(shape), x, dy)
    y2, g2 = grads(nn.LayerNorm(shape, elementwise_affine=False), x, dy)
    assert torch.equal(y1, y2)
    assert torch.allclose(g1, g2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("eps", [None, 1e-6])
def test_ms_rmsnorm_matches_affine_free_rmsnorm(eps):
    x = torch.randn(5, 6, 24) * 2 + 0.5
    dy = torch.randn_like(x)
    y1, g1 = grads(L.MSRMSNorm(24, eps=eps), x, dy)
    y2, g2 = grads(nn.RMSNorm(24, eps=eps, elementwise_affine=False), x, dy)
    assert torch.allclose(y1, y2, rtol=1e-6, atol=1e-6)
    assert torch.allclose(g1, g2, rtol=1e-4, atol=1e-5)


def test_gradcheck_float64():
    x = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(L.MSLayerNorm(8), (x,))
    assert torch.autograd.gradcheck(L.MSRMSNorm(8), (x,))
    assert torch.autograd.gradcheck(L.MSLayerNorm((4, 8)), (x,))
    assert torch.autograd.gradcheck(lambda t: L.ms_rms_norm(t, (4, 8), 1e-3), (x,))


def test_half_inputs_keep_rstd_in_float32():
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    counter = SavedBytes()
    y = counter.run(lambda: L.MSRMSNorm(32)(x))
    assert y.dtype == torch.bfloat16
    assert counter.total == 4 * 32 * 2 + 4 * 4  # y (bf16) and rstd (float32)
    ref = F.rms_norm(x.float(), (32,))
    assert torch.allclose(y.float(), ref, atol=2e-2)
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("ms", "stock", "stock_extra"),
    [
        (L.MSLayerNorm, lambda h: nn.LayerNorm(h, elementwise_affine=False), "x + mean"),
        (L.MSRMSNorm, lambda h: nn.RMSNorm(h, elementwise_affine=False), "x"),
    ],
)
@pytest.mark.parametrize("tokens", [7, 32])
def test_output_is_the_next_linears_saved_input(ms, stock, stock_extra, tokens):
    hidden = 24
    lin = nn.Linear(hidden, 16)
    params = list(lin.parameters())
    x = torch.randn(tokens, hidden, requires_grad=True)
    norm = ms(hidden)
    counter = SavedBytes(params)
    y = counter.run(lambda: norm(x))
    saved_inputs = []

    def spy(t):
        saved_inputs.append(t)
        return counter.pack(t)

    with torch.autograd.graph.saved_tensors_hooks(spy, lambda t: t):
        lin(y)
    # The Linear saves the norm's output tensor itself: no second copy exists.
    assert any(
        t.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for t in saved_inputs
    )
    assert counter.total == tokens * hidden * 4 + 4 * tokens  # y once, plus rstd
    before = saved_bytes(lambda: lin(stock(hidden)(x)), params)
    after = saved_bytes(lambda: lin(ms(hidden)(x)), params)
    saving = tokens * hidden * 4 + (4 * tokens if stock_extra == "x + mean" else 0)
    assert before - after == saving
