"""`TempoRMSNorm`: RMSNorm whose backward rebuilds x-hat from the output it returned.

Tempo's LayerNorm idea (see ``_layernorm``) applied to RMSNorm, which Tempo itself did not cover.
Stock RMSNorm modules save x and more: HF's Llama-style Python formula keeps x, x-hat and rstd
(``2 * T * h * b + 4 * T`` bytes); ``F.rms_norm`` keeps x and rstd. ``TempoRMSNorm`` saves y, rstd
and gamma; y is the next Linears' saved input (one storage, counted once), so the saving is
``2 * T * h * b`` bytes against the Python formula and ``T * h * b`` against ``F.rms_norm``.

NOTE [RMSNorm from its output]
With gamma = offset + weight (offset 1 for Gemma's ``(1 + weight)`` norms, else 0), backward in
float32 (float64 for float64 inputs) over the last dim:
  x_hat = y / gamma,  g = dy * gamma,  dx = rstd * (g - x_hat * mean(g * x_hat)),
  dweight = sum dy * x_hat.
As in NOTE [LayerNorm from its output], dx does not depend on gamma's size but dweight inherits
the rounding of y divided by gamma, so a forward with ``min |gamma| < gamma_eps`` takes the stock
formula instead (one device read per training forward: a sync on CUDA).

Forward styles, each bit-identical to the module it replaces: ``"llama"``
(``weight * (x * rstd).to(dtype)``, rstd in float32: LlamaRMSNorm and its Mistral/Qwen2 copies),
``"gemma"`` (``(x * rstd * (1 + weight.float())).to(dtype)``) and ``"torch"`` (``F.rms_norm``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._errors import LayerOptionError
from ._layernorm import DEFAULT_GAMMA_EPS

__all__ = ["TempoRMSNorm", "RMS_STYLES"]

RMS_STYLES = ("llama", "gemma", "torch")


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    xw = x.to(_work_dtype(x))
    return torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)


def _stock(x: torch.Tensor, weight, eps: float, style: str) -> torch.Tensor:
    """The replaced module's own formula (differentiable; also the small-gamma fallback)."""
    if style == "torch":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x_hat = x.to(_work_dtype(x)) * _rstd(x, eps)
    if style == "gemma":
        gamma = 1.0 + (weight.to(x_hat.dtype) if weight is not None else 0.0)
        return (x_hat * gamma).to(x.dtype)
    x_hat = x_hat.to(x.dtype)
    return x_hat if weight is None else weight * x_hat


class _TempoRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, style, offset):
        y = _stock(x, weight, eps, style)
        ctx.offset = offset
        ctx.save_for_backward(y, _rstd(x, eps), weight)  # not x: see the NOTE
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        y, rstd, weight = ctx.saved_tensors
        work = rstd.dtype
        x_hat = y.to(work)
        g = dy.to(work)
        if weight is not None:
            gamma = ctx.offset + weight.to(work)
            x_hat = x_hat / gamma
            g = g * gamma
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))).to(dy.dtype)
        dweight = None
        if weight is not None and ctx.needs_input_grad[1]:
            batch_dims = tuple(range(y.dim() - 1))
            dweight = (dy.to(work) * x_hat).sum(dim=batch_dims).to(weight.dtype)
        return dx, dweight, None, None, None


class TempoRMSNorm(nn.Module):
    """Drop-in for a last-dim RMSNorm that saves y (shared with the next layer), not x.

    Args:
        hidden: the normalized (last) dim.
        eps: added to mean(x^2); ``None`` means ``torch.finfo(x.dtype).eps`` (``nn.RMSNorm``).
        elementwise_affine: whether there is a ``weight``.
        style: ``"llama"``, ``"gemma"`` (gamma = 1 + weight) or ``"torch"``; see the module doc.
        gamma_eps: fall back to the stock formula while ``min |gamma| < gamma_eps`` (default 1e-3).

    Gradients are exact up to float32 rounding (NOTE [RMSNorm from its output]). The parameter
    is called ``weight`` as in the modules it replaces, so state_dicts keep their keys.
    """

    def __init__(
        self,
        hidden: int,
        eps: float | None = None,
        elementwise_affine: bool = True,
        *,
        style: str = "llama",
        gamma_eps: float = DEFAULT_GAMMA_EPS,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if style not in RMS_STYLES:
            raise LayerOptionError(
                f"tba.layers.TempoRMSNorm: style={style!r} is not one of "
                f"{', '.join(map(repr, RMS_STYLES))}. Use 'gemma' for (1 + weight) norms."
            )
        if not (isinstance(gamma_eps, (int, float)) and math.isfinite(gamma_eps)) or (
            gamma_eps < 0
        ):
            raise LayerOptionError(
                f"tba.layers.TempoRMSNorm: gamma_eps={gamma_eps!r} must be a finite number "
                f">= 0. Use the default {DEFAULT_GAMMA_EPS} unless gamma is known to be tiny."
            )
        self.hidden, self.eps, self.style = int(hidden), eps, style
        self.gamma_eps = float(gamma_eps)
        self.offset = 1.0 if style == "gemma" else 0.0
        init = torch.zeros if style == "gemma" else torch.ones
        self.weight = (
            nn.Parameter(init(self.hidden, device=device, dtype=dtype))
            if elementwise_affine
            else None
        )
        self.fallbacks = 0  # forwards that took the stock path because of a small gamma

    @classmethod
    def replacing(
        cls, norm: nn.Module, eps: float | None, style: str, gamma_eps: float = DEFAULT_GAMMA_EPS
    ) -> TempoRMSNorm:
        """A TempoRMSNorm sharing ``norm.weight`` (so optimizer state stays valid)."""
        weight = getattr(norm, "weight", None)
        hidden = weight.shape[-1] if weight is not None else norm.normalized_shape[-1]
        new = cls(hidden, eps, weight is not None, style=style, gamma_eps=gamma_eps, device="meta")
        new.weight = weight
        new.train(norm.training)
        return new

    def _gamma_ok(self) -> bool:
        if self.weight is None:
            return True
        return bool((self.weight.detach() + self.offset).abs().min() >= self.gamma_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        weight = self.weight
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or (weight is not None and weight.requires_grad)
        )
        if not needs_grad:
            return _stock(x, weight, eps, self.style)
        if not self._gamma_ok():
            self.fallbacks += 1
            return _stock(x, weight, eps, self.style)
        return _TempoRMSNormFunction.apply(x, weight, eps, self.style, self.offset)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, style={self.style!r}, gamma_eps={self.gamma_eps}"
