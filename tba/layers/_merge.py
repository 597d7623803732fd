"""`merge_norm_affine`: fold each norm's gamma and beta into the Linears it feeds.

For a norm y = gamma * x_hat + beta feeding Linears W x + b, each consumer becomes
W' = W diag(gamma), b' = b + W beta (computed in float64, rounded once), and the norm becomes
``MSLayerNorm`` / ``MSRMSNorm``, which saves only rstd (see ``_msnorm``).

NOTE [Finding the following Linears]
The data flow of an ``nn.Module`` is not visible statically, so consumers come from, in order:
  1. ``mapping={"norm.name": ["linear.name", ...]}``: exact, full module names.
  2. ``NORM_CONSUMERS``: a table keyed by the norm's attribute name, giving candidate consumer
     paths relative to the norm's parent module ("../" climbs one level). The first candidate
     whose modules all exist and are Linear-like (``nn.Linear`` or HF's ``Conv1D``) wins. It
     covers nanoGPT-style (tba.testing.GPT) and HF GPT-2 pre-LN blocks (ln_1/ln_2 ->
     c_attn/c_fc, ln1/ln2, norm1/norm2), LLaMA/Mistral/Qwen2/Gemma (input_layernorm -> q/k/v_proj,
     post_attention_layernorm -> gate/up_proj, final norm -> lm_head) and OPT.
     ``patterns=`` adds or overrides entries.
  3. Otherwise: ``NormMergeError`` (or, with ``skip_unknown=True``, the norm is left as is).
A name is a convention, not a proof (Gemma-2's post_attention_layernorm normalizes the attention
output, not the MLP input). Pass ``example_inputs`` to check the data flow: one no-grad eval
forward before merging records that every consumer receives the norm's output (or a view of
it); with ``skip_unknown=True`` a norm that fails this check is left as is, otherwise it raises.
One forward after merging checks the model's outputs still match; on failure the model is
restored and ``NormMergeError`` says so.

NOTE [Shared weights]
Folding writes gamma into a consumer's weight, so a weight held by another module too (an lm_head
tied to the embedding, two Linears given one Parameter) would change that module as well. Such a
norm is refused with ``NormMergeError``; ``skip_tied=True`` leaves it as is instead (reported in
``skipped``), and ``untie=True`` gives the consumer its own copy (the tie is broken for good).
One module registered under two names is one holder, not a tie. Norms are recognised as
in NOTE [Recognition by behaviour] (``_detect``); gamma is ``offset + weight`` (1 + weight
for Gemma).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ._consumers import NORM_CONSUMERS, check_consumer, find_consumers, shared_weights, tie_reason
from ._detect import Norm, classify_norm, linear_weight
from ._errors import NormMergeError
from ._msnorm import MSLayerNorm, MSRMSNorm
from ._rmsnorm import TempoRMSNorm

__all__ = ["merge_norm_affine", "MergeReport", "NORM_CONSUMERS"]


@dataclasses.dataclass
class MergeReport:
    """What ``merge_norm_affine`` did. Names are ``model.named_modules()`` names."""

    merged: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    replaced: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    added_biases: list[str] = dataclasses.field(default_factory=list)
    untied: list[str] = dataclasses.field(default_factory=list)
    verified: bool = False

    def __str__(self) -> str:
        lines = [f"merged {len(self.merged)} norms, replaced {len(self.replaced)}"]
        lines += [f"  {n} -> {', '.join(c)}" for n, c in self.merged.items()]
        lines += [f"  skipped {n}: {why}" for n, why in self.skipped.items()]
        if self.added_biases:
            lines.append(f"  added biases to {', '.join(self.added_biases)}")
        if self.untied:
            lines.append(f"  untied {', '.join(self.untied)}")
        return "\n".join(lines)


def _rms_eps(module: nn.Module):
    for attr in ("eps", "variance_epsilon"):
        if hasattr(module, attr):
            return getattr(module, attr)
    raise NormMergeError(
        f"tba.layers.merge_norm_affine: {type(module).__name__} has neither 'eps' nor "
        f"'variance_epsilon'. Only LLaMA-style RMSNorm classes (weight * x * rsqrt(mean(x^2) + "
        f"eps)) can be listed in rms_norm_types."
    )


def _norm_spec(module: nn.Module, rms_norm_types: tuple[type, ...]) -> Norm | str | None:
    """What to fold: a ``Norm``, a reason this norm-like module cannot be merged, or None."""
    if isinstance(module, (MSLayerNorm, MSRMSNorm)):
        return None
    if isinstance(module, nn.LayerNorm):  # includes TempoLayerNorm
        return Norm("layer", module.normalized_shape[-1], module.eps, 0.0, "layer")
    if isinstance(module, nn.RMSNorm):
        return Norm("rms", module.normalized_shape[-1], module.eps, 0.0, "torch")
    if isinstance(module, TempoRMSNorm):
        return Norm("rms", module.hidden, module.eps, module.offset, module.style)
    if isinstance(module, rms_norm_types):
        return Norm("rms", module.weight.shape[-1], _rms_eps(module), 0.0, "llama")
    return classify_norm(module)


class _Undo:
    """Originals of everything the merge changes, to restore the model if verification fails."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.linears: list[tuple] = []
        self.modules: list[tuple[str, nn.Module]] = []

    def save_linear(self, lin: nn.Linear) -> None:
        w, b = lin.weight, lin.bias
        self.linears.append(
            (lin, w, w.detach().clone(), b, None if b is None else b.detach().clone())
        )

    def restore(self) -> None:
        with torch.no_grad():
            for lin, w, w_data, b, b_data in reversed(self.linears):
                w.copy_(w_data)
                lin.weight = w  # undoes untie
                if b is not None:
                    b.copy_(b_data)
                lin.bias = b  # undoes an added bias
        for name, module in reversed(self.modules):
            _set_module(self.model, name, module)


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def merge_norm_affine(
    model: nn.Module,
    mapping: Mapping[str, Sequence[str]] | None = None,
    *,
    patterns: Mapping[str, Sequence[Sequence[str]]] | None = None,
    rms_norm_types: tuple[type, ...] = (),
    skip_unknown: bool = False,
    skip_tied: bool = False,
    untie: bool = False,
    example_inputs: tuple | torch.Tensor | None = None,
    verify_tol: float = 1e-4,
) -> MergeReport:
    """Fold every LayerNorm/RMSNorm's affine part into its consumer Linears, in place.

    Args:
        model: modified in place. Linear parameter objects are kept (``copy_``), so optimizer
            references stay valid, except for biases added where beta != None meets a
            bias-free Linear, and weights untied with ``untie=True`` (both listed in the report).
        mapping: ``{norm_name: [linear_name, ...]}``; overrides the pattern table for those norms.
        patterns: extra ``NORM_CONSUMERS`` entries (attribute name -> candidate path tuples).
        rms_norm_types: classes to take as ``weight * x * rsqrt(mean(x^2) + eps)`` without
            probing them. Other norm classes (``LlamaRMSNorm``, ``GemmaRMSNorm``) are recognised
            by behaviour (NOTE [Recognition by behaviour]); never list Gemma's ``(1 + weight)``.
        skip_unknown: leave norms whose consumers are unknown, or fail the data-flow check,
            instead of raising (listed in ``skipped``).
        skip_tied: leave norms whose consumers share their weight (NOTE [Shared weights]).
        untie: give such a consumer its own copy of the weight instead; the tie is broken.
        example_inputs: if given, check the data flow and the outputs (see the NOTE).
        verify_tol: allowed max |merged - original| / max(1, max |original|) in that check.

    Returns a ``MergeReport``. The merged model has no norm weights in its state_dict.
    """
    mapping = dict(mapping or {})
    table = dict(NORM_CONSUMERS)
    table.update({k: tuple(tuple(c) for c in v) for k, v in (patterns or {}).items()})
    modules = dict(model.named_modules())
    for key in mapping:
        if not isinstance(_norm_spec(modules.get(key, nn.Identity()), rms_norm_types), Norm):
            raise NormMergeError(
                f"tba.layers.merge_norm_affine: mapping names {key!r}, which is not a "
                f"LayerNorm/RMSNorm of the model. Use full names from model.named_modules()."
            )
    report = MergeReport()
    plan: list[_Planned] = []
    owners: dict[str, str] = {}
    shared = shared_weights(model)
    for name, module in modules.items():
        spec = _norm_spec(module, rms_norm_types)
        if spec is None:
            continue
        if isinstance(spec, str):  # a norm-like class that computes no known norm
            report.skipped[name] = spec
            continue
        planned = _plan_norm(name, module, spec, modules, mapping, table, owners, skip_unknown)
        if isinstance(planned, str):
            report.skipped[name] = planned
            continue
        tied = [r for r in (tie_reason(c, modules, shared) for c in planned.consumers) if r]
        if tied and not untie:
            if skip_tied:
                report.skipped[name] = f"{tied[0]}; folding gamma into it would change both"
                continue
            raise NormMergeError(
                f"tba.layers.merge_norm_affine: {tied[0]}; folding gamma into it would change "
                f"those too. Pass untie=True to give {planned.consumers[0]!r} its own copy, "
                f"skip_tied=True to leave this norm as is, or leave it out via mapping/"
                f"skip_unknown."
            )
        plan.append(planned)

    reference = None
    if example_inputs is not None:
        reference, failed = _record_flow(model, plan, modules, example_inputs)
        if failed and not skip_unknown:
            raise NormMergeError(next(iter(failed.values())))
        report.skipped.update(failed)
        plan = [p for p in plan if p.name not in failed]

    undo = _Undo(model)
    with torch.no_grad():
        for p in plan:
            _fold(p, modules, shared, undo, report, untie)
            undo.modules.append((p.name, p.module))
            _set_module(model, p.name, p.replacement)
            report.replaced[p.name] = type(p.replacement).__name__
            if p.consumers:
                report.merged[p.name] = p.consumers
    if reference is not None:
        try:
            _check_outputs(model, example_inputs, reference, verify_tol)
        except NormMergeError:
            undo.restore()
            raise
        report.verified = True
    return report


