"""`convert`: swap the activation and norm modules of an existing model for lean ones.

Modules are found by what they compute (NOTE [Recognition by behaviour] in ``_detect``), so HF's
own classes count: ``GELUActivation``, ``NewGELUActivation``, ``GELUTanh``, ``SiLUActivation``,
``LlamaRMSNorm`` and its copies, ``GemmaRMSNorm``. They are replaced in their parents under the
same names, so state_dicts keep their keys (except merged norms, whose weights are folded away)
and parameter objects are reused, so an optimizer built before the call still holds the right
tensors. Functional calls (``F.gelu`` inside a ``forward``) are invisible to ``convert``; use the
functional forms (``tempo_gelu``, ``tempo_silu``, ``regelu2``, ``resilu2``,
``softmax_dropout_matmul``) there. ``preset=`` picks a whole recipe (NOTE [Presets]).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ._approx import ReGELU2, ReSiLU2
from ._detect import LEAN_ALREADY, Norm, classify_activation, classify_norm
from ._errors import LayerOptionError, LayerTypeError
from ._gelu import TempoGELU, TempoSiLU
from ._layernorm import DEFAULT_GAMMA_EPS, TempoLayerNorm
from ._merge import MergeReport, merge_norm_affine
from ._presets import auto_example_inputs, resolve_preset
from ._rmsnorm import TempoRMSNorm

__all__ = ["convert", "ConvertReport", "GELU_OPTIONS", "SILU_OPTIONS", "NORM_OPTIONS"]

logger = logging.getLogger(__name__)

GELU_OPTIONS = ("tempo", "regelu2", None)
SILU_OPTIONS = ("tempo", "resilu2", None)
NORM_OPTIONS = ("tempo", "ms", "ms-or-tempo", None)


@dataclasses.dataclass
class ConvertReport:
    """What ``convert`` changed: ``replaced["GELUActivation->TempoGELU"] = [module names]`` etc.

    One entry per module name (a module registered under two names is listed twice). Keys are
    ``"<old class>-><new class>"``. ``skipped`` maps names of activations and norms that were
    asked for but could not be replaced to the reason; ``kept`` lists activations that already
    save only their output (ReLU, tanh, sigmoid, identity), which need nothing.
    """

    replaced: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    kept: dict[str, str] = dataclasses.field(default_factory=dict)
    merge: MergeReport | None = None
    preset: str | None = None

    @property
    def counts(self) -> dict[str, int]:
        """Number of modules replaced, per kind of replacement."""
        return {kind: len(names) for kind, names in self.replaced.items()}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __str__(self) -> str:
        how = f" (preset {self.preset!r})" if self.preset else ""
        lines = [f"tba.layers.convert: replaced {self.total} modules{how}"]
        for kind, names in self.replaced.items():
            lines.append(f"  {kind}: {len(names)} ({', '.join(names)})")
        for name, why in self.skipped.items():
            lines.append(f"  skipped {name}: {why}")
        for name, why in self.kept.items():
            lines.append(f"  kept {name}: {why}")
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
    """Replace each submodule for which ``decide(child)`` returns a module; record reasons."""
    memo: dict[int, nn.Module | str | None] = {}
    for name, child in list(model.named_modules(remove_duplicate=False)):
        if not name:
            continue  # the root has no parent to hold a replacement
        if id(child) not in memo:  # one module registered under two names stays one module
            memo[id(child)] = decide(child, name, report)
        new = memo[id(child)]
        if isinstance(new, nn.Module):
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
            report._add(f"{type(child).__name__}->{type(new).__name__}", name)


def _lean_activation(kind: str, gelu: str | None, silu: str | None) -> nn.Module | None:
    approximate = "tanh" if kind == "gelu-tanh" else "none"
    if kind in ("gelu", "gelu-tanh"):
        if gelu == "tempo":
            return TempoGELU(approximate)
        return ReGELU2(approximate) if gelu == "regelu2" else None
    if kind == "silu":
        if silu == "tempo":
            return TempoSiLU()
        return ReSiLU2() if silu == "resilu2" else None
    return None


def _tempo_norm(child: nn.Module, spec: Norm, gamma_eps: float) -> nn.Module:
    if spec.kind == "rms":
        return TempoRMSNorm.replacing(child, spec.eps, spec.style, gamma_eps)
    weight, bias = getattr(child, "weight", None), getattr(child, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) else None
    new = TempoLayerNorm(
        spec.hidden, spec.eps, weight is not None, bias is not None, "meta", gamma_eps=gamma_eps
    )
    new.weight, new.bias = weight, bias
    new.train(child.training)
    return new


def convert(
    model: nn.Module,
    gelu: str | None = None,
    silu: str | None = None,
    norm: str | None = None,
    *,
    preset: str | None = None,
    gamma_eps: float = DEFAULT_GAMMA_EPS,
    norm_mapping: Mapping[str, Sequence[str]] | None = None,
    rms_norm_types: tuple[type, ...] = (),
    skip_unknown: bool = False,
    untie: bool = False,
    example_inputs: tuple | torch.Tensor | None = None,
) -> ConvertReport:
    """Swap modules of ``model`` in place and report what changed.

    Args:
        gelu: ``"tempo"``: GELUs (erf or tanh form) -> ``TempoGELU`` (exact gradient, saves
            y + 1 bit). ``"regelu2"``: -> ``ReGELU2`` (2 bits, approximate gradient). ``None``:
            leave GELUs.
        silu: ``"tempo"``: SiLUs -> ``TempoSiLU`` (exact, y + 1 bit). ``"resilu2"``: ->
            ``ReSiLU2`` (2 bits, approximate gradient).
        norm: ``"tempo"``: LayerNorms -> ``TempoLayerNorm``, RMSNorms -> ``TempoRMSNorm`` (exact,
            save y). ``"ms"``: fold every norm's affine part into the Linears it feeds and use
            ``MSLayerNorm`` / ``MSRMSNorm`` (save only rstd; see ``merge_norm_affine``, which
            receives ``norm_mapping``, ``rms_norm_types``, ``skip_unknown``, ``untie`` and
            ``example_inputs``). ``"ms-or-tempo"``: "ms" where the merge is possible (checked
            with ``example_inputs`` when given, or built for an HF model), "tempo" elsewhere.
        preset: a recipe instead of the three options: ``"exact"``, ``"approx"``, or
            ``"<family>-exact"`` / ``"<family>-approx"`` (NOTE [Presets]).
        gamma_eps: the Tempo norms' fallback threshold on ``min |gamma|``.

    The root module itself is never replaced (it has no parent); wrap it if it is a bare GELU.
    """
    if not isinstance(model, nn.Module):
        raise LayerTypeError(
            f"tba.layers.convert: model must be a torch.nn.Module, got {type(model).__name__}. "
            f"Pass the model object, not its state_dict or output."
        )
    if preset is not None:
        if (gelu, silu, norm) != (None, None, None):
            raise LayerOptionError(
                f"tba.layers.convert: preset={preset!r} and gelu/silu/norm were both given. "
                f"Pass a preset alone, or the three options without one."
            )
        options = resolve_preset(preset, model)
        gelu, silu, norm = options["gelu"], options["silu"], options["norm"]
    _check_option("gelu", gelu, GELU_OPTIONS)
    _check_option("silu", silu, SILU_OPTIONS)
    _check_option("norm", norm, NORM_OPTIONS)
    report = ConvertReport(preset=preset)
    if norm in ("ms", "ms-or-tempo"):
        merge_options = (norm_mapping, rms_norm_types, skip_unknown, untie, example_inputs)
        _merge(model, report, norm, *merge_options)

    def decide(child: nn.Module, name: str, report: ConvertReport):
        if gelu is not None or silu is not None:
            act = classify_activation(child)
            if act is not None:
                if act.kind is None:
                    report.skipped[name] = act.reason
                elif act.kind in LEAN_ALREADY:
                    report.kept[name] = f"{act.kind}: saves only its output, or nothing"
                return _lean_activation(act.kind, gelu, silu) if act.kind else None
        if norm in ("tempo", "ms-or-tempo"):
            if isinstance(child, nn.LayerNorm) and not isinstance(child, TempoLayerNorm):
                return TempoLayerNorm.from_layernorm(child, gamma_eps)  # any normalized_shape
            spec = classify_norm(child, rms_norm_types)
            if isinstance(spec, str):
                report.skipped[name] = spec
            elif spec is not None:
                return _tempo_norm(child, spec, gamma_eps)
        return None

    _swap(model, report, decide)
    logger.debug("%s", report)
    return report


def _merge(model, report, norm, mapping, rms_norm_types, skip_unknown, untie, inputs) -> None:
    """Run ``merge_norm_affine`` and record its replacements as ``<old>->MS...`` entries."""
    old = {name: type(m).__name__ for name, m in model.named_modules()}
    lenient = norm == "ms-or-tempo"
    if lenient and inputs is None:
        inputs = auto_example_inputs(model)
    report.merge = merge_norm_affine(
        model,
        mapping,
        rms_norm_types=rms_norm_types,
        skip_unknown=skip_unknown or lenient,
        skip_tied=lenient and not untie,
        untie=untie,
        example_inputs=inputs,
    )
    for name, new_kind in report.merge.replaced.items():
        report._add(f"{old[name]}->{new_kind}", name)
    if not lenient:  # with "ms-or-tempo" the Tempo pass handles (or reports) what was left
        report.skipped.update(report.merge.skipped)
