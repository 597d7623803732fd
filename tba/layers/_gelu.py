"""`TempoGELU`: exact GELU whose backward needs only its output and one bit per element.

Stock ``nn.GELU`` saves its input ``x`` (``n * b`` bytes). ``TempoGELU`` saves its output ``y``
instead, which the following ``nn.Linear`` saves anyway (one storage, counted once by any
storage-deduplicating saved-tensor hook), plus one packed branch bit per element
(``ceil(n / 8)`` bytes). The saving is ``n * b - ceil(n / 8)`` bytes per call.

NOTE [GELU inversion]
GELU g(x) = x * Phi(x) falls on (-inf, X_MIN] and rises on [X_MIN, inf), with its minimum
Y_MIN = g(X_MIN). The bit records the branch (1 = left, x < X_MIN). Backward recovers x from
(y, bit) in float32 (float64 for float64 inputs), then evaluates the exact derivative
g'(x) = Phi(x) + x * phi(x), the ``approximate="none"`` form.

Rule 1 (near the minimum). With u = y - Y_MIN and s = sqrt(2u / g2) (g2 = g''(X_MIN)), the
series inversion of u = g2/2 d^2 + g3/6 d^3 + g4/24 d^4 gives, for d = x - X_MIN and sign
sigma = +1 (right) or -1 (left), d = sigma*s + C2*s^2 + sigma*C3*s^3 + O(s^4) with
k = g3 / (3 g2), m = g4 / (12 g2), C2 = -k/2, C3 = 5k^2/8 - m/2. Where s < S_CLOSED the closed
form is the answer: its truncation error (about 0.2 s^4) there is no larger than the error
any iteration inherits from the rounding of y (about ulp(y) / (g2 s)); both are ~1e-6 at 0.05.
Rule 2 (bracket). One safeguarded Newton iteration serves both branches, inside a bracket
that provably holds the root: on the right [X_MIN, 0] for y <= 0 and [y, y + 0.2] for y > 0
(since 0 <= x - g(x) = x * Phi(-x) <= 0.17 for x >= 0); on the left [t, X_MIN] with
phi(t) = -y, because Mills' inequality |x| Phi(x) < phi(x) puts the root right of t. A step
that leaves the bracket (or is NaN) is replaced by bisection, so it cannot diverge or change
branch.
Rule 3 (functions). Right: f = g(x) - y. Left: f = log(g(x) / y) = log(-g(x)) - log(-y),
which is increasing and concave there, so Newton is well scaled deep in the tail where g'
vanishes (plain Newton would take huge steps). Phi is evaluated as erfc(-x / sqrt 2) / 2,
exact in the left tail.
Rule 4 (iteration count). Starting points: Rule 1's series where s < 0.5 (error < 0.02),
else y / Phi(y) on the right and t on the left. Measured over 6.2 million float32 targets
covering both branches (y from Y_MIN to 1e3, and down to -1e-7 on the left): after 2 steps the
derivative is within 1e-5 of its float64 value, after 3 within 4.8e-7, the float32 floor
(a 4th step changes nothing). We run 3 (5 for float64): one quadratic step of margin over
the test tolerance of 1e-4, at fixed cost and with no data-dependent control flow or sync.
Rule 5 (limits). y is clamped to [Y_MIN, 10] on the right (for x >= 10, g'(x) == 1 in float32
and x == y). On the left a y that is 0 or positive is a GELU that underflowed (float32 stock
GELU returns 0 for x < about -5.54, where |g'(x)| < 1e-6): its gradient is defined as exactly 0.
NaN propagates. Half and bfloat16 inputs are solved in float32; the 8- or 11-bit y then limits
accuracy to about ulp(y) * |g''/g'| (about 0.01 at the minimum).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._errors import LayerOptionError
from ._packing import pack_bits, unpack_bits

__all__ = ["TempoGELU", "tempo_gelu", "GELU_X_MIN", "GELU_Y_MIN"]

_SQRT1_2 = 1.0 / math.sqrt(2.0)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x - _LOG_SQRT_2PI)


def _solve_x_min() -> float:
    # Newton on g'(x) = Phi(x) + x phi(x) = 0 in float64, from the textbook value.
    x = -0.75
    for _ in range(30):
        x -= (0.5 * math.erfc(-x * _SQRT1_2) + x * _phi(x)) / (_phi(x) * (2.0 - x * x))
    return x


GELU_X_MIN: float = _solve_x_min()  # -0.7517915246935645
GELU_Y_MIN: float = GELU_X_MIN * 0.5 * math.erfc(-GELU_X_MIN * _SQRT1_2)  # -0.16997120747990369
_G2 = _phi(GELU_X_MIN) * (2.0 - GELU_X_MIN**2)  # g''(x_min) = 0.43149...
_G3 = GELU_X_MIN * _phi(GELU_X_MIN) * (GELU_X_MIN**2 - 4.0)
_G4 = _phi(GELU_X_MIN) * (-(GELU_X_MIN**4) + 7.0 * GELU_X_MIN**2 - 4.0)
_K = _G3 / (3.0 * _G2)
_M = _G4 / (12.0 * _G2)
_C2 = -_K / 2.0
_C3 = 5.0 * _K * _K / 8.0 - _M / 2.0
S_CLOSED = 0.05  # Rule 1
_S_GUESS = 0.5  # Rule 4
_Y_RIGHT_MAX = 10.0  # Rule 5
_Y_LEFT_MAX = -1e-30  # Rule 5: keeps x > -11.7, where Phi(x) is a normal float32
_ITERS_F32 = 3  # Rule 4
_ITERS_F64 = 5
_CHUNK = 1 << 20  # elements per backward chunk: bounds the solver's temporaries


def _closed_form(s: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    return GELU_X_MIN + sigma * s + _C2 * s * s + sigma * _C3 * s * s * s


def _gelu_grad_from_output(y: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
    """g'(x) for the x on branch ``left`` with g(x) = y (Rules 1-5). ``y`` is float32/64."""
    iters = _ITERS_F64 if y.dtype == torch.float64 else _ITERS_F32
    y_right = y.clamp(GELU_Y_MIN, _Y_RIGHT_MAX)
    y_left = y.clamp(GELU_Y_MIN, _Y_LEFT_MAX)
    target = torch.where(left, y_left, y_right)
    s = torch.sqrt((target - GELU_Y_MIN).clamp_min(0.0) * (2.0 / _G2))
    sigma = 1.0 - 2.0 * left.to(y.dtype)
    closed = _closed_form(s, sigma)
    # Rule 3: phi(tail) = -y, and Mills' ratio (|x| Phi(x) < phi(x)) puts the root right of it.
    tail = -torch.sqrt((-2.0 * (torch.log(-y_left) + _LOG_SQRT_2PI)).clamp_min(0.0))
    positive = y_right > 0
    lo = torch.where(left, tail, torch.where(positive, y_right, GELU_X_MIN))
    hi = torch.where(left, GELU_X_MIN, torch.where(positive, y_right + 0.2, 0.0))
    start = torch.where(left, tail, y_right / (0.5 * torch.special.erfc(-y_right * _SQRT1_2)))
    x = torch.where(s < _S_GUESS, closed, start)
    x = torch.minimum(torch.maximum(x, lo), hi)
    for _ in range(iters):
        cdf = 0.5 * torch.special.erfc(-x * _SQRT1_2)
        gx = x * cdf
        slope = cdf + x * torch.exp(-0.5 * x * x - _LOG_SQRT_2PI)
        # Left: f = log(g(x) / y), f' = g'(x) / g(x). Right: f = g(x) - y, f' = g'(x).
        # On both branches f > 0 means x is right of the root.
        f = torch.where(left, torch.log(gx / target), gx - target)
        fprime = torch.where(left, slope / gx, slope)
        lo = torch.where(f < 0, x, lo)
        hi = torch.where(f > 0, x, hi)
        step = x - f / fprime
        inside = (step >= lo) & (step <= hi)  # False for NaN, inf and zero slopes
        x = torch.where(inside, step, 0.5 * (lo + hi))
    x = torch.where(s < S_CLOSED, closed, x)
    grad = 0.5 * torch.special.erfc(-x * _SQRT1_2) + x * torch.exp(-0.5 * x * x - _LOG_SQRT_2PI)
    underflowed = left & (y >= 0)  # Rule 5
    grad = torch.where(underflowed, 0.0, grad)
    return torch.where(torch.isnan(y), y, grad)  # bisection would otherwise hide a NaN


