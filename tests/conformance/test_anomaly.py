"""Anomaly mode: ``torch.autograd.set_detect_anomaly(True)`` and ``detect_anomaly()`` around a
forward and its backward, the NaN-in-backward error they raise, and anomaly mode's traceback of
the forward op kept on each node."""

from __future__ import annotations

import warnings

import torch

from .conftest import run_both

NAN = "returned nan values in its 0th output"


def forward(x, w):
    return ((x @ w).tanh() * x.sum(1, keepdim=True)).pow(2).mean()


def test_detect_anomaly_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(5, 4, requires_grad=True)
        w = torch.randn(4, 3, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # anomaly mode warns that it is slow
            with torch.autograd.detect_anomaly():
                with fwd():
                    loss = forward(x, w)
                loss.backward()
        return loss, x.grad, w.grad

    run_both(case, under_tba)


def test_set_detect_anomaly_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(5, 4, requires_grad=True)
        w = torch.randn(4, 3, requires_grad=True)
        with torch.autograd.set_detect_anomaly(True):
            with fwd():
                loss = forward(x, w)
            assert torch.is_anomaly_enabled()
            (gx,) = torch.autograd.grad(loss, x, create_graph=True)
            gx.sum().backward()
        return loss, gx, x.grad, w.grad

    run_both(case, under_tba)


def test_nan_in_backward_raises_like_stock(under_tba):
    """``sqrt`` at 0 gives an infinite gradient, and ``inf * 0`` a NaN: anomaly mode names the
    node that produced it."""

    def case(fwd):
        x = torch.tensor([0.0, 1.0, 4.0], requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autograd.detect_anomaly():
                with fwd():
                    y = (x.sqrt() * torch.tensor([0.0, 1.0, 1.0])).sum()
                y.backward()
        return x.grad

    run_both(case, under_tba, raises=RuntimeError, phrase=NAN)


def test_nan_in_backward_without_anomaly_mode_matches_stock(under_tba):
    def case(fwd):
        x = torch.tensor([0.0, 1.0, 4.0], requires_grad=True)
        with fwd():
            y = (x.sqrt() * torch.tensor([0.0, 1.0, 1.0])).sum()
        y.backward()
        return x.grad  # NaN where stock has NaN, bit for bit

    run_both(case, under_tba)


def test_anomaly_mode_names_the_forward_op_like_stock(under_tba):
    """With anomaly mode on, an error in backward is followed by a warning holding the
    traceback of the forward op: the same op with or without tba."""

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            raise ArithmeticError("backward of Fails")

    def case(fwd):
        x = torch.randn(3, requires_grad=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with torch.autograd.set_detect_anomaly(True):
                with fwd():
                    y = Fails.apply(x * 2).sum()
                try:
                    y.backward()
                except ArithmeticError as err:
                    caught = str(err)
        traces = [str(w.message) for w in seen if "Traceback of forward call" in str(w.message)]
        assert traces, [str(w.message) for w in seen]
        return caught, ["Fails.apply(x * 2)" in t for t in traces]

    run_both(case, under_tba)
