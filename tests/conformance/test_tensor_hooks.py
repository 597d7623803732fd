"""Gradient hooks: ``Tensor.register_hook`` on inputs, intermediates and outputs,
``retain_grad``, ``grad_fn.register_hook`` / ``register_prehook``,
``register_post_accumulate_grad_hook`` and module backward hooks."""

from __future__ import annotations

import torch

from .conftest import run_both


def net(x, w):
    h = (x @ w).sigmoid()
    return h, (h * h.flip(0)).sum()


def test_hooks_on_input_intermediate_and_output_match_stock(under_tba):
    def case(fwd):
        x = torch.randn(4, 3, requires_grad=True)
        w = torch.randn(3, 5, requires_grad=True)
        seen = []
        x.register_hook(lambda g: g * 2)
        with fwd():
            h, out = net(x, w)
            h.register_hook(lambda g: seen.append(g.clone()))
            h.register_hook(lambda g: g.clamp(min=-0.1))  # hooks run in order; this one replaces
            out.register_hook(lambda g: g * 3)
        out.backward()
        return seen, x.grad, w.grad

    run_both(case, under_tba)


def test_retain_grad_of_an_intermediate_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(4, 3, requires_grad=True)
        w = torch.randn(3, 5, requires_grad=True)
        with fwd():
            h, out = net(x, w)
            h.retain_grad()
        out.backward()
        return h.grad, x.grad, w.grad

    run_both(case, under_tba)


def test_node_hook_and_prehook_match_stock(under_tba):
    def case(fwd):
        x = torch.randn(4, 3, requires_grad=True)
        w = torch.randn(3, 5, requires_grad=True)
        log = []
        with fwd():
            h, out = net(x, w)
            node = h.grad_fn  # SigmoidBackward0: saves its result

            def pre(grad_outputs):
                log.append(("pre", [g.clone() for g in grad_outputs]))
                return (grad_outputs[0] * 0.5,)

            def post(grad_inputs, grad_outputs):
                log.append(("post", [g.clone() for g in grad_inputs]))
                return tuple(g + 1 for g in grad_inputs)

            node.register_prehook(pre)
            node.register_hook(post)
        out.backward()
        return log, x.grad, w.grad

    run_both(case, under_tba)


def test_post_accumulate_grad_hook_matches_stock(under_tba):
    """An optimizer step inside backward: each parameter is updated as its grad lands."""

    def case(fwd):
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.Linear(6, 2))
        order = []

        def step(p):
            order.append(tuple(p.shape))
            with torch.no_grad():
                p.add_(p.grad, alpha=-0.1)
            p.grad = None

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step)
        x = torch.randn(3, 4)
        with fwd():
            loss = model(x).pow(2).sum()
        loss.backward()
        return order, [p.detach().clone() for p in model.parameters()]

    run_both(case, under_tba)


def test_hook_that_raises_propagates_like_stock(under_tba):
    def case(fwd):
        x = torch.randn(4, 3, requires_grad=True)
        w = torch.randn(3, 5, requires_grad=True)

        def bad(g):
            raise ValueError("hook refused the gradient")

        with fwd():
            h, out = net(x, w)
            h.register_hook(bad)
        out.backward()

    run_both(case, under_tba, raises=ValueError)


def test_module_full_backward_hooks_match_stock(under_tba):
    def case(fwd):
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        seen = []
        model[1].register_full_backward_pre_hook(lambda m, go: seen.append(go[0].clone()))
        model[1].register_full_backward_hook(
            lambda m, gi, go: (gi[0] * 2,)  # doubles what flows back into the first layer
        )
        x = torch.randn(5, 3, requires_grad=True)
        with fwd():
            loss = model(x).sum()
        loss.backward()
        return seen, x.grad, [p.grad for p in model.parameters()]

    run_both(case, under_tba)
