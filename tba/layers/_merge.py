"""`merge_norm_affine`: fold each norm's gamma and beta into the Linears it feeds.

For a norm y = gamma * x_hat + beta feeding Linears W x + b, each consumer becomes
W' = W diag(gamma), b' = b + W beta (computed in float64, rounded once), and the norm becomes
``MSLayerNorm`` / ``MSRMSNorm``, which saves only rstd (see ``_msnorm``).

NOTE [Finding the following Linears]
The data flow of an ``nn.Module`` is not visible statically, so consumers come from, in order:
  1. ``mapping={"norm.name": ["linear.name", ...]}``: exact, full module names.
  2. ``NORM_CONSUMERS``: a table keyed by the norm's attribute name, giving candidate consumer
     paths relative to the norm's parent module ("../" climbs one level). The first candidate
     whose modules all exist and are ``nn.Linear`` wins. It covers nanoGPT/W1-style pre-LN
     blocks (ln_1/ln_2, ln1/ln2, norm1/norm2), LLaMA/Mistral/Qwen2 (input_layernorm ->
     q/k/v_proj, post_attention_layernorm -> gate/up_proj, final norm -> lm_head) and OPT.
     ``patterns=`` adds or overrides entries.
  3. Otherwise: ``NormMergeError`` (or, with ``skip_unknown=True``, the norm is left as is).
A name is a convention, not a proof (Gemma-2's post_attention_layernorm normalizes the attention
output, not the MLP input). Pass ``example_inputs`` to check the data flow: one no-grad eval
forward before merging records that every consumer receives the norm's output (or a view of
it); one after merging checks the model's outputs still match. On failure the model is
restored and ``NormMergeError`` says which norm is wrong.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ._errors import NormMergeError
from ._msnorm import MSLayerNorm, MSRMSNorm

__all__ = ["merge_norm_affine", "MergeReport", "NORM_CONSUMERS"]

_QKV = ("attn.q_proj", "attn.k_proj", "attn.v_proj")
_PRE_ATTN = (("attn.c_attn",), ("attn.qkv",), _QKV, ("qkv",))
_PRE_MLP = (("mlp.c_fc",), ("mlp.fc1",), ("mlp.gate_proj", "mlp.up_proj"), ("fc1",))
_HF_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_FINAL = (("lm_head",), ("../lm_head",), ("head",))

NORM_CONSUMERS: dict[str, tuple[tuple[str, ...], ...]] = {
    "ln_1": _PRE_ATTN,
    "ln1": _PRE_ATTN,
    "norm1": _PRE_ATTN,
    "ln_2": _PRE_MLP,
    "ln2": _PRE_MLP,
    "norm2": _PRE_MLP,
    "input_layernorm": (_HF_QKV, ("self_attn.qkv_proj",)),
    "post_attention_layernorm": (("mlp.gate_proj", "mlp.up_proj"), ("mlp.gate_up_proj",)),
    "self_attn_layer_norm": (_HF_QKV,),
    "final_layer_norm": (("fc1",), ("../../lm_head",), ("../lm_head",)),
    "ln_f": _FINAL,
    "final_norm": _FINAL,
    "norm": (("../lm_head",), ("lm_head",)),
}


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


def _norm_kind(module: nn.Module, rms_norm_types: tuple[type, ...]) -> str | None:
    if isinstance(module, (MSLayerNorm, MSRMSNorm)):
        return None
    if isinstance(module, nn.LayerNorm):  # includes TempoLayerNorm
        return "layer"
    if (hasattr(nn, "RMSNorm") and isinstance(module, nn.RMSNorm)) or isinstance(
        module, rms_norm_types
    ):
        return "rms"
    return None


def _rms_eps(module: nn.Module):
    for attr in ("eps", "variance_epsilon"):
        if hasattr(module, attr):
            return getattr(module, attr)
    raise NormMergeError(
        f"tba.layers.merge_norm_affine: {type(module).__name__} has neither 'eps' nor "
        f"'variance_epsilon'. Only LLaMA-style RMSNorm classes (weight * x * rsqrt(mean(x^2) + "
        f"eps)) can be listed in rms_norm_types."
    )


def _resolve(parent: str, rel: str) -> str | None:
    parts = parent.split(".") if parent else []
    while rel.startswith("../"):
        if not parts:
            return None
        parts.pop()
        rel = rel[3:]
    return ".".join([*parts, rel])


def _find_consumers(name, modules, mapping, patterns) -> tuple[list[str] | None, str]:
    if name in mapping:
        listed = list(mapping[name])
        return (listed, "mapping") if listed else (None, "mapping= lists no Linears for it")
    parent, _, attr = name.rpartition(".")
    tried = []
    for candidate in patterns.get(attr, ()):
        full = [_resolve(parent, rel) for rel in candidate]
        tried.append("+".join(str(f) for f in full))
        if all(f is not None and isinstance(modules.get(f), nn.Linear) for f in full):
            return full, "pattern"
    if not tried:
        return None, f"no pattern for attribute name {attr!r}"
    return None, f"no candidate exists as nn.Linear (tried {'; '.join(tried)})"


def _check_consumer(norm_name, width, lin_name, modules, owners):
    lin = modules.get(lin_name)
    if not isinstance(lin, nn.Linear):
        found = "nothing" if lin is None else type(lin).__name__
        raise NormMergeError(
            f"tba.layers.merge_norm_affine: consumer {lin_name!r} of norm {norm_name!r} is "
            f"{found}, not an nn.Linear. Fix the names in mapping= (full module names)."
        )
    if lin.in_features != width:
        raise NormMergeError(
            f"tba.layers.merge_norm_affine: {lin_name!r} has in_features={lin.in_features} but "
            f"norm {norm_name!r} normalizes {width} features, so it cannot be its consumer. "
            f"Fix mapping= for this norm."
        )
    if lin_name in owners:
        raise NormMergeError(
            f"tba.layers.merge_norm_affine: {lin_name!r} is claimed by two norms, "
            f"{owners[lin_name]!r} and {norm_name!r}; a Linear has one input. Fix mapping=."
        )
    owners[lin_name] = norm_name


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


def _shared_params(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(pname)
    return names


def merge_norm_affine(
    model: nn.Module,
    mapping: Mapping[str, Sequence[str]] | None = None,
    *,
    patterns: Mapping[str, Sequence[Sequence[str]]] | None = None,
    rms_norm_types: tuple[type, ...] = (),
    skip_unknown: bool = False,
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
        rms_norm_types: extra classes computing ``weight * x * rsqrt(mean(x^2) + eps)`` (e.g.
            ``LlamaRMSNorm``) to treat like ``nn.RMSNorm``. Never list Gemma's ``(1 + weight)``.
        skip_unknown: leave norms whose consumers are unknown instead of raising.
        untie: give a consumer whose weight is shared (e.g. lm_head tied to the embedding) its
            own copy instead of raising; the tie is broken for good.
        example_inputs: if given, check the data flow and the outputs (see the NOTE).
        verify_tol: allowed max |merged - original| / max(1, max |original|) in that check.

    Returns a ``MergeReport``. The merged model has no norm weights in its state_dict.
    """
    mapping = dict(mapping or {})
    table = dict(NORM_CONSUMERS)
    table.update({k: tuple(tuple(c) for c in v) for k, v in (patterns or {}).items()})
    modules = dict(model.named_modules())
    for key in mapping:
        if _norm_kind(modules.get(key, nn.Identity()), rms_norm_types) is None:
            raise NormMergeError(
                f"tba.layers.merge_norm_affine: mapping names {key!r}, which is not a "
                f"LayerNorm/RMSNorm of the model. Use full names from model.named_modules()."
            )
    report = MergeReport()
    plan: list[tuple[str, nn.Module, nn.Module, list[str]]] = []
    owners: dict[str, str] = {}
    for name, module in modules.items():
        kind = _norm_kind(module, rms_norm_types)
        if kind is None:
            continue
        has_affine = getattr(module, "weight", None) is not None
        shape = tuple(getattr(module, "normalized_shape", None) or module.weight.shape)
        width = int(shape[-1])
        if len(shape) != 1 and has_affine:
            raise NormMergeError(
                f"tba.layers.merge_norm_affine: {name!r} normalizes over {shape}; only a "
                f"last-dim norm can be folded into a Linear. Leave it out with "
                f"skip_unknown=True or merge it by hand."
            )
        consumers: list[str] = []
        if has_affine:
            found, how = _find_consumers(name, modules, mapping, table)
            if not found:
                if skip_unknown:
                    report.skipped[name] = how
                    continue
                raise NormMergeError(
                    f"tba.layers.merge_norm_affine: cannot determine the Linears fed by "
                    f"{name!r} ({type(module).__name__}): {how}. Pass mapping={{{name!r}: "
                    f"[...Linear names...]}} or skip_unknown=True."
                )
            for lin_name in found:
                _check_consumer(name, width, lin_name, modules, owners)
            consumers = found
        plan.append((name, module, _ms_replacement(module, kind), consumers))

    shared = _shared_params(model)
    for _name, _module, _ms, consumers in plan:
        for lin_name in consumers:
            tied = shared[id(modules[lin_name].weight)]
            if len(tied) > 1 and not untie:
                raise NormMergeError(
                    f"tba.layers.merge_norm_affine: {lin_name}.weight is shared with "
                    f"{', '.join(t for t in tied if t != lin_name + '.weight')}; folding gamma "
                    f"into it would change those too. Pass untie=True to give {lin_name!r} its "
                    f"own copy, or leave this norm out via mapping/skip_unknown."
                )

    reference = None
    if example_inputs is not None:
        reference = _record_flow(model, plan, modules, example_inputs)

    undo = _Undo(model)
    with torch.no_grad():
        for name, module, ms, consumers in plan:
            _fold(module, consumers, modules, shared, undo, report, untie)
            undo.modules.append((name, module))
            _set_module(model, name, ms)
            report.replaced[name] = type(ms).__name__
            if consumers:
                report.merged[name] = consumers
    if reference is not None:
        try:
            _check_outputs(model, example_inputs, reference, verify_tol)
        except NormMergeError:
            undo.restore()
            raise
        report.verified = True
    return report


