"""ReGELU2 / ReSiLU2: exact forward, 2-bit step-function backward."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tba.layers as L

from ._support import saved_bytes

# The constants of docs/sources.md (Approx-BP), written out independently of the library.
GELU_C = (-3.1858810036855245, -0.001178821281161997, 3.190832613414926)
GELU_A = (-0.04922261145617846, 1.0979632065417297, -0.048740595085551286)
SILU_C = (-6.3050461001646445, -0.0008684942046214787, 6.325815242089708)
SILU_A = (-0.04060357190528599, 1.080925428529668, -0.040321856624382146)
CASES = [
    ("gelu", L.ReGELU2, L.regelu2, F.gelu, GELU_C, GELU_A, (0, -0.0492226, 1.0487406, 1.0)),
    ("silu", L.ReSiLU2, L.resilu2, F.silu, SILU_C, SILU_A, (0, -0.0406036, 1.0403219, 1.0)),
]


def step_reference(x, grad, c, a):
    """grad * d/dx sum_k a_k relu(x - c_k), with the partial sums formed in float64."""
    steps = [0.0, a[0], a[0] + a[1], a[0] + a[1] + a[2]]
    xf = x.float()
    flag = (xf > c[0]).long() + (xf > c[1]).long() + (xf > c[2]).long()
    table = torch.tensor(steps, dtype=torch.float32)
    return (grad.float() * table[flag]).to(grad.dtype)


def sample(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(3001, generator=gen) * 4, torch.linspace(-8, 8, 1601)])
    return x.to(dtype)


@pytest.mark.parametrize(("name", "module", "fn", "stock", "c", "a", "table"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_forward_bit_identical_and_backward_is_the_step_function(
    name, module, fn, stock, c, a, table, dtype
):
    x = sample(dtype)
    grad = torch.randn(x.shape).to(dtype)
    for layer in (module(), fn):
        xt = x.clone().requires_grad_()
        y = layer(xt)
        assert torch.equal(y, stock(x))
        y.backward(grad)
        if dtype == torch.float64:
            steps = torch.tensor([0.0, a[0], a[0] + a[1], a[0] + a[1] + a[2]], dtype=dtype)
            flag = (x > c[0]).long() + (x > c[1]).long() + (x > c[2]).long()
            assert torch.equal(xt.grad, grad * steps[flag])
        else:
            assert torch.equal(xt.grad, step_reference(x, grad, c, a))


@pytest.mark.parametrize(("name", "module", "fn", "stock", "c", "a", "table"), CASES)
def test_step_values_match_the_published_table(name, module, fn, stock, c, a, table):
    x = torch.tensor([c[0] - 1, (c[0] + c[1]) / 2, (c[1] + c[2]) / 2, c[2] + 1], requires_grad=True)
    fn(x).sum().backward()
    assert torch.allclose(x.grad.double(), torch.tensor(table, dtype=torch.float64), atol=1e-7)


def test_regelu2_tanh_form_and_bad_value():
    x = sample().requires_grad_()
    assert torch.equal(L.ReGELU2("tanh")(x), F.gelu(x.detach(), approximate="tanh"))
    with pytest.raises(L.LayerOptionError, match=r"ReGELU2: approximate='erf' is not one of"):
        L.ReGELU2("erf")
    with pytest.raises(L.LayerOptionError, match=r"regelu2: approximate='x' is not one of"):
        L.regelu2(x, "x")


def test_gradient_is_an_approximation_close_to_gelu_prime():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(100_000, generator=gen, requires_grad=True)
    L.regelu2(x).sum().backward()
    xe = x.detach().double()
    exact = 0.5 * torch.special.erfc(-xe / math.sqrt(2)) + xe * torch.exp(-xe * xe / 2) / math.sqrt(
        2 * math.pi
    )
    cos = F.cosine_similarity(x.grad.double(), exact, dim=0)
    assert 0.9 < cos < 0.999


@pytest.mark.parametrize(("module", "stock"), [(L.ReGELU2, nn.GELU), (L.ReSiLU2, nn.SiLU)])
@pytest.mark.parametrize("n", [1, 3, 5, 7, 1001])
def test_saves_n_b_minus_n_over_4_bytes(module, stock, n):
    x = torch.randn(n, requires_grad=True)
    assert saved_bytes(lambda: stock()(x)) == 4 * n
    assert saved_bytes(lambda: module()(x)) == math.ceil(n / 4)
    lin1, lin2 = nn.Linear(8, n), nn.Linear(n, 8)
    params = [*lin1.parameters(), *lin2.parameters()]
    h = torch.randn(6, 8, requires_grad=True)
    before = saved_bytes(lambda: lin2(stock()(lin1(h))), params)
    after = saved_bytes(lambda: lin2(module()(lin1(h))), params)
    assert before - after == 6 * n * 4 - math.ceil(6 * n / 4)
