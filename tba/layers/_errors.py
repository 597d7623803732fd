"""Typed errors of :mod:`tba.layers`.

``tba.layers`` does not depend on offloading; it shares only tba's error base, so that
``except tba.TBAError`` catches these too. Each class also inherits the built-in type a caller
would naturally catch, and every message has one shape: ``tba.layers.<component>: what
happened, the numbers. The fix.``
"""

from __future__ import annotations

from ..errors import TBAError

__all__ = [
    "LayersError",
    "LayerOptionError",
    "LayerTypeError",
    "LayerShapeError",
    "NormMergeError",
]


class LayersError(TBAError):
    """Base class of every error :mod:`tba.layers` raises on purpose."""


class LayerOptionError(LayersError, ValueError):
    """An option has a value outside the accepted set or range (e.g. ``convert(gelu="x")``)."""


class LayerTypeError(LayersError, TypeError):
    """An argument has the wrong type (e.g. ``convert`` got something that is not a Module)."""


class LayerShapeError(LayersError, ValueError):
    """Input tensors have shapes or dtypes that do not fit together."""


class NormMergeError(LayersError, ValueError):
    """``merge_norm_affine`` cannot fold a norm's affine part safely (e.g. unknown consumers)."""