@dataclasses.dataclass
class _Planned:
    name: str
    module: nn.Module
    spec: Norm
    replacement: nn.Module
    consumers: list[str]


def _plan_norm(name, module, spec, modules, mapping, table, owners, skip_unknown):
    """A ``_Planned`` merge for one norm, or the reason to skip it (``skip_unknown``)."""
    has_affine = getattr(module, "weight", None) is not None
    shape = tuple(getattr(module, "normalized_shape", None) or (spec.hidden,))
    if len(shape) != 1 and has_affine:
        raise NormMergeError(
            f"tba.layers.merge_norm_affine: {name!r} normalizes over {shape}; only a "
            f"last-dim norm can be folded into a Linear. Leave it out with "
            f"skip_unknown=True or merge it by hand."
        )
    consumers: list[str] = []
    if has_affine:
        found, how = find_consumers(name, modules, mapping, table)
        if not found:
            if skip_unknown:
                return how
            raise NormMergeError(
                f"tba.layers.merge_norm_affine: cannot determine the Linears fed by "
                f"{name!r} ({type(module).__name__}): {how}. Pass mapping={{{name!r}: "
                f"[...Linear names...]}} or skip_unknown=True."
            )
        for lin_name in found:
            check_consumer(name, int(shape[-1]), lin_name, modules, owners)
        consumers = found
    if spec.kind == "layer":
        replacement = MSLayerNorm(shape, spec.eps)
    else:
        replacement = MSRMSNorm(shape, spec.eps)
    return _Planned(name, module, spec, replacement, consumers)