def _fold(norm, consumers, modules, shared, undo, report, untie) -> None:
    gamma = norm.weight.detach().to(torch.float64) if norm.weight is not None else None
    bias = getattr(norm, "bias", None)
    beta = bias.detach().to(torch.float64) if isinstance(bias, torch.Tensor) else None
    for lin_name in consumers:
        lin = modules[lin_name]
        undo.save_linear(lin)
        if untie and len(shared[id(lin.weight)]) > 1:
            lin.weight = nn.Parameter(lin.weight.detach().clone())
            report.untied.append(f"{lin_name}.weight")
        w64 = lin.weight.detach().to(torch.float64)
        if beta is not None:
            shift = w64 @ beta  # uses W before gamma is folded in
            if lin.bias is None:
                lin.bias = nn.Parameter(torch.zeros_like(lin.weight[:, 0]))
                report.added_biases.append(lin_name)
            lin.bias.copy_((lin.bias.detach().to(torch.float64) + shift).to(lin.bias.dtype))
        if gamma is not None:
            lin.weight.copy_((w64 * gamma).to(lin.weight.dtype))


def _ms_replacement(norm: nn.Module, kind: str) -> nn.Module:
    if kind == "layer":
        return MSLayerNorm(norm.normalized_shape, norm.eps)
    shape = getattr(norm, "normalized_shape", None) or (norm.weight.shape[-1],)
    return MSRMSNorm(shape, _rms_eps(norm))


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


