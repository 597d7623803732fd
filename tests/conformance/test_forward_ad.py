"""Forward-mode AD (``torch.autograd.forward_ad``: ``dual_level``, ``make_dual``,
``unpack_dual``) inside tba's step, alone and beside reverse mode, and custom Functions with a
``jvp``."""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD

from .conftest import run_both


def f(x, w):
    return ((x @ w).tanh() * x.sum(1, keepdim=True)).exp().sum(1)


def test_forward_mode_inside_a_step_matches_stock(under_tba):
    def case(fwd):
        x, w = torch.randn(4, 3), torch.randn(3, 5)
        tangent = torch.randn(4, 3)
        with fwd(), fwAD.dual_level():
            out = f(fwAD.make_dual(x, tangent), w)
            primal, jvp = fwAD.unpack_dual(out)
        return primal, jvp

    run_both(case, under_tba)


def test_forward_and_reverse_mode_together_match_stock(under_tba):
    """A dual tensor that also requires grad: the tangent and the gradient, and the gradient of
    the tangent (forward-over-reverse is reverse-over-forward here)."""

    def case(fwd):
        x = torch.randn(4, 3, requires_grad=True)
        w = torch.randn(3, 5, requires_grad=True)
        tangent = torch.randn(4, 3)
        with fwAD.dual_level():
            with fwd():
                out = f(fwAD.make_dual(x, tangent), w)
                primal, jvp = fwAD.unpack_dual(out)
            loss = primal.sum() + jvp.pow(2).sum()
            loss.backward()
        return primal, jvp, x.grad, w.grad

    run_both(case, under_tba)


def test_forward_over_reverse_hvp_matches_stock(under_tba):
    """The tangent of a gradient: a Hessian-vector product, forward over reverse."""

    def case(fwd):
        x = torch.randn(6, dtype=torch.float64, requires_grad=True)
        v = torch.randn(6, dtype=torch.float64)
        with fwAD.dual_level():
            xd = fwAD.make_dual(x, v)
            with fwd():
                y = (xd.sin() * xd.exp()).sum()
            (g,) = torch.autograd.grad(y, x, create_graph=True)
            primal, hv = fwAD.unpack_dual(g)
        return primal, hv

    run_both(case, under_tba)


def test_forward_mode_with_a_tangent_on_every_input_matches_stock(under_tba):
    """Every input has a tangent, so no node saves a ZeroTensor."""

    def case(fwd):
        x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 5, requires_grad=True)
        tx, tw = torch.randn(4, 3), torch.randn(3, 5)
        with fwAD.dual_level():
            with fwd():
                out = f(fwAD.make_dual(x, tx), fwAD.make_dual(w, tw))
                primal, jvp = fwAD.unpack_dual(out)
            (primal.sum() + jvp.pow(2).sum()).backward()
        return primal, jvp, x.grad, w.grad

    run_both(case, under_tba)


class ExpWithJvp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        ctx.save_for_forward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y

    @staticmethod
    def jvp(ctx, t):
        (y,) = ctx.saved_tensors
        return t * y


def test_custom_function_jvp_and_backward_match_stock(under_tba):
    def case(fwd):
        x = torch.randn(5, requires_grad=True)
        tangent = torch.randn(5)
        with fwAD.dual_level(), fwd():
            out = ExpWithJvp.apply(fwAD.make_dual(x * 2, tangent))
            primal, jvp = fwAD.unpack_dual(out)
        primal.sum().backward()
        return primal, jvp, x.grad

    run_both(case, under_tba)
