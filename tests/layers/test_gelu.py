"""TempoGELU (erf and tanh forms) and TempoSiLU: bit-identical forward, exact gradient from
(y, bit), and their saved bytes.

References: the erf form against its closed-form derivative; the tanh form and SiLU against
float64 autograd of their textbook formulas (written out here, independent of the library).
"""

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


def autograd_grad(formula, x: torch.Tensor) -> torch.Tensor:
    xe = x.detach().double().requires_grad_()
    formula(xe).backward(torch.ones_like(xe))
    return xe.grad


def tanh_formula(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def silu_formula(x):
    return x * torch.sigmoid(x)


FORMS = {
    # name: (functional, module, stock forward, reference derivative, x_min)
    "erf": (L.tempo_gelu, L.TempoGELU, F.gelu, exact_gelu_grad, L.GELU_X_MIN),
    "tanh": (
        lambda x: L.tempo_gelu(x, "tanh"),
        lambda: L.TempoGELU("tanh"),
        lambda x: F.gelu(x, approximate="tanh"),
        lambda x: autograd_grad(tanh_formula, x),
        L.GELU_TANH_X_MIN,
    ),
    "silu": (
        L.tempo_silu,
        L.TempoSiLU,
        F.silu,
        lambda x: autograd_grad(silu_formula, x),
        L.SILU_X_MIN,
    ),
}


def grid(x_min: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.cat(
        [
            torch.linspace(-20, 20, 40_001),  # step 1e-3, through the minimum and both tails
            x_min + torch.linspace(-0.06, 0.06, 12_001),  # step 1e-5 around the minimum
            torch.tensor([x_min, 0.0, -0.0, 1e4, -1e4, 50.0, -50.0, 5.5, -5.5]),
            torch.randn(20_000, generator=gen),
            torch.randn(5_000, generator=gen) * 4,
        ]
    )


def tempo_grad(fn, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    y = fn(x)
    y.backward(torch.ones_like(y))
    return x.grad


def test_constants_are_the_minima():
    x = torch.tensor([L.GELU_X_MIN], dtype=torch.float64)
    assert abs(float(exact_gelu_grad(x))) < 1e-15
    assert abs(L.GELU_X_MIN - (-0.751791631228899)) < 2e-7
    assert abs(L.GELU_Y_MIN - (-0.169971)) < 1e-6
    for formula, x_min, y_min in [
        (tanh_formula, L.GELU_TANH_X_MIN, L.GELU_TANH_Y_MIN),
        (silu_formula, L.SILU_X_MIN, L.SILU_Y_MIN),
    ]:
        x = torch.tensor([x_min], dtype=torch.float64)
        assert abs(float(autograd_grad(formula, x))) < 1e-14
        assert abs(float(formula(x)) - y_min) < 1e-15
    assert abs(L.SILU_X_MIN - (-1.2784645427610738)) < 1e-12  # -(1 + W(1/e))


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_forward_is_bit_identical(form, dtype):
    fn, module, stock, _ref, x_min = FORMS[form]
    x = grid(x_min).to(dtype).requires_grad_()
    assert torch.equal(fn(x), stock(x.detach()))
    assert torch.equal(module()(x), stock(x.detach()))
    with torch.no_grad():
        assert torch.equal(fn(x), stock(x))


def erf_formula(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


EXACT = {"erf": erf_formula, "tanh": tanh_formula, "silu": silu_formula}


def exact_slope(form: str, x: torch.Tensor) -> torch.Tensor:
    xe = x.detach().double().requires_grad_()
    (g1,) = torch.autograd.grad(EXACT[form](xe).sum(), xe)
    return g1


def propagated_error(form: str, x: torch.Tensor) -> torch.Tensor:
    """What the stock kernel's own rounding of y costs a gradient taken from y: tba inverts y
    to x on x's side of the minimum, so the best it can return is g'(x*) where g(x*) is the
    stock y. x* is found here in float64 by bisection, so the bound follows the kernel of the
    torch build and CPU the suite runs on: the float32 GELU of one host rounds y at x = -4 to
    3e-6 of g', and another's at x = -5 to 4% of y, where a fixed tolerance failed. Give it
    the tensor tba got: the kernel's vector and scalar paths round differently."""
    x64 = x.detach().double()
    y = FORMS[form][2](x.detach()).double()
    x_min = FORMS[form][4]
    left = x64 < x_min
    lo = torch.where(left, torch.clamp(2 * x64, max=-1.0) - 1, torch.full_like(x64, x_min))
    hi = torch.where(left, torch.full_like(x64, x_min), torch.clamp(2 * x64, min=1.0) + 1)
    g = EXACT[form]
    for _ in range(100):  # g falls on the left branch and rises on the right
        mid = (lo + hi) / 2
        below = g(mid) < y
        go_right = torch.where(left, ~below, below)
        lo, hi = torch.where(go_right, mid, lo), torch.where(go_right, hi, mid)
    x_star = torch.where(x64.isfinite(), (lo + hi) / 2, x64)
    return (exact_slope(form, x_star) - exact_slope(form, x64)).abs().nan_to_num(0.0)


def kernel_bound(form: str, x: torch.Tensor) -> torch.Tensor:
    """Away from the minimum: the tables' 2.2e-7, one float32 rounding of g' (6e-8 at |g'| <=
    1.1) and, doubled for slack, the stock kernel's rounding of y carried through the inverse."""
    return 3e-7 + 2 * propagated_error(form, x)


@pytest.mark.parametrize("form", list(FORMS))
def test_gradient_float32_dense_grid(form):
    fn, _module, _stock, ref, x_min = FORMS[form]
    x = grid(x_min)
    err = (tempo_grad(fn, x).double() - ref(x)).abs()
    near = (x.double() - x_min).abs() <= 0.05
    # Tables interpolate within 2.2e-7. The rest is y's float32 rounding (a few ulp from the
    # stock kernel), amplified by g''/g' ~ 1/|x - x_min| near the minimum, and the tanh form's
    # output underflowing to 0 from x = -5.06, where |g'| is still 1e-6.
    assert err[~near].max() <= 5e-6, float(err[~near].max())
    assert err[near].max() <= 5e-4, float(err[near].max())
    away = (x.double() - x_min).abs() > 0.5
    excess = err[away] - kernel_bound(form, x)[away]
    assert excess.max() <= 0, (float(excess.max()), float(err[away].max()))


@pytest.mark.parametrize("form", list(FORMS))
def test_gradient_random_normal_batches(form):
    fn, _module, _stock, ref, x_min = FORMS[form]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 33, 65, generator=gen) * 2
    grad_out = torch.randn(x.shape, generator=gen)
    xt = x.clone().requires_grad_()
    fn(xt).backward(grad_out)
    expected = grad_out.double() * ref(x)
    near = (x.double() - x_min).abs() <= 0.05
    scale = grad_out.double().abs()
    err = (xt.grad.double() - expected).abs()
    assert (err[~near] <= 5e-6 * scale[~near] + 1e-7).all()
    assert (err[near] <= 5e-4 * scale[near] + 1e-7).all()


@pytest.mark.parametrize("form", ["erf", "tanh"])
def test_underflowed_tail_and_specials(form):
    # Where float32 GELU underflows to -0.0 the gradient is defined as 0. Where that starts
    # depends on the kernel: about -5.5 for both forms with torch 2.13 on this project's CI
    # CPU, but torch 2.11's erf form on an H200 host's CPU failed the assertions that took
    # -6 and -10 to underflow. So the tail is read off the kernel; y at -1e4 underflows in
    # any arithmetic.
    fn, _module, stock, ref, _x_min = FORMS[form]
    x = torch.tensor([-6.0, -10.0, -1e4, -5.0, 0.0, -0.0, 10.0, 1e4, float("nan"), float("inf")])
    g = tempo_grad(fn, x)
    y = stock(x)
    tail = (y == 0) & (x < 0)
    assert tail[2] and torch.equal(g[tail], torch.zeros(int(tail.sum())))
    # the rest of the negative side is still on the curve, as closely as the stock kernel's y
    # allows (the bound from y as the kernel rounds it in this same call: its vector and
    # scalar paths round differently)
    curve = ~tail & (x < 0) & x.isfinite()
    assert curve[3]  # -5 is on the curve for every kernel seen
    err = (g[curve].double() - ref(x[curve])).abs()
    assert (err <= kernel_bound(form, x)[curve]).all(), err
    # y == 0 on the right branch is x == 0, g' = 0.5 read off the tables: exactly 0.5 with
    # torch 2.13 on the CI CPU, 0.5 - 3e-8 with torch 2.11 on an H200 host's CPU (its float32
    # passes round differently), so within the tables' 3e-7 as everywhere away from the minimum
    assert (g[4:6] - 0.5).abs().max() <= 3e-7
    assert g[6] == 1.0 and g[7] == 1.0
    assert torch.isnan(g[8]) and torch.isnan(g[9])  # NaN and inf x: NaN, as stock backward


def test_silu_far_tails():
    x = torch.tensor([-30.0, -80.0, -120.0, 30.0, 1e4])
    g = tempo_grad(L.tempo_silu, x)
    assert torch.allclose(g[:2].double(), FORMS["silu"][3](x[:2]), rtol=1e-3, atol=1e-30)
    assert g[2] == 0.0  # F.silu(-120) underflows to -0.0 in float32
    assert g[3] == 1.0 and g[4] == 1.0


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize(
    ("dtype", "far", "near"), [(torch.float16, 5e-3, 2e-2), (torch.bfloat16, 2e-2, 4e-2)]
)
def test_low_precision_inputs_are_solved_in_float32(form, dtype, far, near):
    fn, _module, _stock, ref, x_min = FORMS[form]
    x = torch.cat([torch.linspace(-8, 8, 20_001), torch.randn(5_000)]).to(dtype)
    g = tempo_grad(fn, x)
    assert g.dtype == dtype
    err = (g.double() - ref(x)).abs()
    close = (x.double() - x_min).abs() <= 0.05
    assert err[~close].max() <= far and err[close].max() <= near


@pytest.mark.parametrize("form", list(FORMS))
def test_float64_gradcheck_away_from_the_minimum(form):
    fn, _module, _stock, _ref, x_min = FORMS[form]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, generator=gen, dtype=torch.float64) * 2
    x = x[(x - x_min).abs() > 0.1][:40].requires_grad_()
    assert torch.autograd.gradcheck(fn, (x,), atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("form", list(FORMS))
def test_float64_near_the_minimum(form):
    fn, _module, _stock, ref, x_min = FORMS[form]
    x = x_min + torch.linspace(-0.1, 0.1, 2001, dtype=torch.float64)
    err = (tempo_grad(fn, x) - ref(x)).abs()
    assert err.max() <= 5e-8, float(err.max())


def test_non_contiguous_input():
    x = torch.randn(6, 10).t()
    assert not x.is_contiguous()
    g = tempo_grad(L.tempo_gelu, x)
    assert torch.allclose(g.double(), exact_gelu_grad(x), atol=5e-4)


def test_bad_approximate_is_refused():
    with pytest.raises(L.LayerOptionError, match=r"TempoGELU: approximate='erf' is not one of"):
        L.TempoGELU(approximate="erf")
    with pytest.raises(L.LayerOptionError, match=r"tempo_gelu: approximate='x' is not one of"):
        L.tempo_gelu(torch.zeros(2), "x")


@pytest.mark.parametrize(
    ("stock", "tempo"),
    [
        (nn.GELU(), L.TempoGELU()),
        (nn.GELU("tanh"), L.TempoGELU("tanh")),
        (nn.SiLU(), L.TempoSiLU()),
    ],
)
@pytest.mark.parametrize(("tokens", "width"), [(15, 37), (32, 256)])
def test_saves_n_b_minus_n_over_8_bytes_when_next_linear_saves_the_output(
    stock, tempo, tokens, width
):
    torch.manual_seed(0)
    hidden = 16
    lin1, lin2 = nn.Linear(hidden, width), nn.Linear(width, hidden)
    params = [*lin1.parameters(), *lin2.parameters()]
    x = torch.randn(tokens, hidden, requires_grad=True)
    before = saved_bytes(lambda: lin2(stock(lin1(x))), params)
    after = saved_bytes(lambda: lin2(tempo(lin1(x))), params)
    n, b = tokens * width, 4
    assert before == tokens * hidden * b + 2 * n * b  # x, the activation's input, Linear2's input
    assert before - after == n * b - math.ceil(n / 8)
