"""Grad modes inside a forward: ``torch.no_grad``, ``torch.set_grad_enabled(False)``,
``torch.inference_mode()``, ``torch.enable_grad`` under ``no_grad``, and inference tensors met by
a later backward."""

from __future__ import annotations

import torch

from .conftest import run_both


def test_set_grad_enabled_false_inside_a_forward_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(5, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)
        with fwd():
            h = (x @ w).tanh()
            with torch.set_grad_enabled(False):
                scale = (h * h).sum(1, keepdim=True).sqrt()  # saves nothing, tracks nothing
            out = (h / scale).sum()
        out.backward()
        return out, scale.requires_grad, x.grad, w.grad

    run_both(case, under_tba)


def test_no_grad_then_enable_grad_inside_a_forward_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(6, requires_grad=True)
        with fwd():
            with torch.no_grad():
                a = x.exp()
                with torch.enable_grad():
                    b = x.sin() * x  # tracked again
            out = (a * b).sum()
        out.backward()
        return out, a.requires_grad, b.requires_grad, x.grad

    run_both(case, under_tba)


def test_inference_mode_inside_a_forward_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(5, 3, requires_grad=True)
        with fwd():
            with torch.inference_mode():
                stats = torch.randn(3).abs() + 1
                frozen = stats.log()
            out = (x * frozen.clone()).sigmoid().sum()
        out.backward()
        return out, frozen.is_inference(), x.grad

    run_both(case, under_tba)


def test_inference_tensor_saved_for_backward_raises_like_stock(under_tba):
    """An inference tensor cannot be saved for backward: stock refuses at the forward."""

    def case(fwd):
        x = torch.randn(5, 3, requires_grad=True)
        with torch.inference_mode():
            frozen = torch.randn(3).exp()
        with fwd():
            out = (x * frozen).sum()  # mul would save the inference tensor
        out.backward()
        return x.grad

    run_both(case, under_tba, raises=RuntimeError)


def test_step_opened_inside_inference_mode_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(4, 4)
        with torch.inference_mode(), fwd():
            y = (x @ x).softmax(-1)
        return y, y.is_inference(), y.requires_grad

    run_both(case, under_tba)


def test_step_opened_inside_no_grad_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(4, 4, requires_grad=True)
        with torch.no_grad(), fwd():
            y = (x @ x).softmax(-1)
            with torch.enable_grad():
                z = (x * x).sum()
        z.backward()
        return y, y.requires_grad, x.grad

    run_both(case, under_tba)
