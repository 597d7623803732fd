"""Recognise activations, norms and Linear-like layers by what they compute, not by class name.

NOTE [Recognition by behaviour]
HF models define their own classes (``GELUActivation``, ``NewGELUActivation``, ``GELUTanh``,
``SiLUActivation``, ``LlamaRMSNorm`` and its per-model copies, ``GemmaRMSNorm``), and a list of
names would go stale with every release. Instead:
  1. Candidates. A leaf module is an activation candidate if its class comes from
     ``torch.nn.modules.activation`` or a module named ``*activations``, or its name contains
     an activation word (``ACTIVATION_WORDS``); a norm candidate if it is an ``nn.LayerNorm``
     or ``nn.RMSNorm`` or its class name contains "norm" (batch, group, instance and local
     response norms excepted). ``rms_norm_types`` forces a class to count as a Llama-style RMSNorm.
  2. Probe. A candidate runs once, under no_grad, on a fixed input: activations on a float64 grid
     over [-60, 60], compared with GELU (erf), GELU (tanh), SiLU and the curves that already save
     only their output (ReLU, tanh, sigmoid, identity) within 1e-9; norms on two float32 inputs
     (unit scale and 1e-2 scale, so that eps shows), compared with LayerNorm, ``weight * x_hat``
     and ``(1 + weight) * x_hat`` within 1e-5, using the module's own weight, bias and eps.
  3. A candidate that matches nothing, has parameters it should not have, or fails to run is
     *unknown*: ``convert`` reports it with the reason instead of skipping it silently.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Activation", "Norm", "classify_activation", "classify_norm", "linear_weight"]

ACTIVATION_WORDS = ("activation", "gelu", "silu", "swish", "relu", "mish", "sigmoid", "tanh")
_NOT_LAYER_NORMS = ("batchnorm", "groupnorm", "instancenorm", "localresponsenorm")
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")
# In torch.nn.modules.activation but not elementwise; softmax keeps only its output anyway.
_NOT_ELEMENTWISE = (nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d, nn.MultiheadAttention)
_ACT_TOL = 1e-9
_NORM_TOL = 1e-5


def _act_references(x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "gelu": F.gelu(x),
        "gelu-tanh": F.gelu(x, approximate="tanh"),
        "silu": F.silu(x),
        "relu": F.relu(x),
        "tanh": torch.tanh(x),
        "sigmoid": torch.sigmoid(x),
        "identity": x,
    }


LEAN_ALREADY = ("relu", "tanh", "sigmoid", "identity")  # save only their output, or nothing


@dataclasses.dataclass(frozen=True)
class Activation:
    """``kind``: "gelu", "gelu-tanh", "silu", one of ``LEAN_ALREADY``, or None (unknown)."""

    kind: str | None
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Norm:
    """A recognised last-dim norm: ``kind`` "layer" or "rms"; gamma = ``offset`` + weight."""

    kind: str
    hidden: int
    eps: float | None
    offset: float
    style: str  # for TempoRMSNorm: "llama", "gemma" or "torch"; "layer" for LayerNorms


def _is_leaf(module: nn.Module) -> bool:
    return next(module.children(), None) is None


def _is_ours(module: nn.Module) -> bool:
    return type(module).__module__.startswith("tba.layers")


def _is_activation_candidate(module: nn.Module) -> bool:
    cls = type(module)
    if _is_ours(module) or not _is_leaf(module) or isinstance(module, _NOT_ELEMENTWISE):
        return False
    where = cls.__module__
    if where == "torch.nn.modules.activation" or where.endswith("activations"):
        return True
    return any(word in cls.__name__.lower() for word in ACTIVATION_WORDS)


def classify_activation(module: nn.Module) -> Activation | None:
    """None if ``module`` is not an activation candidate (NOTE [Recognition by behaviour])."""
    if not _is_activation_candidate(module):
        return None
    name = type(module).__name__
    if any(True for _ in module.parameters()):
        return Activation(None, f"{name} has parameters; no lean variant of it exists")
    x = torch.cat(
        [torch.linspace(-12.0, 12.0, 2401, dtype=torch.float64), torch.tensor([-60.0, 60.0])]
    )
    try:
        with torch.no_grad():
            out = module(x.clone())
    except Exception as exc:  # any failure means: not a plain elementwise activation
        return Activation(None, f"{name} could not be probed ({type(exc).__name__}: {exc})")
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return Activation(None, f"{name} is not elementwise (probe output {type(out).__name__})")
    for kind, ref in _act_references(x).items():
        if bool(((out.double() - ref).abs() <= _ACT_TOL * (1.0 + ref.abs())).all()):
            return Activation(kind)
    return Activation(
        None,
        f"{name} computes none of GELU (erf), GELU (tanh), SiLU on a probe; "
        f"no lean variant of it exists",
    )


def _eps_of(module: nn.Module) -> tuple[bool, float | None]:
    for attr in _EPS_ATTRS:
        if hasattr(module, attr):
            return True, getattr(module, attr)
    return False, None


def _norm_candidate(module: nn.Module, rms_norm_types: tuple[type, ...]) -> bool:
    if _is_ours(module) or not _is_leaf(module):
        return False
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, *rms_norm_types)):
        return True
    name = type(module).__name__.lower()
    return "norm" in name and not any(word in name for word in _NOT_LAYER_NORMS)


def classify_norm(module: nn.Module, rms_norm_types: tuple[type, ...] = ()) -> Norm | str | None:
    """A ``Norm``, a reason why this norm-like module cannot be handled, or None (not a norm)."""
    if not _norm_candidate(module, rms_norm_types):
        return None
    name = type(module).__name__
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if isinstance(module, nn.LayerNorm):
        if len(module.normalized_shape) != 1:
            return f"{name} normalizes over {tuple(module.normalized_shape)}, not the last dim only"
        return Norm("layer", module.normalized_shape[0], module.eps, 0.0, "layer")
    if isinstance(module, nn.RMSNorm):
        if len(module.normalized_shape) != 1:
            return f"{name} normalizes over {tuple(module.normalized_shape)}, not the last dim only"
        return Norm("rms", module.normalized_shape[0], module.eps, 0.0, "torch")
    has_eps, eps = _eps_of(module)
    if not has_eps:
        return f"{name} has none of the attributes {', '.join(_EPS_ATTRS)}"
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return f"{name} has no 1-D weight to tell its width"
    extra = {n for n, _ in module.named_parameters()} - {"weight", "bias"}
    if extra:
        return f"{name} has parameters besides weight and bias: {', '.join(sorted(extra))}"
    if isinstance(module, rms_norm_types):
        return Norm("rms", weight.shape[0], eps, 0.0, "llama")
    if weight.is_meta:
        return f"{name} is on the meta device and cannot be probed"
    return _probe_norm(module, name, weight, bias if isinstance(bias, torch.Tensor) else None, eps)


def _probe_norm(module, name, weight, bias, eps) -> Norm | str:
    hidden = weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, 3, hidden, generator=gen) + 0.5  # a mean, so LayerNorm != RMSNorm
    w = weight.detach().float().cpu()
    b = None if bias is None else bias.detach().float().cpu()
    candidates = ["layer", "rms", "rms+1"]
    for scale in (1.0, 1e-2):
        x = (base * scale).to(device=weight.device, dtype=weight.dtype)
        try:
            with torch.no_grad():
                out = module(x).detach().float().cpu()
        except Exception as exc:  # see classify_activation
            return f"{name} could not be probed ({type(exc).__name__}: {exc})"
        xf = x.float().cpu()
        e = torch.finfo(x.dtype).eps if eps is None else eps
        x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + e)
        refs = {
            "layer": F.layer_norm(xf, (hidden,), w, b, e),
            "rms": w * x_hat,
            "rms+1": (1.0 + w) * x_hat,
        }
        tol = _NORM_TOL if x.dtype in (torch.float32, torch.float64) else 1e-2
        matched = [k for k, r in refs.items() if _close(out, r, tol)]
        candidates = [k for k in candidates if k in matched]
    if not candidates:
        return (
            f"{name} computes none of LayerNorm, weight * x_hat, (1 + weight) * x_hat on a "
            f"probe with its own eps={eps!r}"
        )
    kind = candidates[0]
    if kind != "layer" and bias is not None:
        return f"{name} is an RMSNorm with a bias, which tba.layers does not handle"
    if kind == "layer":
        return Norm("layer", hidden, eps, 0.0, "layer")
    if kind == "rms+1":
        return Norm("rms", hidden, eps, 1.0, "gemma")
    return Norm("rms", hidden, eps, 0.0, "llama")


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    if out.shape != ref.shape:
        return False
    return bool(((out - ref).abs() <= tol * (1.0 + ref.abs().max())).all())


def linear_weight(module: nn.Module) -> torch.Tensor | None:
    """An (out, in) view of a Linear-like layer's weight: ``nn.Linear``, or HF's ``Conv1D``
    (``x @ W + b`` with W stored (in, out)). None for anything else."""
    if isinstance(module, nn.Linear):
        return module.weight
    weight = getattr(module, "weight", None)
    if (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None))
    ):
        return weight.t()
    return None
