"""`MSLayerNorm` and `MSRMSNorm` (memory-sharing norms): no affine part, save only rstd.

Once ``merge_norm_affine`` has folded gamma and beta into the following Linears, the norm's
output is x_hat itself, and that very tensor object is the Linear's input, which the Linear
saves. The norm saves the same output tensor (``ctx.save_for_backward(y)``), so a saved-tensor
hook that deduplicates by storage keeps one copy, and offloaders move it once. The only extra
bytes are rstd (4 per row, float32 for every input dtype but float64).

NOTE [Memory-sharing backward] (exact given y)
  LayerNorm: dx = rstd * (dy - mean(dy) - y * mean(dy * y))
  RMSNorm:   dx = rstd * (dy - y * mean(dy * y))
computed in float32 (float64 for float64 inputs) over the last ``len(normalized_shape)`` dims.
The only error is the rounding of y to the input dtype.

Saving: against an affine-free stock norm, ``T * h * b + 4 * T`` bytes for LayerNorm (x and
mean) and ``T * h * b`` for ``F.rms_norm`` (x); against stock norms with affine, also the extra
affine output when the Linear's input would otherwise be a new tensor.
Do not modify the output in place before backward: autograd's version counter will refuse.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MSLayerNorm", "MSRMSNorm", "ms_layer_norm", "ms_rms_norm"]


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _norm_dims(x: torch.Tensor, ndim: int) -> tuple[int, ...]:
    return tuple(range(x.dim() - ndim, x.dim()))


class _MSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalized_shape, eps, centered):
        work = _work_dtype(x)
        dims = _norm_dims(x, len(normalized_shape))
        if centered:
            y, _mean, rstd = torch.native_layer_norm(x, normalized_shape, None, None, eps)
            rstd = rstd.to(work)
        else:
            xw = x.to(work)
            rstd = torch.rsqrt(xw.pow(2).mean(dim=dims, keepdim=True) + eps)
            y = (xw * rstd).to(x.dtype)
        ctx.centered = centered
        ctx.ndim = len(normalized_shape)
        ctx.save_for_backward(y, rstd)  # y is shared with the next layer: see module doc
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        y, rstd = ctx.saved_tensors
        work = rstd.dtype
        dims = _norm_dims(y, ctx.ndim)
        g = dy.to(work)
        x_hat = y.to(work)
        inner = g - x_hat * (g * x_hat).mean(dim=dims, keepdim=True)
        if ctx.centered:
            inner = inner - g.mean(dim=dims, keepdim=True)
        return (rstd * inner).to(dy.dtype), None, None, None


def _as_shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(int(d) for d in normalized_shape)


def ms_layer_norm(x: torch.Tensor, normalized_shape, eps: float = 1e-5) -> torch.Tensor:
    """Affine-free ``F.layer_norm`` whose backward keeps only its output (shared) and rstd."""
    shape = _as_shape(normalized_shape)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return F.layer_norm(x, shape, None, None, eps)
    return _MSNormFunction.apply(x, shape, eps, True)


def ms_rms_norm(x: torch.Tensor, normalized_shape, eps: float | None = None) -> torch.Tensor:
    """Affine-free RMSNorm (``eps=None`` means ``finfo(x.dtype).eps``, as ``nn.RMSNorm``)."""
    shape = _as_shape(normalized_shape)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return _MSNormFunction.apply(x, shape, eps, False)


class MSLayerNorm(nn.Module):
    """LayerNorm without gamma/beta that saves only rstd beyond its (shared) output.

    Use it where gamma and beta have been folded into the next Linears (``merge_norm_affine``
    does both). It has no parameters, so its state_dict is empty. Trade-off: the saving only
    materializes if the output goes straight into layers that save it (Linears); a consumer that
    saves nothing leaves this norm keeping y alone, which is no worse than stock x.
    """

    def __init__(self, normalized_shape, eps: float = 1e-5) -> None:
        super().__init__()
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ms_layer_norm(x, self.normalized_shape, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class MSRMSNorm(nn.Module):
    """RMSNorm without gamma that saves only rstd beyond its (shared) output.

    ``eps=None`` uses ``torch.finfo(x.dtype).eps`` like ``nn.RMSNorm``. See ``MSLayerNorm``.
    """

    def __init__(self, normalized_shape, eps: float | None = None) -> None:
        super().__init__()
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ms_rms_norm(x, self.normalized_shape, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"
