"""TempoGELU: bit-identical forward, near-exact gradient from (y, bit), and its saved bytes."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tba.layers as L

from ._support import saved_bytes


def exact_gelu_grad(x: torch.Tensor) -> torch.Tensor:
    xe = x.detach().double()
    return 0.5 * torch.special.erfc(-xe / math.sqrt(2)) + xe * torch.exp(
        -0.5 * xe * xe
    ) / math.sqrt(2 * math.pi)


def grid() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.cat(
        [
            torch.linspace(-20, 20, 40_001),  # step 1e-3, through the minimum and both tails
            L.GELU_X_MIN + torch.linspace(-0.06, 0.06, 12_001),  # step 1e-5 around the minimum
            torch.tensor([L.GELU_X_MIN, 0.0, -0.0, 1e4, -1e4, 50.0, -50.0, 5.5, -5.5]),
            torch.randn(20_000, generator=gen),
            torch.randn(5_000, generator=gen) * 4,
        ]
    )


def tempo_grad(x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    y = L.tempo_gelu(x)
    y.backward(torch.ones_like(y))
    return x.grad


def test_constants_are_the_minimum():
    x = torch.tensor([L.GELU_X_MIN], dtype=torch.float64)
    assert abs(float(exact_gelu_grad(x))) < 1e-15
    assert abs(L.GELU_X_MIN - (-0.751791631228899)) < 2e-7
    assert abs(L.GELU_Y_MIN - (-0.169971)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_forward_is_bit_identical(dtype):
    x = grid().to(dtype).requires_grad_()
    assert torch.equal(L.tempo_gelu(x), F.gelu(x.detach()))
    assert torch.equal(L.TempoGELU()(x), F.gelu(x.detach()))
    with torch.no_grad():
        assert torch.equal(L.tempo_gelu(x), F.gelu(x))


def test_gradient_float32_dense_grid():
    x = grid()
    err = (tempo_grad(x).double() - exact_gelu_grad(x)).abs()
    near = (x.double() - L.GELU_X_MIN).abs() <= 0.05
    assert err[~near].max() <= 1e-4, float(err[~near].max())
    assert err[near].max() <= 5e-3, float(err[near].max())
    # In practice it is much better than the bounds required above.
    assert err[~near].max() <= 5e-6 and err[near].max() <= 5e-4


def test_gradient_random_normal_batches():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 33, 65, generator=gen)
    grad_out = torch.randn(x.shape, generator=gen)
    xt = x.clone().requires_grad_()
    L.TempoGELU()(xt).backward(grad_out)
    expected = grad_out.double() * exact_gelu_grad(x)
    near = (x.double() - L.GELU_X_MIN).abs() <= 0.05
    scale = grad_out.double().abs()
    err = (xt.grad.double() - expected).abs()
    assert (err[~near] <= 1e-4 * scale[~near] + 1e-7).all()
    assert (err[near] <= 5e-3 * scale[near] + 1e-7).all()


def test_underflowed_tail_and_specials():
    # float32 GELU returns -0.0 below about -5.54: the gradient is defined as exactly 0 there.
    x = torch.tensor([-6.0, -10.0, -1e4, -5.5, 0.0, -0.0, 10.0, 1e4, float("nan")])
    g = tempo_grad(x)
    assert torch.equal(g[:3], torch.zeros(3))
    assert abs(float(g[3]) - float(exact_gelu_grad(x[3:4]))) < 1e-6  # still on the curve
    assert g[4] == 0.5 and g[5] == 0.5  # y == 0 on the right branch is x == 0
    assert g[6] == 1.0 and g[7] == 1.0
    assert torch.isnan(g[8])


@pytest.mark.parametrize(
    ("dtype", "far", "near"), [(torch.float16, 5e-3, 2e-2), (torch.bfloat16, 2e-2, 4e-2)]
)
def test_low_precision_inputs_are_solved_in_float32(dtype, far, near):
    x = torch.cat([torch.linspace(-8, 8, 20_001), torch.randn(5_000)]).to(dtype)
    g = tempo_grad(x)
    assert g.dtype == dtype
    err = (g.double() - exact_gelu_grad(x)).abs()
    close = (x.double() - L.GELU_X_MIN).abs() <= 0.05
    assert err[~close].max() <= far and err[close].max() <= near


def test_float64_gradcheck_away_from_the_minimum():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, generator=gen, dtype=torch.float64) * 2
    x = x[(x - L.GELU_X_MIN).abs() > 0.1][:40].requires_grad_()
    assert torch.autograd.gradcheck(L.tempo_gelu, (x,), atol=1e-7, rtol=1e-5)


def test_non_contiguous_input():
    x = torch.randn(6, 10).t()
    assert not x.is_contiguous()
    g = tempo_grad(x)
    assert torch.allclose(g.double(), exact_gelu_grad(x), atol=5e-3)


def test_only_the_erf_form_is_accepted():
    with pytest.raises(L.LayerOptionError, match=r"TempoGELU: approximate='tanh' is not supported"):
        L.TempoGELU(approximate="tanh")


@pytest.mark.parametrize(("tokens", "width"), [(15, 37), (32, 256)])
def test_saves_n_b_minus_n_over_8_bytes_when_next_linear_saves_the_output(tokens, width):
    torch.manual_seed(0)
    hidden = 16
    lin1, lin2 = nn.Linear(hidden, width), nn.Linear(width, hidden)
    params = [*lin1.parameters(), *lin2.parameters()]
    x = torch.randn(tokens, hidden, requires_grad=True)
    stock = saved_bytes(lambda: lin2(F.gelu(lin1(x))), params)
    tempo = saved_bytes(lambda: lin2(L.TempoGELU()(lin1(x))), params)
    n, b = tokens * width, 4
    assert stock == tokens * hidden * b + 2 * n * b  # x, GELU's input, Linear2's input
    assert stock - tempo == n * b - math.ceil(n / 8)
