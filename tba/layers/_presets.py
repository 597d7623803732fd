"""One-call recipes for ``convert``: ``preset="exact"``, ``"approx"`` and ``"<family>-<kind>"``.

NOTE [Presets]
  exact:  GELU (erf or tanh form) -> TempoGELU, SiLU -> TempoSiLU, LayerNorm -> TempoLayerNorm,
          RMSNorm -> TempoRMSNorm. Gradients exact up to float32 rounding; parameters, state_dict
          keys and the optimizer's view of the model unchanged.
  approx: GELU -> ReGELU2, SiLU -> ReSiLU2 (Approx-BP's 2-bit step-function backward), and each
          norm folded into the Linears it feeds and replaced by MSLayerNorm / MSRMSNorm where
          that is possible and checked, TempoLayerNorm / TempoRMSNorm elsewhere (post-LN blocks,
          a final norm feeding a tied lm_head, unknown consumers). Gradients approximate; the
          merged norms' weights leave the state_dict.
``"<family>-exact"`` / ``"<family>-approx"`` (family: ``FAMILIES``) do the same after checking the
model's ``config.model_type`` belongs to the family, so a recipe meant for one architecture is
not applied to another by mistake. The approx recipe checks every merge with one no-grad forward
(``example_inputs``; for an HF model without them, 8 token ids built from its config).
"""

from __future__ import annotations

import torch
from torch import nn

from ._errors import LayerOptionError

__all__ = ["PRESETS", "FAMILIES", "resolve_preset", "auto_example_inputs"]

PRESETS: dict[str, dict[str, str]] = {
    "exact": {"gelu": "tempo", "silu": "tempo", "norm": "tempo"},
    "approx": {"gelu": "regelu2", "silu": "resilu2", "norm": "ms-or-tempo"},
}
FAMILIES: dict[str, tuple[str, ...]] = {  # family -> accepted config.model_type values
    "gpt2": ("gpt2",),
    "bert": ("bert",),
    "roberta": ("roberta",),
    "llama": ("llama",),
    "mistral": ("mistral",),
    "qwen2": ("qwen2",),
    "gemma": ("gemma", "gemma2", "gemma3", "gemma3_text"),
}


def preset_names() -> list[str]:
    return [*PRESETS, *(f"{f}-{k}" for f in FAMILIES for k in PRESETS)]


def resolve_preset(preset: str, model: nn.Module) -> dict[str, str]:
    """The ``gelu``/``silu``/``norm`` options of ``preset``, after its family check."""
    family, _, kind = preset.rpartition("-") if isinstance(preset, str) else ("", "", "")
    if kind not in PRESETS or (family and family not in FAMILIES):
        raise LayerOptionError(
            f"tba.layers.convert: preset={preset!r} is not accepted; use one of "
            f"{', '.join(map(repr, preset_names()))}."
        )
    if family:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in FAMILIES[family]:
            raise LayerOptionError(
                f"tba.layers.convert: preset={preset!r} is for config.model_type in "
                f"{FAMILIES[family]}, but the model's is {model_type!r}. Use preset={kind!r}, "
                f"which recognises layers by behaviour on any model."
            )
    return dict(PRESETS[kind])


def auto_example_inputs(model: nn.Module) -> torch.Tensor | None:
    """Token ids for a Hugging Face model (one with ``config.vocab_size``), else None."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    param = next(model.parameters(), None)
    if not isinstance(vocab, int) or vocab < 2 or param is None:
        return None
    return (torch.arange(1, 9, device=param.device) * 7919 % vocab).unsqueeze(0)
