"""Memory-lean autograd layers: they compute the stock forward but save less for backward.

Independent of the rest of tba (no import of it): each layer shrinks what reaches autograd's
saved-tensor hooks, so it cuts memory with or without an offloader, and SSD traffic with one.

Exact gradients: ``TempoGELU`` (erf or tanh form) and ``TempoSiLU`` (save y + 1 bit),
``TempoLayerNorm`` (saves y, rstd, gamma, beta), ``TempoRMSNorm`` (y, rstd, gamma),
``softmax_dropout_matmul`` (saves P, a 1-bit mask, V), ``MSLayerNorm``/``MSRMSNorm`` (save rstd;
need ``merge_norm_affine``). Approximate gradients, by design: ``ReGELU2`` and ``ReSiLU2`` (2 bits
per element). ``convert`` swaps them into an existing model, Hugging Face models included, and
``convert(model, preset="exact" | "approx")`` applies a whole recipe.
"""

from ._approx import (
    REGELU2_A,
    REGELU2_C,
    RESILU2_A,
    RESILU2_C,
    ReGELU2,
    ReSiLU2,
    regelu2,
    resilu2,
)
from ._attention import softmax_dropout_matmul
from ._convert import GELU_OPTIONS, NORM_OPTIONS, SILU_OPTIONS, ConvertReport, convert
from ._errors import (
    LayerOptionError,
    LayersError,
    LayerShapeError,
    LayerTypeError,
    NormMergeError,
)
from ._gelu import (
    GELU_TANH_X_MIN,
    GELU_TANH_Y_MIN,
    GELU_X_MIN,
    GELU_Y_MIN,
    SILU_X_MIN,
    SILU_Y_MIN,
    TempoGELU,
    TempoSiLU,
    tempo_gelu,
    tempo_silu,
)
from ._layernorm import DEFAULT_GAMMA_EPS, TempoLayerNorm
from ._merge import NORM_CONSUMERS, MergeReport, merge_norm_affine
from ._msnorm import MSLayerNorm, MSRMSNorm, ms_layer_norm, ms_rms_norm
from ._packing import pack_2bit, pack_bits, packed_nbytes, unpack_2bit, unpack_bits
from ._presets import FAMILIES, PRESETS
from ._rmsnorm import TempoRMSNorm

__all__ = [
    "TempoGELU",
    "tempo_gelu",
    "GELU_X_MIN",
    "GELU_Y_MIN",
    "GELU_TANH_X_MIN",
    "GELU_TANH_Y_MIN",
    "TempoSiLU",
    "tempo_silu",
    "SILU_X_MIN",
    "SILU_Y_MIN",
    "TempoLayerNorm",
    "DEFAULT_GAMMA_EPS",
    "TempoRMSNorm",
    "softmax_dropout_matmul",
    "ReGELU2",
    "ReSiLU2",
    "regelu2",
    "resilu2",
    "REGELU2_A",
    "REGELU2_C",
    "RESILU2_A",
    "RESILU2_C",
    "MSLayerNorm",
    "MSRMSNorm",
    "ms_layer_norm",
    "ms_rms_norm",
    "merge_norm_affine",
    "MergeReport",
    "NORM_CONSUMERS",
    "convert",
    "ConvertReport",
    "GELU_OPTIONS",
    "SILU_OPTIONS",
    "NORM_OPTIONS",
    "PRESETS",
    "FAMILIES",
    "pack_bits",
    "unpack_bits",
    "pack_2bit",
    "unpack_2bit",
    "packed_nbytes",
    "LayersError",
    "LayerOptionError",
    "LayerTypeError",
    "LayerShapeError",
    "NormMergeError",
]
