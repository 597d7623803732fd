"""Which Linear-like layers a norm feeds, and which of their weights are shared.

See NOTE [Finding the following Linears] in ``_merge``. A consumer is an ``nn.Linear`` or HF's
``Conv1D`` (GPT-2's ``x @ W + b`` with W stored (in, out)); ``linear_weight`` gives both as an
(out, in) view.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from ._detect import linear_weight
from ._errors import NormMergeError

__all__ = ["NORM_CONSUMERS", "find_consumers", "check_consumer", "shared_weights"]

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


def _resolve(parent: str, rel: str) -> str | None:
    parts = parent.split(".") if parent else []
    while rel.startswith("../"):
        if not parts:
            return None
        parts.pop()
        rel = rel[3:]
    return ".".join([*parts, rel])


def find_consumers(name, modules, mapping, patterns) -> tuple[list[str] | None, str]:
    """(full consumer names, "mapping" or "pattern"), or (None, why none was found)."""
    if name in mapping:
        listed = list(mapping[name])
        return (listed, "mapping") if listed else (None, "mapping= lists no Linears for it")
    parent, _, attr = name.rpartition(".")
    tried = []
    for candidate in patterns.get(attr, ()):
        full = [_resolve(parent, rel) for rel in candidate]
        tried.append("+".join(str(f) for f in full))
        if all(f is not None and linear_weight(modules.get(f)) is not None for f in full):
            return full, "pattern"
    if not tried:
        return None, f"no pattern for attribute name {attr!r}"
    return None, f"no candidate exists as nn.Linear or HF Conv1D (tried {'; '.join(tried)})"


def check_consumer(norm_name, width, lin_name, modules, owners) -> None:
    """Refuse a consumer that is missing, not Linear-like, of the wrong width, or claimed twice."""
    lin = modules.get(lin_name)
    weight = linear_weight(lin) if lin is not None else None
    if weight is None:
        found = "nothing" if lin is None else type(lin).__name__
        raise NormMergeError(
            f"tba.layers.merge_norm_affine: consumer {lin_name!r} of norm {norm_name!r} is "
            f"{found}, not an nn.Linear (or HF Conv1D). Fix the names in mapping= (full module "
            f"names)."
        )
    if weight.shape[1] != width:
        raise NormMergeError(
            f"tba.layers.merge_norm_affine: {lin_name!r} has in_features={weight.shape[1]} but "
            f"norm {norm_name!r} normalizes {width} features, so it cannot be its consumer. "
            f"Fix mapping= for this norm."
        )
    if lin_name in owners:
        raise NormMergeError(
            f"tba.layers.merge_norm_affine: {lin_name!r} is claimed by two norms, "
            f"{owners[lin_name]!r} and {norm_name!r}; a Linear has one input. Fix mapping=."
        )
    owners[lin_name] = norm_name


def shared_weights(model: nn.Module) -> dict[int, list[str]]:
    """For each parameter held by two or more distinct modules (a tie, e.g. lm_head and the
    embedding), all its names. A module registered under two names (an alias) is one holder, so
    folding into it once is safe and its weight is not reported."""
    holders: dict[int, dict[int, list[str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            holders.setdefault(id(p), {}).setdefault(id(module), []).append(full)
    return {
        pid: [n for names in by_module.values() for n in names]
        for pid, by_module in holders.items()
        if len(by_module) > 1
    }


def tie_reason(lin_name: str, modules: Mapping[str, nn.Module], shared) -> str | None:
    """Why folding into ``lin_name`` would change another layer, or None."""
    names = shared.get(id(modules[lin_name].weight))
    if not names:
        return None
    others = [n for n in names if n != lin_name + ".weight"]
    return f"{lin_name}.weight is shared with {', '.join(others)}"
