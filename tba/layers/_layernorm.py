"""`TempoLayerNorm`: LayerNorm whose backward rebuilds x-hat from the output it returned.

Stock LayerNorm saves x (``T * h * b`` bytes), mean and rstd (4 bytes per row each, float32),
plus gamma and beta. ``TempoLayerNorm`` saves y, rstd, gamma and beta. y is the next Linear's
saved input (one storage, counted once), so the saving is ``T * h * b + 4 * T`` bytes.

NOTE [LayerNorm from its output]
Backward, in float32 (float64 for float64 inputs), over the normalized dims:
  x_hat = (y - beta) / gamma,  g = dy * gamma,
  dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)),  dgamma = sum dy * x_hat,  dbeta = sum dy.
The rounding of y costs x_hat an error of about u * (|x_hat| + |beta / gamma|) (u = unit
roundoff of the input dtype). In dx the gamma cancels (it multiplies g), so dx stays accurate;
dgamma inherits the error, which grows as |gamma| shrinks and is infinite at gamma = 0. Hence
the guard: when min |gamma| < ``gamma_eps`` (default 1e-3, so |beta / gamma| <= 1e3 |beta| and,
in float32, the x_hat error stays below 6e-5 |beta| + 6e-8), a forward falls back to the stock
op and saves x. The check reads one scalar from the device per training forward (a sync on
CUDA). For bfloat16 (u = 2^-8) consider ``gamma_eps`` of 0.05 or more.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._errors import LayerOptionError

__all__ = ["TempoLayerNorm", "DEFAULT_GAMMA_EPS"]

DEFAULT_GAMMA_EPS = 1e-3


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class _TempoLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps):
        y, _mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.ndim = len(normalized_shape)
        ctx.save_for_backward(y, rstd, weight, bias)  # not x: see the NOTE
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        y, rstd, weight, bias = ctx.saved_tensors
        work = _work_dtype(y)
        dims = tuple(range(y.dim() - ctx.ndim, y.dim()))
        batch_dims = tuple(range(y.dim() - ctx.ndim))
        x_hat = y.to(work)
        if bias is not None:
            x_hat = x_hat - bias.to(work)
        dy_w = dy.to(work)
        g = dy_w
        if weight is not None:
            x_hat = x_hat / weight.to(work)
            g = dy_w * weight.to(work)
        dx = None
        if ctx.needs_input_grad[0]:
            mean_g = g.mean(dim=dims, keepdim=True)
            mean_gx = (g * x_hat).mean(dim=dims, keepdim=True)
            dx = (rstd.to(work) * (g - mean_g - x_hat * mean_gx)).to(dy.dtype)
        dweight = dbias = None
        if weight is not None and ctx.needs_input_grad[2]:
            dweight = (dy_w * x_hat).sum(dim=batch_dims).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[3]:
            dbias = dy_w.sum(dim=batch_dims).to(bias.dtype)
        return dx, None, dweight, dbias, None


class TempoLayerNorm(nn.LayerNorm):
    """Drop-in for ``nn.LayerNorm`` (same arguments and state_dict) that saves y, not x.

    Args:
        normalized_shape, eps, elementwise_affine, bias, device, dtype: as ``nn.LayerNorm``.
        gamma_eps: fall back to the stock op (which saves x) for any forward where
            ``min |weight| < gamma_eps``; see NOTE [LayerNorm from its output]. Larger is safer
            for dgamma and saves memory less often. Default 1e-3.

    Trade-offs: saves ``T * h * b + 4 * T`` bytes per call when the next layer saves the output;
    backward does about the same arithmetic as the stock kernel, but in eager ops; not twice
    differentiable. Without an affine part it behaves like ``MSLayerNorm``.
    """

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        gamma_eps: float = DEFAULT_GAMMA_EPS,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        if not (isinstance(gamma_eps, (int, float)) and math.isfinite(gamma_eps)) or (
            gamma_eps < 0
        ):
            raise LayerOptionError(
                f"tba.layers.TempoLayerNorm: gamma_eps={gamma_eps!r} must be a finite number "
                f">= 0. Use the default {DEFAULT_GAMMA_EPS} unless gamma is known to be tiny."
            )
        self.gamma_eps = float(gamma_eps)
        self.fallbacks = 0  # forwards that took the stock path because of a small gamma

    @classmethod
    def from_layernorm(cls, ln: nn.LayerNorm, gamma_eps: float = DEFAULT_GAMMA_EPS):
        """A TempoLayerNorm sharing ``ln``'s parameter objects (optimizer state stays valid)."""
        new = cls(
            ln.normalized_shape,
            ln.eps,
            ln.elementwise_affine,
            ln.bias is not None,
            device="meta",
            gamma_eps=gamma_eps,
        )
        new.weight = ln.weight
        new.bias = ln.bias
        new.train(ln.training)
        return new

    def _gamma_ok(self) -> bool:
        if self.weight is None:
            return True
        # One device read per forward (see the NOTE); a zero-size weight cannot occur.
        return bool(self.weight.detach().abs().min() >= self.gamma_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for p in self.parameters())
        )
        if not needs_grad:
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        if not self._gamma_ok():
            self.fallbacks += 1
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return _TempoLayerNormFunction.apply(
            x, tuple(self.normalized_shape), self.weight, self.bias, self.eps
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gamma_eps={self.gamma_eps}"
