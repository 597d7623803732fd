"""`TempoGELU` and `TempoSiLU`: exact activations whose backward needs only y and one bit.

Stock ``nn.GELU`` / ``nn.SiLU`` save their input ``x`` (``n * b`` bytes); HF's Python-formula
GELUs (``NewGELUActivation``) save four tensors of that size. These layers save their output
``y`` instead, which the following layer saves anyway (a Linear, or the ``*`` of a gated MLP:
one storage, counted once by any storage-deduplicating saved-tensor hook), plus one packed branch
bit per element (``ceil(n / 8)`` bytes). The saving is ``n * b - ceil(n / 8)`` bytes per call
against ``nn.GELU`` / ``nn.SiLU``.

The bit records ``x < X_MIN`` (the left, falling branch of the non-monotonic curve); backward
reads g'(x) for the unique x with g(x) = y on that branch from tables of the exact derivative,
see NOTE [Inversion tables] in ``_invert``. Supported curves: GELU in the erf form
(``approximate="none"``), GELU in the tanh form (``approximate="tanh"``, also HF's ``gelu_new``
and ``gelu_pytorch_tanh``), and SiLU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._errors import LayerOptionError
from ._invert import GELU_ERF, GELU_TANH, SILU, GatedCurve
from ._packing import pack_bits, unpack_bits

__all__ = [
    "TempoGELU",
    "TempoSiLU",
    "tempo_gelu",
    "tempo_silu",
    "GELU_X_MIN",
    "GELU_Y_MIN",
    "GELU_TANH_X_MIN",
    "GELU_TANH_Y_MIN",
    "SILU_X_MIN",
    "SILU_Y_MIN",
]

GELU_X_MIN: float = GELU_ERF.x_min  # -0.7517915246935645
GELU_Y_MIN: float = GELU_ERF.y_min  # -0.16997120747990369
GELU_TANH_X_MIN: float = GELU_TANH.x_min  # -0.7524614220710162
GELU_TANH_Y_MIN: float = GELU_TANH.y_min  # -0.17004075057125406
SILU_X_MIN: float = SILU.x_min  # -1.278464542761074
SILU_Y_MIN: float = SILU.y_min  # -0.27846454276107385
_CHUNK = 1 << 20  # elements per backward chunk: bounds the temporaries (~25 float32 passes)
_CURVES = {"none": GELU_ERF, "tanh": GELU_TANH}


class _TempoActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, curve: GatedCurve, act) -> torch.Tensor:
        y = act(x)
        ctx.curve = curve
        ctx.save_for_backward(y, pack_bits(x < curve.x_min))
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        y, bits = ctx.saved_tensors
        work = torch.float64 if y.dtype == torch.float64 else torch.float32
        y_flat = y.reshape(-1)
        g_flat = grad_out.reshape(-1)
        out = torch.empty(y.numel(), dtype=grad_out.dtype, device=y.device)
        for start in range(0, y.numel(), _CHUNK):  # _CHUNK is a multiple of 8: byte-aligned
            stop = min(start + _CHUNK, y.numel())
            left = unpack_bits(bits[start // 8 : (stop + 7) // 8], (stop - start,))
            deriv = ctx.curve.derivative(y_flat[start:stop].to(work), left)
            out[start:stop] = g_flat[start:stop].to(work) * deriv
        return out.view(y.shape), None, None


def _check_approximate(approximate: str, where: str) -> None:
    if approximate not in _CURVES:
        raise LayerOptionError(
            f"tba.layers.{where}: approximate={approximate!r} is not one of 'none', 'tanh' "
            f"(the values nn.GELU accepts)."
        )


def tempo_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x, approximate=...)`` (bit-identical) keeping only ``y`` and one bit per element.

    Float32 gradients match the exact derivative of the chosen form within 1.5e-6 more than 0.5
    from the minimum (x = -0.752), 5e-6 beyond 0.05 from it, and 5e-4 within 0.05, where the
    rounding of y dominates; float64 within 4e-8 (NOTE [Inversion tables]). Backward costs about
    25 elementwise passes and two table gathers, against a few for stock GELU. Not twice
    differentiable.
    """
    _check_approximate(approximate, "tempo_gelu")
    if not (torch.is_grad_enabled() and x.requires_grad):
        return F.gelu(x, approximate=approximate)
    curve = _CURVES[approximate]
    return _TempoActivation.apply(x, curve, lambda t: F.gelu(t, approximate=approximate))


def tempo_silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(x)`` (bit-identical) keeping only ``y`` and one bit per element.

    Exact SiLU derivative within the float32 bounds of ``tempo_gelu`` (minimum at x = -1.278).
    In a gated MLP (``silu(gate) * up``) the product saves ``y`` anyway, so the SiLU's own
    memory drops to the bit.
    """
    if not (torch.is_grad_enabled() and x.requires_grad):
        return F.silu(x)
    return _TempoActivation.apply(x, SILU, F.silu)


class TempoGELU(nn.Module):
    """Drop-in for ``nn.GELU(approximate=...)`` that saves ``y`` and 1 bit/element.

    Worth it when the next layer saves the output anyway (a Linear does): the activation
    memory of the GELU drops from ``n * b`` to ``ceil(n / 8)`` bytes. If nothing else saves the
    output, the saving is only ``-ceil(n / 8)`` bytes (it saves the output instead of the input).
    ``approximate="tanh"`` is the tanh form (HF's ``gelu_new``, ``gelu_pytorch_tanh``); its
    forward is ``F.gelu(x, approximate="tanh")``, which can differ from HF's Python formula in the
    last bits.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        _check_approximate(approximate, "TempoGELU")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tempo_gelu(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class TempoSiLU(nn.Module):
    """Drop-in for ``nn.SiLU`` that saves ``y`` and 1 bit/element; exact gradient.

    ``inplace`` is accepted for signature compatibility and ignored (y must stay intact).
    """

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tempo_silu(x)
