"""Tensors that are not plain dense float: sparse COO, complex, nested (jagged) and zero-size
tensors, and unusual strides: non-contiguous, transposed, expanded (stride 0), ``as_strided``
with overlapping elements, channels-last and storage offsets."""

from __future__ import annotations

import pytest
import torch

from .conftest import run_both

# -- sparse --------------------------------------------------------------------------------------


def sparse_input():
    i = torch.tensor([[0, 1, 3, 3], [2, 0, 1, 4]])
    v = torch.randn(4)
    return torch.sparse_coo_tensor(i, v, (4, 5)).coalesce().requires_grad_()


def test_sparse_matmul_matches_stock(under_tba):
    def case(fwd):
        s = sparse_input()
        d = torch.randn(5, 3, requires_grad=True)
        with fwd():
            out = torch.sparse.mm(s, d).tanh().sum()
        out.backward()
        return out, s.grad, d.grad

    run_both(case, under_tba)


def test_sparse_to_dense_and_sum_match_stock(under_tba):
    def case(fwd):
        s = sparse_input()
        with fwd():
            dense = (s * 2).to_dense()
            out = (dense.sin() * dense).sum() + torch.sparse.sum(s * s)
        out.backward()
        return out, s.grad

    run_both(case, under_tba)


def test_sparse_embedding_grad_matches_stock(under_tba):
    def case(fwd):
        emb = torch.nn.Embedding(10, 4, sparse=True)
        idx = torch.tensor([[1, 2, 2], [7, 0, 9]])
        with fwd():
            out = emb(idx).relu().pow(2).sum()
        out.backward()
        return out, emb.weight.grad

    run_both(case, under_tba)


# -- complex -------------------------------------------------------------------------------------


def cplx(*shape):
    return torch.randn(*shape, dtype=torch.complex64, requires_grad=True)


def test_complex_matmul_matches_stock(under_tba):
    def case(fwd):
        a, b = cplx(4, 3), cplx(3, 5)
        with fwd():
            out = (a @ b).abs().sum()
        out.backward()
        return out, a.grad, b.grad

    run_both(case, under_tba)


def test_complex_abs_angle_and_conj_match_stock(under_tba):
    def case(fwd):
        z = cplx(6)
        with fwd():
            c = z.conj()  # a lazy conjugate view, saved by the mul below
            out = (z.abs() * z.angle()).sum() + (c * z.exp()).real.sum()
        out.backward()
        return out, z.grad

    run_both(case, under_tba)


def test_complex_views_as_real_match_stock(under_tba):
    def case(fwd):
        z = cplx(3, 4)
        with fwd():
            r = torch.view_as_real(z * 2)
            back = torch.view_as_complex(r.sin().contiguous())
            out = (back * back).real.sum() + torch.fft.fft(z).abs().sum()
        out.backward()
        return out, z.grad

    run_both(case, under_tba)


def test_conj_view_saved_beside_its_base_matches_stock(under_tba):
    """``b * b.conj()`` saves ``b`` and its lazy conjugate: one storage, one geometry."""

    def case(fwd):
        z = cplx(5)
        with fwd():
            b = z * 2
            out = (b * b.conj()).real.sum()
        out.backward()
        return out, z.grad

    run_both(case, under_tba)


def test_neg_view_saved_beside_its_base_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(5, requires_grad=True)
        with fwd():
            b = x * 2
            out = (b * torch._neg_view(b)).sum()
        out.backward()
        return out, x.grad

    run_both(case, under_tba)


# -- nested --------------------------------------------------------------------------------------


def test_nested_tensor_ops_match_stock(under_tba):
    def case(fwd):
        parts = [torch.randn(2, 4), torch.randn(3, 4)]
        nt = torch.nested.nested_tensor(parts, requires_grad=True)
        w = torch.randn(3, 4, requires_grad=True)
        with fwd():
            h = torch.nn.functional.gelu(torch.nn.functional.linear(nt, w))
            att = torch.matmul(h, h.transpose(-1, -2)).softmax(-1)
            out = torch.nested.to_padded_tensor((att * att).sin(), 0.0).sum()
        out.backward()
        return out, nt.grad, w.grad

    run_both(case, under_tba)


def test_jagged_nested_tensor_ops_match_stock(under_tba):
    def case(fwd):
        parts = [torch.randn(2, 4), torch.randn(3, 4)]
        nt = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True)
        w = torch.randn(4, 3, requires_grad=True)
        with fwd():
            h = torch.nn.functional.linear(nt, w.t()).sin()
            out = (h * h).values().sum()
        out.backward()
        return out, nt.grad, w.grad

    run_both(case, under_tba)


