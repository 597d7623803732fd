"""``retain_graph=True`` and repeated backward, backward twice without it, and the selection
of what is differentiated: ``torch.autograd.grad(inputs=..., allow_unused=...)``,
``backward(inputs=...)``, ``grad_outputs`` and ``is_grads_batched``."""

from __future__ import annotations

import torch

from .conftest import run_both

TWICE = "backward through the graph a second time"


def mlp(x, w1, w2):
    return ((x @ w1).relu() @ w2).log_softmax(-1)


def params():
    x = torch.randn(5, 4)
    w1 = torch.randn(4, 6, requires_grad=True)
    w2 = torch.randn(6, 3, requires_grad=True)
    return x, w1, w2


def test_retain_graph_repeated_backward_matches_stock(under_tba):
    def case(fwd):
        x, w1, w2 = params()
        with fwd():
            loss = mlp(x, w1, w2).sum()
        seen = []
        for _ in range(3):
            loss.backward(retain_graph=True)
            seen.append((w1.grad.clone(), w2.grad.clone()))
        loss.backward()  # the last one frees the graph
        return seen, w1.grad, w2.grad

    run_both(case, under_tba)


def test_backward_twice_without_retain_graph_raises_like_stock(under_tba):
    def case(fwd):
        x, w1, w2 = params()
        with fwd():
            loss = mlp(x, w1, w2).sum()
        loss.backward()
        loss.backward()

    run_both(case, under_tba, raises=RuntimeError, phrase=TWICE)


def test_grad_twice_after_retained_one_raises_like_stock(under_tba):
    def case(fwd):
        x = torch.randn(8, requires_grad=True)
        with fwd():
            y = (x.sin() * x.cos()).sum()
        first = torch.autograd.grad(y, x, retain_graph=True)
        second = torch.autograd.grad(y, x)
        assert torch.equal(first[0], second[0])
        return torch.autograd.grad(y, x)

    run_both(case, under_tba, raises=RuntimeError, phrase=TWICE)


def test_saved_tensor_read_after_free_raises_like_stock(under_tba):
    """``grad_fn._saved_*`` reads the saved tensor; after backward freed it, that raises."""

    def case(fwd):
        x = torch.randn(4, requires_grad=True)
        with fwd():
            y = x.exp()
        y.sum().backward()
        return y.grad_fn._saved_result

    run_both(case, under_tba, raises=RuntimeError)


def test_saved_tensor_read_through_the_node_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(4, requires_grad=True)
        with fwd():
            y = x.exp()
            z = (y * 2).sin()
        first = (y.grad_fn._saved_result, z.grad_fn._saved_self)
        z.sum().backward()
        return first, x.grad

    run_both(case, under_tba)


def test_two_losses_sharing_a_graph_match_stock(under_tba):
    def case(fwd):
        x, w1, w2 = params()
        with fwd():
            out = mlp(x, w1, w2)
            a, b = out[:, 0].sum(), out.exp().mean()
        a.backward(retain_graph=True)
        ga = w1.grad.clone()
        b.backward()
        return ga, w1.grad, w2.grad

    run_both(case, under_tba)


def test_grad_with_a_subset_of_inputs_matches_stock(under_tba):
    def case(fwd):
        x, w1, w2 = params()
        with fwd():
            loss = mlp(x, w1, w2).sum()
        (g2,) = torch.autograd.grad(loss, inputs=[w2])
        return g2, w1.grad, w2.grad

    run_both(case, under_tba)


def test_backward_with_inputs_accumulates_only_those_matches_stock(under_tba):
    def case(fwd):
        x, w1, w2 = params()
        x.requires_grad_()
        with fwd():
            loss = mlp(x, w1, w2).sum()
        loss.backward(inputs=[w1, x])
        return x.grad, w1.grad, w2.grad

    run_both(case, under_tba)


def test_grad_allow_unused_matches_stock(under_tba):
    def case(fwd):
        x, w1, w2 = params()
        unused = torch.randn(3, requires_grad=True)
        with fwd():
            loss = mlp(x, w1, w2).sum()
        got = torch.autograd.grad(loss, (w1, unused, w2), allow_unused=True, retain_graph=True)
        zeros = torch.autograd.grad(loss, (unused, w2), allow_unused=True, materialize_grads=True)
        return got, zeros

    run_both(case, under_tba)


def test_grad_unused_input_raises_like_stock(under_tba):
    def case(fwd):
        x, w1, w2 = params()
        unused = torch.randn(3, requires_grad=True)
        with fwd():
            loss = mlp(x, w1, w2).sum()
        return torch.autograd.grad(loss, (w1, unused))

    run_both(case, under_tba, raises=RuntimeError)


def test_grad_outputs_for_a_nonscalar_output_match_stock(under_tba):
    def case(fwd):
        x, w1, w2 = params()
        with fwd():
            out = mlp(x, w1, w2)
        v = torch.randn_like(out)
        return torch.autograd.grad(out, (w1, w2), grad_outputs=v)

    run_both(case, under_tba)


def test_nonscalar_backward_without_grad_outputs_raises_like_stock(under_tba):
    def case(fwd):
        x, w1, w2 = params()
        with fwd():
            out = mlp(x, w1, w2)
        out.backward()

    run_both(case, under_tba, raises=RuntimeError)


def test_batched_grad_outputs_match_stock(under_tba):
    """``is_grads_batched=True`` runs the backward under vmap, unpacking each saved tensor."""

    def case(fwd):
        x, w1, w2 = params()
        with fwd():
            out = mlp(x, w1, w2)
        vs = torch.randn(3, *out.shape)
        return torch.autograd.grad(out, (w1, w2), grad_outputs=vs, is_grads_batched=True)

    run_both(case, under_tba)
