"""TempoRMSNorm: the replaced module's forward bit for bit, exact gradients from y, saved bytes."""

import math

import pytest
import torch
from torch import nn

import tba.layers as L

from ._support import saved_bytes


class LlamaStyle(nn.Module):
    """transformers' LlamaRMSNorm, written out: weight * (x * rsqrt(mean(x^2) + eps)) in fp32."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class GemmaStyle(nn.Module):
    """transformers' GemmaRMSNorm, written out: (x_hat * (1 + weight)) in fp32, then cast."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def make(style: str, hidden: int = 48, dtype=torch.float32, seed: int = 0):
    """(stock module, TempoRMSNorm sharing its weight), weight randomized."""
    stock = {"llama": LlamaStyle, "gemma": GemmaStyle, "torch": lambda h: nn.RMSNorm(h, 1e-6)}[
        style
    ](hidden).to(dtype)
    with torch.no_grad():
        stock.weight.uniform_(0.3, 1.7, generator=torch.Generator().manual_seed(seed))
    tempo = L.TempoRMSNorm.replacing(stock, 1e-6, style)
    assert tempo.weight is stock.weight
    return stock, tempo


def run(module, x, dy):
    module.zero_grad(set_to_none=True)
    xt = x.clone().requires_grad_()
    y = module(xt)
    y.backward(dy)
    return y, xt.grad, module.weight.grad


@pytest.mark.parametrize("style", ["llama", "gemma", "torch"])
def test_forward_bit_identical_and_gradients_exact_float32(style):
    stock, tempo = make(style)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 9, 48, generator=gen) * 3 + 0.5
    dy = torch.randn(x.shape, generator=gen)
    y0, dx0, dw0 = run(stock, x, dy)
    y1, dx1, dw1 = run(tempo, x, dy)
    assert torch.equal(y1, y0)
    assert torch.allclose(dx1, dx0, rtol=1e-5, atol=1e-6)
    assert torch.allclose(dw1, dw0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_bfloat16_forward_bit_identical(style):
    stock, tempo = make(style, dtype=torch.bfloat16)
    x = torch.randn(3, 5, 48).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(tempo(x), stock(x))
    y0, dx0, _ = run(stock, x, torch.ones_like(x))
    y1, dx1, _ = run(tempo, x, torch.ones_like(x))
    assert torch.equal(y1, y0)
    assert torch.allclose(dx1.float(), dx0.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("style", ["llama", "gemma", "torch"])
def test_gradcheck_float64(style):
    _stock, tempo = make(style, hidden=8)
    tempo.double()
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    w = tempo.weight.detach().clone().requires_grad_()

    def fn(x, w):
        return torch.func.functional_call(tempo, {"weight": w}, (x,))

    assert torch.autograd.gradcheck(fn, (x, w))


def test_small_gamma_falls_back_to_the_stock_formula():
    stock, tempo = make("llama")
    with torch.no_grad():
        stock.weight[3] = 1e-5
    x = torch.randn(2, 48)
    y0, dx0, dw0 = run(stock, x, torch.ones_like(x))
    y1, dx1, dw1 = run(tempo, x, torch.ones_like(x))
    assert tempo.fallbacks == 1
    assert torch.equal(y1, y0) and torch.allclose(dw1, dw0, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("style", ["llama", "gemma", "torch"])
def test_saves_y_instead_of_x(style):
    """Before a Linear: Tempo keeps y (the Linear's input, one storage) and rstd; the stock
    formulas keep x and x_hat as well (F.rms_norm on the CPU too), and small rstd-sized extras."""
    torch.manual_seed(0)
    tokens, hidden = 24, 48
    stock, tempo = make(style, hidden)
    lin = nn.Linear(hidden, 16)
    params = [stock.weight, *lin.parameters()]
    x = torch.randn(tokens, hidden, requires_grad=True)
    before = saved_bytes(lambda: lin(stock(x)), params)
    after = saved_bytes(lambda: lin(tempo(x)), params)
    assert after == tokens * hidden * 4 + tokens * 4  # y and rstd
    assert before - after >= 2 * tokens * hidden * 4


def test_options_are_checked():
    with pytest.raises(L.LayerOptionError, match=r"TempoRMSNorm: style='t5' is not one of"):
        L.TempoRMSNorm(8, style="t5")
    with pytest.raises(L.LayerOptionError, match=r"TempoRMSNorm: gamma_eps=-1 must be a finite"):
        L.TempoRMSNorm(8, gamma_eps=-1)
    with pytest.raises(L.LayerOptionError, match=r"gamma_eps=nan must be a finite"):
        L.TempoRMSNorm(8, gamma_eps=math.nan)


def test_no_affine_and_default_eps():
    norm = L.TempoRMSNorm(16, elementwise_affine=False, style="torch")
    x = torch.randn(5, 16, requires_grad=True)
    ref = nn.RMSNorm(16, elementwise_affine=False)
    assert torch.equal(norm(x), ref(x))
    (g1,) = torch.autograd.grad(norm(x).sum() + (norm(x) ** 2).sum(), x)
    (g0,) = torch.autograd.grad(ref(x).sum() + (ref(x) ** 2).sum(), x)
    assert torch.allclose(g1, g0, rtol=1e-5, atol=1e-6)
