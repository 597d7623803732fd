"""`softmax_dropout_matmul`: ``dropout(softmax(scores)) @ v`` that keeps P, a 1-bit mask and V.

The unfused chain keeps P (saved by softmax), the dropout mask or noise (a bool byte per element
on CUDA, a full float tensor on CPU), P_d = dropout(P) (saved by the matmul) and V. The fused op
keeps P, the mask packed 8 per byte (``ceil(a / 8)`` bytes) and V, so it saves at least
``a * b + a - ceil(a / 8)`` bytes against the CUDA chain (``a`` = elements of ``scores``).
With ``regenerate_mask=True`` it keeps no mask at all, only a 63-bit seed (a Python int).

NOTE [Fused attention backward] (exact, no approximation)
  P_d = P * m / (1 - p);  dV = P_d^T G;  dP_d = G V^T;  dP = dP_d * m / (1 - p);
  dS = P * (dP - rowsum(dP * P)).
The mask is drawn on the scores' device from a private ``torch.Generator`` seeded with 63 bits
taken from the CPU ``generator`` (default: the CPU default generator), as
``rand(scores.shape) >= p``. Both modes
draw it the same way, so they give identical results for the same RNG state, and backward can
regenerate it bit for bit. The mask therefore differs from the one ``F.dropout`` would draw.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._errors import LayerOptionError, LayerShapeError
from ._packing import pack_bits, unpack_bits

__all__ = ["softmax_dropout_matmul"]

_SEED_BITS = 63


def _draw_seed(generator: torch.Generator | None) -> int:
    # Drawn on the CPU so that reading it back never waits for a device.
    return int(torch.randint((1 << _SEED_BITS) - 1, (1,), generator=generator, dtype=torch.int64))


def _make_mask(shape: torch.Size, p: float, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.rand(shape, generator=gen, device=device, dtype=torch.float32) >= p


class _SoftmaxDropoutMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, v, p, seed, regenerate):
        # A strided view of v (a head slice of a fused qkv output) would pin the whole qkv
        # buffer while saved; the unfused matmul saves a contiguous copy too.
        v = v.contiguous()
        probs = F.softmax(scores, dim=-1)
        ctx.p = p
        ctx.seed = seed
        ctx.regenerate = regenerate
        ctx.mask_shape = probs.shape
        if seed is None:  # no dropout
            ctx.save_for_backward(probs, v)
            return probs @ v
        mask = _make_mask(probs.shape, p, seed, probs.device)
        scale = 1.0 / (1.0 - p)
        out = (probs * mask * scale) @ v
        if regenerate:
            ctx.save_for_backward(probs, v)
        else:
            ctx.save_for_backward(probs, v, pack_bits(mask))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        probs, v, *packed = ctx.saved_tensors
        mask = None
        if ctx.seed is not None:
            if ctx.regenerate:
                mask = _make_mask(ctx.mask_shape, ctx.p, ctx.seed, probs.device)
            else:
                mask = unpack_bits(packed[0], ctx.mask_shape)
        scale = 1.0 / (1.0 - ctx.p)
        grad_scores = grad_v = None
        if ctx.needs_input_grad[1]:
            dropped = probs if mask is None else probs * mask * scale
            grad_v = dropped.transpose(-2, -1) @ grad_out
        if ctx.needs_input_grad[0]:
            dp = grad_out @ v.transpose(-2, -1)
            if mask is not None:
                dp = dp * mask * scale
            grad_scores = probs * (dp - (dp * probs).sum(dim=-1, keepdim=True))
        return grad_scores, grad_v, None, None, None


def softmax_dropout_matmul(
    scores: torch.Tensor,
    v: torch.Tensor,
    p: float = 0.0,
    training: bool = True,
    *,
    regenerate_mask: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``dropout(softmax(scores, -1), p) @ v`` with exact gradients and less saved memory.

    Args:
        scores: ``(..., S_q, S_k)`` attention logits; apply causal or padding masks before
            the call (``-inf`` entries get probability 0).
        v: ``(..., S_k, D)`` values, same leading dims and dtype as ``scores``.
        p: dropout probability in ``[0, 1)``. ``p == 0`` or ``training=False`` skips dropout and
            saves only P and V.
        training: as ``F.dropout``.
        regenerate_mask: keep only a seed and redraw the mask in backward. Saves the
            ``ceil(a / 8)`` mask bytes for one extra ``rand`` of ``a`` floats in backward.
        generator: a CPU generator to draw the 63-bit mask seed from (no device sync);
            the default CPU generator (seeded by ``torch.manual_seed``) if None.

    Only worth it for explicit-math attention: SDPA and flash kernels keep no ``S^2`` tensors.
    Backward needs P and V, so it is exact; it is not twice differentiable.
    """
    if not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise LayerOptionError(
            f"tba.layers.softmax_dropout_matmul: p={p!r} is outside [0, 1). Pass a dropout "
            f"probability such as 0.1; p=1 would drop everything."
        )
    if scores.dim() < 2 or v.dim() != scores.dim():
        raise LayerShapeError(
            f"tba.layers.softmax_dropout_matmul: scores {tuple(scores.shape)} and v "
            f"{tuple(v.shape)} must both be (..., S_q, S_k) and (..., S_k, D) with the same "
            f"number of dims. Reshape heads into a leading dim."
        )
    if scores.shape[:-2] != v.shape[:-2] or scores.shape[-1] != v.shape[-2]:
        raise LayerShapeError(
            f"tba.layers.softmax_dropout_matmul: scores {tuple(scores.shape)} do not fit v "
            f"{tuple(v.shape)}; need scores (..., S_q, S_k) and v (..., S_k, D) with equal "
            f"leading dims. Check the head and sequence dims."
        )
    if scores.dtype != v.dtype:
        raise LayerShapeError(
            f"tba.layers.softmax_dropout_matmul: scores are {scores.dtype} but v is {v.dtype}. "
            f"Cast one of them so both match."
        )
    seed = None
    if training and p > 0.0:
        seed = _draw_seed(generator)
    needs_grad = torch.is_grad_enabled() and (scores.requires_grad or v.requires_grad)
    if not needs_grad:
        probs = F.softmax(scores, dim=-1)
        if seed is not None:
            probs = probs * _make_mask(probs.shape, p, seed, probs.device) * (1.0 / (1.0 - p))
        return probs @ v
    return _SoftmaxDropoutMatmul.apply(scores, v, float(p), seed, bool(regenerate_mask))
