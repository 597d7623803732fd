"""Double backward and ``create_graph=True``: gradients of gradients through saved tensors.

The first-order graph is built inside tba's step (its saved tensors come back from tba); the
graph of the gradient is built either outside a step (stock's saved tensors) or inside one.
"""

from __future__ import annotations

import torch

from .conftest import run_both


def test_double_backward_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
        w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
        with fwd():
            y = (x @ w).tanh().pow(3).sum()
        gx, gw = torch.autograd.grad(y, (x, w), create_graph=True)
        (gx.pow(2).sum() + gw.sin().sum()).backward()
        return y, gx, gw, x.grad, w.grad

    run_both(case, under_tba)


def test_create_graph_backward_inside_a_step_matches_stock(under_tba):
    """The gradient's own graph saves its tensors inside a second step."""

    def case(fwd):
        x = torch.randn(6, requires_grad=True)
        with fwd():
            y = (x.exp() * x.sin()).sum()
        with fwd():
            (gx,) = torch.autograd.grad(y, x, create_graph=True)
            z = (gx * gx.cos()).sum()
        z.backward()
        return gx, x.grad

    run_both(case, under_tba)


def test_backward_create_graph_leaves_differentiable_grad_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, requires_grad=True)
        with fwd():
            loss = ((x * w).sigmoid() ** 2).sum()
        loss.backward(create_graph=True)
        assert x.grad.requires_grad and x.grad.grad_fn is not None
        (gw,) = torch.autograd.grad(x.grad.sum(), w)
        return x.grad.detach(), w.grad.detach(), gw

    run_both(case, under_tba)


def test_third_derivative_matches_stock(under_tba):
    def case(fwd):
        x = torch.linspace(-2, 2, 7, dtype=torch.float64, requires_grad=True)
        with fwd():
            y = (x.sin() * x.exp()).sum()
            (g1,) = torch.autograd.grad(y, x, create_graph=True)
            (g2,) = torch.autograd.grad(g1.sum(), x, create_graph=True)
        (g3,) = torch.autograd.grad(g2.sum(), x)
        return g1, g2, g3

    run_both(case, under_tba)


def test_functional_hessian_inside_a_step_matches_stock(under_tba):
    def f(x):
        return (x.pow(3) * x.flip(0)).sum() + x.softmax(0).log().sum()

    def case(fwd):
        x = torch.randn(5, dtype=torch.float64)
        with fwd():
            h = torch.autograd.functional.hessian(f, x)
            _, hv = torch.autograd.functional.hvp(f, x, torch.ones(5, dtype=torch.float64))
        return h, hv

    run_both(case, under_tba)


def test_gradient_penalty_matches_stock(under_tba):
    """A WGAN-GP style penalty: the norm of an input gradient, trained through."""

    def case(fwd):
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        x = torch.randn(6, 4, requires_grad=True)
        with fwd():
            out = net(x).sum()
        (gx,) = torch.autograd.grad(out, x, create_graph=True)
        penalty = ((gx.norm(dim=1) - 1) ** 2).mean()
        penalty.backward()
        return gx, [p.grad for p in net.parameters()]

    run_both(case, under_tba)


def test_double_backward_without_create_graph_raises_like_stock(under_tba):
    """A gradient computed without ``create_graph`` has no graph: differentiating it raises."""

    def case(fwd):
        x = torch.randn(4, requires_grad=True)
        with fwd():
            y = x.exp().sum()
        (gx,) = torch.autograd.grad(y, x)
        return torch.autograd.grad(gx.sum(), x)

    run_both(case, under_tba, raises=RuntimeError)