# -- zero-size -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0,), (0, 3), (4, 0), (2, 0, 5)])
def test_zero_size_tensors_match_stock(under_tba, shape):
    def case(fwd):
        x = torch.randn(*shape, requires_grad=True)
        w = torch.randn(shape[-1], 2, requires_grad=True)
        with fwd():
            y = x.exp() * x.sin()
            z = (y @ w).sum() if x.dim() > 1 else y.sum()
        z.backward()
        return y, z, x.grad, w.grad

    run_both(case, under_tba)


def test_zero_tensor_saved_for_backward_matches_stock(under_tba):
    """``torch._efficientzerotensor``: a zero of any shape with no storage, which autograd
    makes for missing tangents and gradients."""

    def case(fwd):
        x = torch.randn(4, 3, requires_grad=True)
        z = torch._efficientzerotensor((3, 5))
        with fwd():
            y = (x @ z).sum() + x.sin().sum()  # mm saves z for x's gradient
        y.backward()
        return y, x.grad

    run_both(case, under_tba)


# -- strides -------------------------------------------------------------------------------------


def test_transposed_and_non_contiguous_inputs_match_stock(under_tba):
    def case(fwd):
        base = torch.randn(6, 8, requires_grad=True)
        with fwd():
            t = base.t()  # saved transposed
            nc = base[:, ::2]  # saved with a step
            y = (t.exp() @ nc).sin()
            out = (y * y).sum() + (nc * nc).sum() + (t * t.sin()).sum()
        out.backward()
        return y, out, base.grad

    run_both(case, under_tba)


def test_expanded_stride_zero_input_matches_stock(under_tba):
    def case(fwd):
        row = torch.randn(1, 5, requires_grad=True)
        col = torch.randn(4, 1)
        with fwd():
            e = (row * 2).expand(4, 5)  # stride 0 in dim 0
            c = col.expand(4, 5)
            y = (e * c).sin() * e
            out = (y * y).sum()
        out.backward()
        return y, out, row.grad, e.stride(), c.stride()

    run_both(case, under_tba)


def test_as_strided_overlapping_input_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(10, requires_grad=True)
        with fwd():
            a = x * 3
            win = a.as_strided((4, 4), (2, 1))  # overlapping windows of a
            y = (win.exp() * win).sum(1)
            z = (y * win[:, 0]).sum()
        z.backward()
        return y, z, x.grad

    run_both(case, under_tba)


def test_as_strided_of_a_leaf_matches_stock(under_tba):
    def case(fwd):
        x = torch.randn(12, requires_grad=True)
        with fwd():
            win = x.as_strided((3, 5), (3, 1), 1)
            out = (win.tanh() * win.cos()).sum()
        out.backward()
        return out, x.grad

    run_both(case, under_tba)


def test_channels_last_conv_matches_stock(under_tba):
    def case(fwd):
        conv = torch.nn.Conv2d(3, 4, 3, padding=1).to(memory_format=torch.channels_last)
        x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last).requires_grad_()
        with fwd():
            h = conv(x).relu()
            out = (h * h).mean()
        out.backward()
        return h, x.grad, conv.weight.grad, conv.bias.grad

    run_both(case, under_tba)


def test_views_at_storage_offsets_match_stock(under_tba):
    """q, k, v as views of one storage at different offsets, transposed for attention."""

    def case(fwd):
        x = torch.randn(2, 5, 12, requires_grad=True)
        w = torch.randn(12, 36, requires_grad=True)
        with fwd():
            q, k, v = (x @ w).split(12, dim=-1)
            att = (q @ k.transpose(-2, -1) / 12**0.5).softmax(-1)
            out = (att @ v).sum()
        out.backward()
        return out, x.grad, w.grad

    run_both(case, under_tba)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int64])
def test_other_dtypes_match_stock(under_tba, dtype):
    def case(fwd):
        x = torch.randn(4, 6, requires_grad=True)
        idx = torch.randint(0, 6, (4, 3)).to(dtype) if not dtype.is_floating_point else None
        with fwd():
            if idx is None:
                h = x.to(dtype)
                y = (h * h.sigmoid()).float().sum()
            else:
                y = (x.gather(1, idx.long()) * idx.to(x.dtype)).sum()
        y.backward()
        return y, x.grad

    run_both(case, under_tba)
