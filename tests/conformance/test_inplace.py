"""In-place operations and version counters: a saved tensor (an input, an output, a view, a
view's base, a parameter, a grad-requiring leaf) modified after the forward makes backward
raise; in-place operations that touch nothing saved do not."""

from __future__ import annotations

import torch

from .conftest import INPLACE, run_both, xfail_in

DATA_WRITE = (
    "listed in the README: a write through .data after the forward bypasses the version "
    "counter; stock's backward reads the new values, tba's the ones it saved (read from disk)"
)


def test_saved_input_modified_in_place_raises_like_stock(under_tba):
    def case(fwd):
        x = torch.randn(5, requires_grad=True)
        a = x * 1.5
        with fwd():
            y = a.sin().sum()  # sin saves its input
        a.add_(1)
        y.backward()
        return x.grad

    run_both(case, under_tba, raises=RuntimeError, phrase=INPLACE)


def test_saved_output_modified_in_place_raises_like_stock(under_tba):
    def case(fwd):
        x = torch.randn(5, requires_grad=True)
        with fwd():
            y = x.exp()  # exp saves its result
        y.mul_(2)
        y.sum().backward()
        return x.grad

    run_both(case, under_tba, raises=RuntimeError, phrase=INPLACE)


def test_saved_input_without_grad_modified_in_place_raises_like_stock(under_tba):
    """``x @ w`` saves ``x`` for ``w``'s gradient, though ``x`` needs none itself."""

    def case(fwd):
        x = torch.randn(4, 3)
        w = torch.randn(3, 2, requires_grad=True)
        with fwd():
            y = (x @ w).sum()
        x.mul_(2)
        y.backward()
        return w.grad

    run_both(case, under_tba, raises=RuntimeError, phrase=INPLACE)


def test_view_of_a_saved_tensor_modified_in_place_raises_like_stock(under_tba):
    def case(fwd):
        x = torch.randn(4, 3, requires_grad=True)
        a = x * 2
        with fwd():
            y = a.sigmoid()  # saves its result
        y[1].zero_()  # the view shares y's version counter
        y.sum().backward()
        return x.grad

    run_both(case, under_tba, raises=RuntimeError, phrase=INPLACE)


def test_base_of_a_saved_view_modified_in_place_raises_like_stock(under_tba):
    def case(fwd):
        x = torch.randn(4, 3, requires_grad=True)
        a = x * 2
        with fwd():
            col = a[:, 1]
            y = col.sin().sum()  # saves the view
        del col
        a.add_(1)
        y.backward()
        return x.grad

    run_both(case, under_tba, raises=RuntimeError, phrase=INPLACE)


def test_saved_leaf_modified_under_no_grad_raises_like_stock(under_tba):
    def case(fwd):
        x = torch.randn(4, 3)
        w = torch.randn(3, 2, requires_grad=True)
        with fwd():
            y = (x.exp() @ w).sum()  # mm saves w for x's gradient... and x.exp() for w's
            z = (w * w).sum()  # mul saves w itself
        with torch.no_grad():
            w.mul_(10)
        (y + z).backward()
        return w.grad

    run_both(case, under_tba, raises=RuntimeError, phrase=INPLACE)


def test_optimizer_step_between_forward_and_backward_raises_like_stock(under_tba):
    """``nn.Linear`` saves ``weight.t()`` (addmm): ``SGD.step()`` modifies it in place."""

    def case(fwd):
        lin = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        x = torch.randn(5, 4, requires_grad=True)
        for p in lin.parameters():
            p.grad = torch.ones_like(p)
        with fwd():
            loss = lin(x).tanh().sum()
        opt.step()
        loss.backward()
        return x.grad

    run_both(case, under_tba, raises=RuntimeError, phrase=INPLACE)


def test_view_of_a_saved_parameter_modified_in_place_raises_like_stock(under_tba):
    def case(fwd):
        lin = torch.nn.Linear(4, 3)
        x = torch.randn(5, 4, requires_grad=True)
        with fwd():
            loss = lin(x).sum()
        with torch.no_grad():
            lin.weight[0].add_(1)  # a view of the weight, whose .t() addmm saved
        loss.backward()
        return x.grad

    run_both(case, under_tba, raises=RuntimeError, phrase=INPLACE)


def test_in_place_on_a_tensor_nothing_saved_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(5, requires_grad=True)
        c = torch.randn(5)
        with fwd():
            a = x.exp()  # saves a
            b = a + c  # add saves nothing
        b.add_(1)  # in place on a tensor no node saved
        c.mul_(3)  # and on a constant only add used
        (b * 1).sum().backward()
        return b, x.grad, a._version, b._version

    run_both(case, under_tba)


def test_saved_result_modified_inside_the_forward_raises_like_stock(under_tba):
    def case(fwd):
        x = torch.randn(6, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)
        with fwd():
            h = x @ w
            h.relu_()  # relu_ saves its result
            h.mul_(2)  # and then it is modified: relu's backward must raise
            g = (x @ w).sigmoid_()
            g = g * 3  # ok: the in-place sigmoid's result is not modified afterwards
            loss = h.sum() + g.sum()
        loss.backward()
        return x.grad, w.grad

    run_both(case, under_tba, raises=RuntimeError, phrase=INPLACE)


def test_correct_in_place_ops_inside_the_forward_match_stock(under_tba):
    def case(fwd):
        x = torch.randn(6, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)
        with fwd():
            h = x @ w  # mm does not save its output
            h[:, :2].mul_(0.5)  # in place on a view, before anything saves h
            h.add_(1).relu_()  # relu_ saves its result, which nothing modifies afterwards
            loss = (h * h).sum()
        loss.backward()
        return loss, x.grad, w.grad, h._version

    run_both(case, under_tba)


def test_in_place_on_a_leaf_requiring_grad_raises_like_stock(under_tba):
    def case(fwd):
        x = torch.randn(5, requires_grad=True)
        with fwd():
            x.add_(1)

    run_both(case, under_tba, raises=RuntimeError)


def test_modified_between_retained_backwards_raises_like_stock(under_tba):
    def case(fwd):
        x = torch.randn(5, requires_grad=True)
        a = x * 2
        with fwd():
            y = (a * a).sum()  # saves a (twice)
        y.backward(retain_graph=True)
        first = x.grad.clone()
        a.add_(1)
        y.backward()
        return first, x.grad

    run_both(case, under_tba, raises=RuntimeError, phrase=INPLACE)


def test_change_through_data_of_a_saved_base_matches_stock(under_tba, request):
    """``.data`` writes bypass the version counter: stock's backward silently uses the new
    values of a saved view of the base (its storage is the base's)."""

    def case(fwd):
        x = torch.randn(8, 20, requires_grad=True)
        a = x * 2
        with fwd():
            v = a[:2, :2]  # a small, non-dense window of a
            y = (v * v).sum()  # saves the view
        del v
        a.data.mul_(3)
        y.backward()
        return x.grad

    xfail_in(request, under_tba, "everything", DATA_WRITE)
    run_both(case, under_tba)


def test_version_counters_after_forward_match_stock(under_tba):
    def case(fwd):
        x = torch.randn(5, requires_grad=True)
        with fwd():
            a = x * 1
            a.add_(2).mul_(3)
            b = a.exp()
        return a._version, b._version, x._version, b

    run_both(case, under_tba)
