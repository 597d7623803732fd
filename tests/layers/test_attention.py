"""softmax_dropout_matmul: exact gradients from P, a 1-bit mask and V."""

import math

import pytest
import torch
import torch.nn.functional as F

import tba.layers as L

from ._support import saved_bytes

SHAPE = (2, 3, 9, 11)  # batch, heads, S_q, S_k: odd sizes exercise the packing tail


def inputs(dtype=torch.float32, d=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(SHAPE, generator=gen, dtype=dtype) * 2
    v = torch.randn(*SHAPE[:-2], SHAPE[-1], d, generator=gen, dtype=dtype)
    return scores, v


def run(scores, v, p, seed, **kw):
    gen = torch.Generator().manual_seed(seed)
    return L.softmax_dropout_matmul(scores, v, p, True, generator=gen, **kw)


def mask_for(p, seed):
    """The mask the op draws, read back through an identity V: out = P * m / (1 - p)."""
    scores, _ = inputs()
    eye = torch.eye(SHAPE[-1]).expand(*SHAPE[:-2], -1, -1)
    return run(scores, eye, p, seed) != 0


def reference(scores, v, p, mask):
    probs = F.softmax(scores, dim=-1)
    if mask is not None:
        probs = probs * mask / (1 - p)
    return probs @ v


@pytest.mark.parametrize("training", [True, False])
def test_no_dropout_matches_softmax_matmul(training):
    scores, v = inputs()
    p = 0.0 if training else 0.5  # p is ignored when not training
    s1, v1 = scores.clone().requires_grad_(), v.clone().requires_grad_()
    s2, v2 = scores.clone().requires_grad_(), v.clone().requires_grad_()
    out1 = L.softmax_dropout_matmul(s1, v1, p, training)
    out2 = reference(s2, v2, 0.0, None)
    assert torch.equal(out1, out2)
    dy = torch.randn_like(out1)
    for a, b in zip(
        torch.autograd.grad(out1, [s1, v1], dy), torch.autograd.grad(out2, [s2, v2], dy)
    ):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("regenerate", [False, True])
def test_dropout_gradients_match_autograd_with_the_same_mask(regenerate):
    p, seed = 0.3, 7
    mask = mask_for(p, seed)
    assert 0.55 < mask.float().mean() < 0.85  # keeps about 1 - p
    scores, v = inputs()
    s1, v1 = scores.clone().requires_grad_(), v.clone().requires_grad_()
    s2, v2 = scores.clone().requires_grad_(), v.clone().requires_grad_()
    out1 = run(s1, v1, p, seed, regenerate_mask=regenerate)
    out2 = reference(s2, v2, p, mask)
    assert torch.allclose(out1, out2, rtol=1e-5, atol=1e-6)
    dy = torch.randn_like(out1)
    for a, b in zip(
        torch.autograd.grad(out1, [s1, v1], dy), torch.autograd.grad(out2, [s2, v2], dy)
    ):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_saved_and_regenerated_masks_give_identical_results():
    scores, v = inputs()
    results = []
    for regenerate in (False, True):
        s, vv = scores.clone().requires_grad_(), v.clone().requires_grad_()
        out = run(s, vv, 0.2, 3, regenerate_mask=regenerate)
        out.backward(torch.ones_like(out))
        results.append((out, s.grad, vv.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_global_seed_reproduces_the_mask():
    scores, v = inputs()
    torch.manual_seed(11)
    a = L.softmax_dropout_matmul(scores, v, 0.5, True)
    torch.manual_seed(11)
    b = L.softmax_dropout_matmul(scores, v, 0.5, True)
    assert torch.equal(a, b)


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_gradcheck_float64(p):
    scores, v = inputs(torch.float64, d=3)
    scores = scores[:1, :2, :4, :5].clone().requires_grad_()
    v = v[:1, :2, :5].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda s, vv: run(s, vv, p, 5), (scores, v))
    assert torch.autograd.gradcheck(
        lambda s, vv: run(s, vv, p, 5, regenerate_mask=True), (scores, v)
    )


def test_causal_mask_with_minus_inf():
    scores, v = inputs()
    causal = torch.ones(SHAPE[-2], SHAPE[-1], dtype=torch.bool).triu(1)
    scores = scores.masked_fill(causal, float("-inf")).requires_grad_()
    out = run(scores, v, 0.1, 1)
    out.sum().backward()
    assert torch.isfinite(scores.grad).all()
    assert (scores.grad[..., causal] == 0).all()


def test_saved_bytes_match_the_formula():
    scores, v = inputs()
    scores.requires_grad_()
    v.requires_grad_()
    a, b = scores.numel(), 4
    v_bytes = v.numel() * b
    fused = saved_bytes(lambda: run(scores, v, 0.1, 0))
    regen = saved_bytes(lambda: run(scores, v, 0.1, 0, regenerate_mask=True))
    no_drop = saved_bytes(lambda: L.softmax_dropout_matmul(scores, v, 0.1, False))
    assert fused == a * b + math.ceil(a / 8) + v_bytes  # P, packed mask, V
    assert regen == a * b + v_bytes  # P, V (the seed is a Python int)
    assert no_drop == a * b + v_bytes
    stock = saved_bytes(lambda: F.dropout(F.softmax(scores, -1), 0.1, True) @ v)
    # The stock chain also keeps P_d (a * b) and a mask or noise tensor of at least a bytes.
    assert stock - fused >= a * b + a - math.ceil(a / 8)


def test_errors_are_typed_and_pinned():
    scores, v = inputs()
    with pytest.raises(L.LayerOptionError, match=r"p=1.0 is outside \[0, 1\)"):
        L.softmax_dropout_matmul(scores, v, 1.0)
    with pytest.raises(L.LayerOptionError, match=r"p=-0.1 is outside \[0, 1\)"):
        L.softmax_dropout_matmul(scores, v, -0.1)
    with pytest.raises(L.LayerShapeError, match=r"must both be \(\.\.\., S_q, S_k\)"):
        L.softmax_dropout_matmul(scores, v[0])
    with pytest.raises(L.LayerShapeError, match=r"do not fit v \(2, 3, 10, 5\)"):
        L.softmax_dropout_matmul(scores, v[:, :, :10])
    with pytest.raises(L.LayerShapeError, match=r"scores are torch.float32 but v is torch.float64"):
        L.softmax_dropout_matmul(scores, v.double())
