"""``torch.func`` transforms and tba's step: ``grad``, ``vjp``, ``jacrev``, ``vmap`` and
``hessian`` of a function that opens a step, and a step around a transform.

Stock's ``grad``/``vjp``/``jacrev`` refuse saved-tensor hooks (functorch cannot capture through
them), which tba's step installs. What is checked: tba does what stock does, or refuses with a
typed tba error (a ``tba.TBAError``) that names the cause; ``vmap`` alone saves nothing for a
transform, so it runs and must match stock bit for bit.
"""

from __future__ import annotations

import torch
from torch import func

import tba

from .conftest import Outcome, assert_same_outcome, outcome, run_both, stock


def same_or_refused(ref: Outcome, got: Outcome) -> None:
    """tba behaves as stock, or refuses with a typed error that names torch.func."""
    if got.error is not None and isinstance(got.error, tba.TBAError):
        assert "torch.func" in str(got.error), got.error
        return
    assert_same_outcome(ref, got)


def f(x):
    return (x.sin() * x.exp()).sum() + x.pow(3).mean()


def test_vmap_of_a_forward_inside_a_step_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(3, 5, requires_grad=True)
        with fwd():
            y = func.vmap(f)(x)
        y.sum().backward()
        return y, x.grad

    run_both(case, under_tba)


def test_step_inside_a_vmapped_function_matches_stock(under_tba):
    def case(fwd):
        w = torch.randn(5, requires_grad=True)

        def g(row):
            with fwd():
                return f(row * w)

        y = func.vmap(g)(torch.randn(3, 5))
        y.sum().backward()
        return y, w.grad

    run_both(case, under_tba)


def test_grad_of_a_forward_inside_a_step_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(5)
        with fwd():
            return func.grad(f)(x)

    same_or_refused(outcome(case, stock, 0), outcome(case, under_tba, 0))


def test_step_inside_a_function_given_to_grad_matches_stock(under_tba):
    def case(fwd):
        def g(x):
            with fwd():
                return f(x)

        return func.grad(g)(torch.randn(5))

    same_or_refused(outcome(case, stock, 0), outcome(case, under_tba, 0))


def test_jacrev_of_a_forward_inside_a_step_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(4)
        with fwd():
            return func.jacrev(lambda t: t.sin() * t.sum())(x)

    same_or_refused(outcome(case, stock, 0), outcome(case, under_tba, 0))


def test_step_inside_a_function_given_to_jacrev_matches_stock(under_tba):
    def case(fwd):
        def g(t):
            with fwd():
                return t.sin() * t.sum()

        return func.jacrev(g)(torch.randn(4))

    same_or_refused(outcome(case, stock, 0), outcome(case, under_tba, 0))


def test_vjp_inside_a_step_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(4)
        with fwd():
            out, pull = func.vjp(lambda t: t.exp() * t, x)
        return out, pull(torch.ones(4))

    same_or_refused(outcome(case, stock, 0), outcome(case, under_tba, 0))


def test_jacfwd_inside_a_step_matches_stock(under_tba):
    """Forward-mode transforms save nothing for a backward: they run through the step."""

    def case(fwd):
        x = torch.randn(4)
        with fwd():
            return func.jacfwd(lambda t: t.sin() * t.sum())(x)

    run_both(case, under_tba)


def test_vmap_of_a_step_around_a_backward_matches_stock(under_tba):
    """Per-sample losses under vmap inside the step, one ordinary backward after."""

    def case(fwd):
        w = torch.randn(5, 2, requires_grad=True)
        xs = torch.randn(4, 3, 5)
        with fwd():
            losses = func.vmap(lambda xb: (xb @ w).tanh().pow(2).sum())(xs)
        losses.sum().backward()
        return losses, w.grad

    run_both(case, under_tba)
