"""TempoLayerNorm: drop-in for nn.LayerNorm that saves y, rstd, gamma and beta (not x)."""

import pytest
import torch
from torch import nn

import tba.layers as L

from ._support import saved_bytes

CASES = [(True, True), (True, False), (False, False)]


def pair(shape, affine, bias, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    stock = nn.LayerNorm(shape, elementwise_affine=affine, bias=bias, dtype=dtype)
    if affine:
        with torch.no_grad():
            stock.weight.uniform_(0.5, 1.5)
            if bias:
                stock.bias.normal_(0, 0.5)
    return stock, L.TempoLayerNorm.from_layernorm(stock)


@pytest.mark.parametrize(("affine", "bias"), CASES)
def test_forward_matches_and_gradients_match_autograd(affine, bias):
    stock, tempo = pair(48, affine, bias)
    x = torch.randn(4, 7, 48) * 3 + 1
    dy = torch.randn(4, 7, 48)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = stock(x1), tempo(x2)
    assert torch.allclose(y1, y2, rtol=0, atol=1e-6)
    g1 = torch.autograd.grad(y1, [x1, *stock.parameters()], dy)
    g2 = torch.autograd.grad(y2, [x2, *tempo.parameters()], dy)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), float((a - b).abs().max())


@pytest.mark.parametrize(("affine", "bias"), CASES)
@pytest.mark.parametrize("shape", [(8,), (3, 4)])
def test_gradcheck_float64(affine, bias, shape):
    _, tempo = pair(shape, affine, bias, dtype=torch.float64)
    x = torch.randn(2, 3, *shape, dtype=torch.float64, requires_grad=True)
    params = tuple(tempo.parameters())
    assert torch.autograd.gradcheck(lambda x, *p: tempo(x), (x, *params))


def test_state_dict_compatible_and_parameters_shared():
    stock, tempo = pair(16, True, True)
    assert isinstance(tempo, nn.LayerNorm)
    assert tempo.weight is stock.weight and tempo.bias is stock.bias
    fresh = L.TempoLayerNorm(16, eps=1e-6)
    fresh.load_state_dict(stock.state_dict())
    assert torch.equal(fresh.weight, stock.weight)
    back = nn.LayerNorm(16)
    back.load_state_dict(fresh.state_dict())
    assert set(back.state_dict()) == {"weight", "bias"}


def test_small_gamma_falls_back_to_the_stock_op():
    stock, tempo = pair(32, True, True)
    with torch.no_grad():
        stock.weight[3] = 1e-4  # below the default gamma_eps of 1e-3
    x = torch.randn(5, 32)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    params = list(stock.parameters())
    assert saved_bytes(lambda: tempo(x2).sum().backward(), params) == 5 * 32 * 4 + 2 * 5 * 4
    assert tempo.fallbacks == 1
    stock(x1).sum().backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-6)
    relaxed = L.TempoLayerNorm.from_layernorm(stock, gamma_eps=1e-5)
    relaxed(x.clone().requires_grad_()).sum().backward()
    assert relaxed.fallbacks == 0


def test_bad_gamma_eps_is_rejected():
    with pytest.raises(L.LayerOptionError, match=r"gamma_eps=-1.0 must be a finite number >= 0"):
        L.TempoLayerNorm(8, gamma_eps=-1.0)
    with pytest.raises(ValueError, match=r"gamma_eps=nan must be a finite number"):
        L.TempoLayerNorm(8, gamma_eps=float("nan"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs(dtype):
    stock, tempo = pair(64, True, True, dtype=dtype)
    x = torch.randn(3, 64, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = stock(x1), tempo(x2)
    assert torch.equal(y1, y2)
    dy = torch.randn_like(y1)
    y1.backward(dy)
    y2.backward(dy)
    assert x2.grad.dtype == dtype
    assert torch.allclose(x1.grad.float(), x2.grad.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("tokens", [13, 32])
def test_saves_t_h_b_plus_4t_bytes(tokens):
    hidden = 40
    stock = nn.LayerNorm(hidden)
    tempo = L.TempoLayerNorm.from_layernorm(stock)
    lin = nn.Linear(hidden, 24)
    params = [*stock.parameters(), *lin.parameters()]
    x = torch.randn(tokens, hidden, requires_grad=True)
    before = saved_bytes(lambda: lin(stock(x)), params)
    after = saved_bytes(lambda: lin(tempo(x)), params)
    assert after == tokens * hidden * 4 + 4 * tokens  # y (shared with the Linear) and rstd
    assert before - after == tokens * hidden * 4 + 4 * tokens