def _record_flow(model, plan, modules, example_inputs) -> list[torch.Tensor]:
    outputs: dict[str, list[torch.Tensor]] = {}
    inputs: dict[str, list[torch.Tensor]] = {}
    handles = []

    def on_norm(name):
        return lambda _m, _args, out: outputs.setdefault(name, []).append(out)

    def on_linear(name):
        return lambda _m, args: inputs.setdefault(name, []).append(args[0])

    for name, _module, _ms, consumers in plan:
        if consumers:
            handles.append(modules[name].register_forward_hook(on_norm(name)))
            for lin_name in consumers:
                handles.append(modules[lin_name].register_forward_pre_hook(on_linear(lin_name)))
    try:
        reference = _run(model, example_inputs)
    finally:
        for h in handles:
            h.remove()
    for name, _module, _ms, consumers in plan:
        storages = {o.untyped_storage().data_ptr() for o in outputs.get(name, [])}
        for lin_name in consumers:
            seen = inputs.get(lin_name, [])
            if not seen or any(t.untyped_storage().data_ptr() not in storages for t in seen):
                what = "was not called" if not seen else "received a tensor that is not its output"
                raise NormMergeError(
                    f"tba.layers.merge_norm_affine: {lin_name!r} {what} (checked with "
                    f"example_inputs), so it is not a consumer of {name!r}. Fix mapping= for "
                    f"{name!r} or leave it out with skip_unknown=True."
                )
    return reference


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