class _TempoGELUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(x)
        ctx.save_for_backward(y, pack_bits(x < GELU_X_MIN))
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:
        y, bits = ctx.saved_tensors
        work = torch.float64 if y.dtype == torch.float64 else torch.float32
        y_flat = y.reshape(-1)
        g_flat = grad_out.reshape(-1)
        out = torch.empty(y.numel(), dtype=grad_out.dtype, device=y.device)
        for start in range(0, y.numel(), _CHUNK):  # _CHUNK is a multiple of 8: byte-aligned
            stop = min(start + _CHUNK, y.numel())
            left = unpack_bits(bits[start // 8 : (stop + 7) // 8], (stop - start,))
            deriv = _gelu_grad_from_output(y_flat[start:stop].to(work), left)
            out[start:stop] = g_flat[start:stop].to(work) * deriv
        return out.view(y.shape)


def tempo_gelu(x: torch.Tensor) -> torch.Tensor:
    """``F.gelu(x)`` (bit-identical) whose backward keeps only ``y`` and one bit per element.

    Gradients match the exact GELU derivative to about 1e-6 in float32, except within 0.05 of
    the minimum at x = -0.7518, where the rounding of y limits them to about 2e-4 (see
    NOTE [GELU inversion]). Backward is compute-bound: about 60 elementwise passes (15 of them
    transcendental) over chunks of 2**20 elements, against a handful for stock GELU; on a small
    CPU model that can exceed the matmuls' time. Not twice differentiable.
    """
    if not (torch.is_grad_enabled() and x.requires_grad):
        return F.gelu(x)
    return _TempoGELUFunction.apply(x)


class TempoGELU(nn.Module):
    """Drop-in for ``nn.GELU()`` (``approximate="none"`` only) that saves ``y`` and 1 bit/element.

    Worth it when the next layer saves the output anyway (a Linear does): the activation
    memory of the GELU drops from ``n * b`` to ``ceil(n / 8)`` bytes. If nothing else saves the
    output, the saving is only ``-ceil(n / 8)`` bytes (it saves the output instead of the input).
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate != "none":
            raise LayerOptionError(
                f"tba.layers.TempoGELU: approximate={approximate!r} is not supported; only "
                f"'none' (the erf form) can be inverted here. Use ReGELU2(approximate="
                f"{approximate!r}) or keep nn.GELU for the tanh form."
            )
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tempo_gelu(x)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
