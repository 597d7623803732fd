"""`ReGELU2` and `ReSiLU2` (Approx-BP): exact forward, 2-bit step-function backward.

The forward is ``F.gelu`` / ``F.silu`` itself (bit-identical). Backward uses the derivative of a
surrogate ``sum_k a_k * relu(x - c_k)``, a step function of x, so only the 2-bit code
``flag = [x > c1] + [x > c2] + [x > c3]`` is saved, four per byte: ``ceil(n / 4)`` bytes instead
of the ``n * b`` bytes of x, a saving of ``n * b - ceil(n / 4)`` per call.

The gradient is deliberately not GELU' / SiLU': it is ``grad * step[flag]`` with
``step = (0, a1, a1 + a2, a1 + a2 + a3)`` (cosine similarity with GELU' is about 0.95 on N(0, 1)
inputs). The constants are those of Approx-BP (arXiv 2406.16282); the sums are formed in
float64 and rounded once to the working dtype. Codes are computed in float32 for half and
bfloat16 inputs, so the thresholds are not rounded to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._errors import LayerOptionError
from ._packing import pack_2bit, unpack_2bit

__all__ = [
    "ReGELU2",
    "ReSiLU2",
    "regelu2",
    "resilu2",
    "REGELU2_C",
    "REGELU2_A",
    "RESILU2_C",
    "RESILU2_A",
]

REGELU2_C = (-3.1858810036855245, -0.001178821281161997, 3.190832613414926)
REGELU2_A = (-0.04922261145617846, 1.0979632065417297, -0.048740595085551286)
RESILU2_C = (-6.3050461001646445, -0.0008684942046214787, 6.325815242089708)
RESILU2_A = (-0.04060357190528599, 1.080925428529668, -0.040321856624382146)


def _steps(a: tuple[float, float, float]) -> tuple[float, float, float, float]:
    """Derivative of the surrogate for flag 0..3: partial sums of a, in float64."""
    return (0.0, a[0], a[0] + a[1], a[0] + a[1] + a[2])


def _codes(x: torch.Tensor, c: tuple[float, float, float]) -> torch.Tensor:
    xc = x if x.dtype in (torch.float32, torch.float64) else x.float()
    return (xc > c[0]).to(torch.uint8) + (xc > c[1]).to(torch.uint8) + (xc > c[2]).to(torch.uint8)


class _StepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, act, c, steps):
        y = act(x)
        ctx.steps = steps
        ctx.shape = x.shape
        ctx.save_for_backward(pack_2bit(_codes(x, c)))
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (packed,) = ctx.saved_tensors
        codes = unpack_2bit(packed, ctx.shape)
        work = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
        table = torch.tensor(ctx.steps, dtype=work, device=grad_out.device)
        deriv = table[codes.long()]
        return (grad_out.to(work) * deriv).to(grad_out.dtype), None, None, None


def _apply(x, act, c, a):
    if not (torch.is_grad_enabled() and x.requires_grad):
        return act(x)
    return _StepBackward.apply(x, act, c, _steps(a))


def regelu2(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x, approximate=...)`` with the ReGELU2 2-bit surrogate backward."""
    _check_approximate(approximate, "regelu2")
    return _apply(x, lambda t: F.gelu(t, approximate=approximate), REGELU2_C, REGELU2_A)


def resilu2(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(x)`` with the ReSiLU2 2-bit surrogate backward."""
    return _apply(x, F.silu, RESILU2_C, RESILU2_A)


def _check_approximate(approximate: str, where: str) -> None:
    if approximate not in ("none", "tanh"):
        raise LayerOptionError(
            f"tba.layers.{where}: approximate={approximate!r} is not one of 'none', 'tanh' "
            f"(the values nn.GELU accepts)."
        )


class ReGELU2(nn.Module):
    """Drop-in for ``nn.GELU`` saving 2 bits per element; the gradient is an approximation.

    Saves ``n * b - ceil(n / 4)`` bytes per call whether or not the output is saved elsewhere.
    The forward is unchanged; the backward is the ReGELU2 step function, which trains about as
    well as GELU' in Approx-BP's experiments but is not the exact gradient. The surrogate was
    fitted to the erf form; with ``approximate="tanh"`` the same steps are used.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        _check_approximate(approximate, "ReGELU2")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return regelu2(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class ReSiLU2(nn.Module):
    """Drop-in for ``nn.SiLU`` saving 2 bits per element; the gradient is an approximation.

    Saves ``n * b - ceil(n / 4)`` bytes per call. Forward unchanged; backward is the ReSiLU2
    step function. ``inplace`` is accepted for signature compatibility and ignored (the input
    is needed to compute the codes, which happens before the output exists).
    """

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return resilu2(x)