def _fold(p: _Planned, modules, shared, undo, report, untie) -> None:
    weight = getattr(p.module, "weight", None)
    gamma = None if weight is None else p.spec.offset + weight.detach().to(torch.float64)
    bias = getattr(p.module, "bias", None)
    beta = bias.detach().to(torch.float64) if isinstance(bias, torch.Tensor) else None
    for lin_name in p.consumers:
        lin = modules[lin_name]
        undo.save_linear(lin)
        if untie and tie_reason(lin_name, modules, shared):
            lin.weight = nn.Parameter(lin.weight.detach().clone())
            report.untied.append(f"{lin_name}.weight")
        w_out_in = linear_weight(lin)  # a view: writing it writes the parameter
        w64 = w_out_in.detach().to(torch.float64)
        if beta is not None:
            shift = w64 @ beta  # uses W before gamma is folded in
            if lin.bias is None:
                lin.bias = nn.Parameter(torch.zeros_like(w_out_in[:, 0]))
                report.added_biases.append(lin_name)
            lin.bias.copy_((lin.bias.detach().to(torch.float64) + shift).to(lin.bias.dtype))
        if gamma is not None:
            w_out_in.copy_((w64 * gamma).to(w_out_in.dtype))


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _run(model: nn.Module, example_inputs) -> list[torch.Tensor]:
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    was_training = model.training
    model.eval()  # no dropout, so the two runs are comparable
    try:
        with torch.no_grad():
            return [t.detach().clone() for t in _tensors(model(*args))]
    finally:
        model.train(was_training)


