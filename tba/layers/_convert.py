"""`convert`: swap stock activation and norm modules of an existing model for lean ones.

Modules are replaced in their parents under the same names, so state_dicts keep their keys
(except ``norm="ms"``, which removes the norms' weights after folding them) and parameter
objects are reused, so an optimizer built before the call still holds the right tensors.
Functional calls (``F.gelu`` inside a ``forward``) are invisible to ``convert``; use the
functional forms (``tempo_gelu``, ``regelu2``, ``resilu2``, ``softmax_dropout_matmul``) there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ._approx import ReGELU2, ReSiLU2
from ._errors import LayerOptionError, LayerTypeError
from ._gelu import TempoGELU
from ._layernorm import DEFAULT_GAMMA_EPS, TempoLayerNorm
from ._merge import MergeReport, merge_norm_affine

__all__ = ["convert", "ConvertReport", "GELU_OPTIONS", "SILU_OPTIONS", "NORM_OPTIONS"]

GELU_OPTIONS = ("tempo", "regelu2", None)
SILU_OPTIONS = ("resilu2", None)
NORM_OPTIONS = ("tempo", "ms", None)


@dataclasses.dataclass
class ConvertReport:
    """What ``convert`` changed: ``replaced["GELU->TempoGELU"] = [module names]`` etc.

    One entry per module name (a module registered under two names is listed twice);
    ``skipped`` maps names to the reason they were left alone.
    """

    replaced: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    merge: MergeReport | None = None

    @property
    def counts(self) -> dict[str, int]:
        """Number of modules replaced, per kind of replacement."""
        return {kind: len(names) for kind, names in self.replaced.items()}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __str__(self) -> str:
        lines = [f"tba.layers.convert: replaced {self.total} modules"]
        for kind, names in self.replaced.items():
            lines.append(f"  {kind}: {len(names)} ({', '.join(names)})")
        for name, why in self.skipped.items():
            lines.append(f"  skipped {name}: {why}")
        return "\n".join(lines)

    def _add(self, kind: str, name: str) -> None:
        self.replaced.setdefault(kind, []).append(name)


def _check_option(option: str, value, accepted: tuple) -> None:
    if value not in accepted or (value is not None and not isinstance(value, str)):
        shown = ", ".join("None" if a is None else repr(a) for a in accepted)
        raise LayerOptionError(
            f"tba.layers.convert: {option}={value!r} is not accepted; use one of {shown}."
        )


def _swap(model: nn.Module, report: ConvertReport, decide) -> None:
    """Replace each submodule for which ``decide(child)`` returns (kind, new); log reasons."""
    memo: dict[int, tuple[str, nn.Module]] = {}
    for name, child in list(model.named_modules(remove_duplicate=False)):
        if not name:
            continue  # the root has no parent to hold a replacement
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if id(child) in memo:  # one module registered under two names stays one module
            kind, new = memo[id(child)]
            setattr(parent, attr, new)
            report._add(kind, name)
            continue
        decision = decide(child)
        if decision is None:
            continue
        if isinstance(decision, str):
            report.skipped[name] = decision
            continue
        kind, new = decision
        memo[id(child)] = (kind, new)
        setattr(parent, attr, new)
        report._add(kind, name)


def convert(
    model: nn.Module,
    gelu: str | None = None,
    silu: str | None = None,
    norm: str | None = None,
    *,
    gamma_eps: float = DEFAULT_GAMMA_EPS,
    norm_mapping: Mapping[str, Sequence[str]] | None = None,
    rms_norm_types: tuple[type, ...] = (),
    skip_unknown: bool = False,
    untie: bool = False,
    example_inputs: tuple | torch.Tensor | None = None,
) -> ConvertReport:
    """Swap modules of ``model`` in place and report what changed.

    Args:
        gelu: ``"tempo"``: ``nn.GELU`` -> ``TempoGELU`` (exact gradient, saves y + 1 bit; the
            tanh form is skipped). ``"regelu2"``: -> ``ReGELU2`` (2 bits, approximate
            gradient). ``None``: leave GELUs.
        silu: ``"resilu2"``: ``nn.SiLU`` -> ``ReSiLU2`` (2 bits, approximate gradient).
        norm: ``"tempo"``: ``nn.LayerNorm`` -> ``TempoLayerNorm`` (exact, saves y; RMSNorms are
            skipped). ``"ms"``: fold every norm's affine part into the Linears it feeds and use
            ``MSLayerNorm`` / ``MSRMSNorm`` (exact, saves only rstd); see ``merge_norm_affine``,
            which receives ``norm_mapping``, ``rms_norm_types``, ``skip_unknown``, ``untie`` and
            ``example_inputs``.
        gamma_eps: ``TempoLayerNorm``'s fallback threshold for ``norm="tempo"``.

    The root module itself is never replaced (it has no parent); wrap it if it is a bare GELU.
    """
    if not isinstance(model, nn.Module):
        raise LayerTypeError(
            f"tba.layers.convert: model must be a torch.nn.Module, got {type(model).__name__}. "
            f"Pass the model object, not its state_dict or output."
        )
    _check_option("gelu", gelu, GELU_OPTIONS)
    _check_option("silu", silu, SILU_OPTIONS)
    _check_option("norm", norm, NORM_OPTIONS)
    report = ConvertReport()

    def decide(child: nn.Module):
        if gelu is not None and isinstance(child, nn.GELU):
            if gelu == "regelu2":
                return "GELU->ReGELU2", ReGELU2(child.approximate)
            if child.approximate != "none":
                return f"TempoGELU supports approximate='none' only, got {child.approximate!r}"
            return "GELU->TempoGELU", TempoGELU()
        if silu is not None and isinstance(child, nn.SiLU):
            return "SiLU->ReSiLU2", ReSiLU2()
        if norm == "tempo" and isinstance(child, nn.LayerNorm):
            if isinstance(child, TempoLayerNorm):
                return None
            return "LayerNorm->TempoLayerNorm", TempoLayerNorm.from_layernorm(child, gamma_eps)
        if norm == "tempo" and hasattr(nn, "RMSNorm") and isinstance(child, nn.RMSNorm):
            return "Tempo has no RMSNorm variant; use norm='ms' to make RMSNorms lean"
        return None

    _swap(model, report, decide)
    if norm == "ms":
        report.merge = merge_norm_affine(
            model,
            norm_mapping,
            rms_norm_types=rms_norm_types,
            skip_unknown=skip_unknown,
            untie=untie,
            example_inputs=example_inputs,
        )
        for name, new_kind in report.merge.replaced.items():
            old = "LayerNorm" if new_kind == "MSLayerNorm" else "RMSNorm"
            report._add(f"{old}->{new_kind}", name)
        for name, why in report.merge.skipped.items():
            report.skipped[name] = why
    return report
