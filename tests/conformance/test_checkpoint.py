"""``torch.utils.checkpoint.checkpoint`` (reentrant and not) inside tba's step, tba's step
inside a checkpointed function, nested checkpoints, and the checkpoint's own errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from .conftest import run_both

REENTRANT = pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])


def block(x, w):
    return (torch.nn.functional.gelu(x @ w) * x).softmax(-1)


def weights():
    return torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)


@REENTRANT
def test_checkpoint_inside_a_step_matches_stock(under_tba, reentrant):
    def case(fwd):
        x = torch.randn(3, 4, requires_grad=True)
        w1, w2 = weights()
        with fwd():
            h = x.sin()
            h = checkpoint(block, h, w1, use_reentrant=reentrant)
            h = checkpoint(block, h, w2, use_reentrant=reentrant)
            loss = (h * h.cos()).sum()
        loss.backward()
        return loss, x.grad, w1.grad, w2.grad

    run_both(case, under_tba)


@REENTRANT
def test_step_inside_a_checkpointed_function_matches_stock(under_tba, reentrant):
    def case(fwd):
        x = torch.randn(3, 4, requires_grad=True)
        w1, w2 = weights()

        def stepped(h, w):
            with fwd():
                return block(h, w)

        with fwd():
            h = x.exp()
        h = checkpoint(stepped, h, w1, use_reentrant=reentrant)
        loss = block(h, w2).sum()
        loss.backward()
        return loss, x.grad, w1.grad, w2.grad

    run_both(case, under_tba)


def test_nested_non_reentrant_checkpoints_inside_a_step_match_stock(under_tba):
    def case(fwd):
        x = torch.randn(3, 4, requires_grad=True)
        w1, w2 = weights()

        def outer(h):
            h = checkpoint(block, h, w1, use_reentrant=False)
            return block(h, w2)

        with fwd():
            loss = checkpoint(outer, x * 2, use_reentrant=False).sum()
        loss.backward()
        return loss, x.grad, w1.grad, w2.grad

    run_both(case, under_tba)


@REENTRANT
def test_checkpoint_with_random_ops_matches_stock(under_tba, reentrant):
    """The recompute replays the forward's RNG state (preserve_rng_state)."""

    def case(fwd):
        x = torch.randn(8, 6, requires_grad=True)

        def noisy(h):
            return torch.nn.functional.dropout(h.exp(), p=0.5, training=True) * h

        with fwd():
            loss = checkpoint(noisy, x, use_reentrant=reentrant).sum()
        loss.backward()
        return loss, x.grad

    run_both(case, under_tba)


def test_non_reentrant_checkpoint_double_backward_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(5, dtype=torch.float64, requires_grad=True)
        with fwd():
            y = checkpoint(lambda t: (t.sin() * t.exp()).sum(), x, use_reentrant=False)
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        g.sum().backward()
        return g, x.grad

    run_both(case, under_tba)


def test_reentrant_checkpoint_refuses_autograd_grad_like_stock(under_tba):
    """Stock: a reentrant checkpoint works only with ``.backward()``."""

    def case(fwd):
        x = torch.randn(3, 4, requires_grad=True)
        w1, _ = weights()
        with fwd():
            loss = checkpoint(block, x, w1, use_reentrant=True).sum()
        return torch.autograd.grad(loss, x)

    run_both(case, under_tba, raises=RuntimeError)


def test_non_reentrant_checkpoint_backward_twice_raises_like_stock(under_tba):
    def case(fwd):
        x = torch.randn(3, 4, requires_grad=True)
        w1, _ = weights()
        with fwd():
            loss = checkpoint(block, x, w1, use_reentrant=False).sum()
        loss.backward()
        loss.backward()

    run_both(
        case, under_tba, raises=RuntimeError, phrase="backward through the graph a second time"
    )


def test_checkpointed_input_modified_in_place_raises_like_stock(under_tba):
    def case(fwd):
        x = torch.randn(3, 4, requires_grad=True)
        w1, _ = weights()
        with fwd():
            h = x * 2
            loss = checkpoint(block, h, w1, use_reentrant=False).sum()
        h.add_(1)
        loss.backward()
        return x.grad

    run_both(case, under_tba, raises=RuntimeError, phrase="modified by an inplace operation")
