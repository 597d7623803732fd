"""Custom ``torch.autograd.Function``s: ``save_for_backward`` of inputs, outputs and
intermediates, ``ctx.mark_dirty``, ``ctx.mark_non_differentiable``, ``once_differentiable``,
the ``setup_context`` style, ``ctx.saved_tensors`` read twice, and differentiable backwards."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .conftest import run_both


class ScaledTanh(torch.autograd.Function):
    """Saves an input, an intermediate and the output, and reads them twice in backward."""

    @staticmethod
    def forward(ctx, x, w):
        pre = x @ w
        out = pre.tanh()
        ctx.save_for_backward(x, w, pre, out)
        return out

    @staticmethod
    def backward(ctx, g):
        x, w, pre, out = ctx.saved_tensors
        again = ctx.saved_tensors  # a second read unpacks every saved tensor again
        assert all(torch.equal(a, b) for a, b in zip((x, w, pre, out), again))
        gp = g * (1 - out * out) + 0 * pre
        return gp @ w.t(), x.t() @ gp


def test_save_inputs_outputs_intermediates_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(5, 4, requires_grad=True)
        w = torch.randn(4, 3, requires_grad=True)
        with fwd():
            y = ScaledTanh.apply(x, w).pow(2).sum()
        y.backward()
        return y, x.grad, w.grad

    run_both(case, under_tba)


class Cube(torch.autograd.Function):
    """``setup_context`` style, with a backward that is itself differentiable."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x * x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        ctx.save_for_backward(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * g * x * x


def test_setup_context_style_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(7, dtype=torch.float64, requires_grad=True)
        with fwd():
            y = Cube.apply(x.sin()).sum()
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
        gx.sum().backward()
        return y, gx, x.grad

    run_both(case, under_tba)


def test_setup_context_style_under_vmap_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(3, 4, requires_grad=True)
        with fwd():
            y = torch.func.vmap(Cube.apply)(x.cos())
        y.sum().backward()
        return y, x.grad

    run_both(case, under_tba)


class DoubleInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def test_mark_dirty_matches_stock(under_tba):
    def case(fwd):
        a = torch.randn(6, requires_grad=True)
        with fwd():
            b = a.exp()  # exp saves its output, which the function then modifies in place
            c = DoubleInPlace.apply(b.clone())
            d = (c * b).sum()
        d.backward()
        return d, a.grad

    run_both(case, under_tba)


def test_mark_dirty_on_a_saved_tensor_raises_like_stock(under_tba):
    def case(fwd):
        a = torch.randn(6, requires_grad=True)
        with fwd():
            b = a.exp()  # saves b
            c = DoubleInPlace.apply(b)  # modifies it in place
        c.sum().backward()
        return a.grad

    run_both(case, under_tba, raises=RuntimeError, phrase="modified by an inplace operation")


class SortWithIndices(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        values, idx = x.sort(dim=-1)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(idx)
        return values, idx

    @staticmethod
    def backward(ctx, g_values, g_idx):
        (idx,) = ctx.saved_tensors
        return torch.zeros_like(g_values).scatter(-1, idx, g_values)


def test_mark_non_differentiable_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(3, 5, requires_grad=True)
        with fwd():
            values, idx = SortWithIndices.apply(x * 3)
            loss = (values * torch.arange(5.0)).sum()
        loss.backward()
        return values, idx, idx.requires_grad, x.grad

    run_both(case, under_tba)


class OnceExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


def test_once_differentiable_backward_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(5, requires_grad=True)
        with fwd():
            y = OnceExp.apply(x * 2).sum()
        y.backward()
        return x.grad

    run_both(case, under_tba)


def test_once_differentiable_double_backward_raises_like_stock(under_tba):
    def case(fwd):
        x = torch.randn(5, requires_grad=True)
        with fwd():
            y = OnceExp.apply(x * 2).sum()
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
        gx.sum().backward()
        return x.grad

    run_both(case, under_tba, raises=RuntimeError)


class SavesAView(torch.autograd.Function):
    """Saves a view of its input next to the input, and ``None``."""

    @staticmethod
    def forward(ctx, x):
        head = x[:, :2]
        ctx.save_for_backward(x, head, None)
        ctx.scale = 3.0
        return (x * 2).sum(1) + head.sum(1) * ctx.scale

    @staticmethod
    def backward(ctx, g):
        x, head, none = ctx.saved_tensors
        assert none is None and head.shape == (x.shape[0], 2)
        grad = torch.full_like(x, 2.0) * g[:, None]
        grad[:, :2] += ctx.scale * g[:, None] + 0 * head
        return grad


def test_saving_a_view_and_none_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(4, 5, requires_grad=True)
        with fwd():
            y = SavesAView.apply(x.exp())
        y.sum().backward()
        return y, x.grad

    run_both(case, under_tba)


class NeedsInputGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = g * b if ctx.needs_input_grad[0] else None
        gb = g * a if ctx.needs_input_grad[1] else None
        return ga, gb


def test_needs_input_grad_matches_stock(under_tba):
    def case(fwd):
        a = torch.randn(6, requires_grad=True)
        b = torch.randn(6)
        with fwd():
            y = NeedsInputGrad.apply(a.sin(), b.cos()).sum()
        y.backward()
        return a.grad, b.grad

    run_both(case, under_tba)


def test_saved_tensors_read_after_backward_raises_like_stock(under_tba):
    def case(fwd):
        x = torch.randn(4, 3, requires_grad=True)
        w = torch.randn(3, 2, requires_grad=True)
        with fwd():
            y = ScaledTanh.apply(x, w)
        node = y.grad_fn
        y.sum().backward()
        return node.saved_tensors

    run_both(
        case, under_tba, raises=RuntimeError, phrase="backward through the graph a second time"
    )


def test_saved_tensors_read_from_the_node_before_backward_match_stock(under_tba):
    def case(fwd):
        x = torch.randn(4, 3, requires_grad=True)
        w = torch.randn(3, 2, requires_grad=True)
        with fwd():
            y = ScaledTanh.apply(x * 1.5, w)
        first = y.grad_fn.saved_tensors
        y.sum().backward()
        return first, x.grad, w.grad

    run_both(case, under_tba)