def _record_flow(model, plan, modules, example_inputs):
    """One eval forward: (the outputs, {norm name: why a listed consumer is not fed by it})."""
    outputs: dict[str, list[torch.Tensor]] = {}
    inputs: dict[str, list[torch.Tensor]] = {}
    handles = []

    def on_norm(name):
        return lambda _m, _args, out: outputs.setdefault(name, []).append(out)

    def on_linear(name):
        return lambda _m, args: inputs.setdefault(name, []).append(args[0])

    for p in plan:
        if p.consumers:
            handles.append(modules[p.name].register_forward_hook(on_norm(p.name)))
            for lin_name in p.consumers:
                handles.append(modules[lin_name].register_forward_pre_hook(on_linear(lin_name)))
    try:
        reference = _run(model, example_inputs)
    finally:
        for h in handles:
            h.remove()
    failed: dict[str, str] = {}
    for p in plan:
        storages = {o.untyped_storage().data_ptr() for o in outputs.get(p.name, [])}
        for lin_name in p.consumers:
            seen = inputs.get(lin_name, [])
            if not seen or any(t.untyped_storage().data_ptr() not in storages for t in seen):
                what = "was not called" if not seen else "received a tensor that is not its output"
                failed[p.name] = (
                    f"tba.layers.merge_norm_affine: {lin_name!r} {what} (checked with "
                    f"example_inputs), so it is not a consumer of {p.name!r}. Fix mapping= for "
                    f"{p.name!r} or leave it out with skip_unknown=True."
                )
                break
    return reference, failed


def _check_outputs(model, example_inputs, reference, tol) -> None:
    merged = _run(model, example_inputs)
    errors = [0.0]
    for ref, out in zip(reference, merged):
        if ref.numel():
            scale = max(1.0, float(ref.abs().max()))
            errors.append(float((out.double() - ref.double()).abs().max()) / scale)
    worst = float("nan") if any(e != e for e in errors) else max(errors)  # NaN is a failure
    if len(merged) != len(reference) or not worst <= tol:
        raise NormMergeError(
            f"tba.layers.merge_norm_affine: merging changed the model's outputs by {worst:.3g} "
            f"(relative, allowed {tol:g}); the model was restored. A norm's output probably "
            f"also feeds something other than its listed Linears (a residual, a dropout, a "
            f"non-Linear layer). Pass mapping= without that norm, or skip_unknown=True."
        )
