"""`Layers`: a model as the relay runs it, embed → blocks → head, and the checks on it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from ._errors import RelayConfigError

__all__ = ["Layers", "as_layers", "default_call"]

SHAPE = (
    "the relay needs the model as a list of layers, embed → blocks → head, each an nn.Module "
    "(or a function that builds one) whose parameters no other layer shares: "
    "tba.relay.Layers([embed, *blocks, head], loss=...), or an adapter "
    "(tba.relay.layers_of(model) for LlamaForCausalLM, GPT2LMHeadModel and tba.testing.GPT)"
)


def default_call(index: int, layer: nn.Module, x: Any, extras: Any) -> Any:
    """``layer(x)``: the call for layers that need nothing but the previous layer's output."""
    return layer(x)


@dataclasses.dataclass
class Layers:
    """A model split for the relay.

    ``modules``: embed, blocks, head, in forward order. Each is an ``nn.Module``, or a function
    of no arguments that builds one: the relay builds them one at a time, so a model larger than
    host memory need never exist whole (with ``eps="ssd"``). No parameter may belong to two
    layers (untie tied embeddings).

    ``loss(output, target)``: the scalar loss of one micro-batch from the last layer's output and
    that micro-batch's target, as the model computes it for a whole batch (a mean). The relay
    divides it by the number of micro-batches, as gradient accumulation does.

    ``call(index, module, x, extras)``: runs layer ``index`` on ``x`` (the batch input for layer
    0, else the previous layer's output, a tensor) and returns its output. Default:
    ``module(x)``. Blocks that need masks or rotary embeddings take them from ``extras``.

    ``prepare(inputs, hidden)``: ``extras`` for one micro-batch, from its input and layer 0's
    output; called once per micro-batch and step, without grad (attention masks, position
    embeddings). Default: no extras.
    """

    modules: Sequence[nn.Module | Callable[[], nn.Module]]
    loss: Callable[[Any, Any], torch.Tensor]
    call: Callable[[int, nn.Module, Any, Any], Any] = default_call
    prepare: Callable[[Any, Any], Any] | None = None

    def __post_init__(self) -> None:
        self.modules = _as_module_list(self.modules)
        problems = []
        if not callable(self.loss):
            problems.append(f"loss={self.loss!r} is not callable; pass loss(output, target).")
        if not callable(self.call):
            problems.append(f"call={self.call!r} is not callable; pass call(i, layer, x, extras).")
        if self.prepare is not None and not callable(self.prepare):
            problems.append(
                f"prepare={self.prepare!r} is not callable; pass prepare(inputs, hidden) or None."
            )
        if problems:
            raise RelayConfigError(problems)

    def __len__(self) -> int:
        return len(self.modules)


def as_layers(
    layers: Any,
    loss: Callable | None,
    call: Callable | None,
    prepare: Callable | None,
) -> Layers:
    """``layers`` as a :class:`Layers`: one already, or a list of modules plus ``loss``."""
    if isinstance(layers, Layers):
        extra = [n for n, v in (("loss", loss), ("call", call), ("prepare", prepare)) if v]
        if extra:
            raise RelayConfigError(
                f"{', '.join(extra)} given both to Relay and inside its Layers; pass them once, "
                "in the Layers."
            )
        return layers
    modules = _as_module_list(layers)
    if loss is None:
        raise RelayConfigError(
            "Relay(layers, ...) with a list of modules needs loss=loss(output, target), the "
            "loss of one micro-batch from the last layer's output."
        )
    return Layers(modules, loss, call or default_call, prepare)


def _as_module_list(layers: Any) -> list:
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise RelayConfigError(
            f"a {type(layers).__name__} module cannot be split as it stands: {SHAPE}."
        )
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (Sequence, nn.Module)):
        raise RelayConfigError(f"got {type(layers).__name__}: {SHAPE}.")
    modules = list(layers)
    if not modules:
        raise RelayConfigError(f"the layer list is empty: {SHAPE}.")
    bad = [i for i, m in enumerate(modules) if not (isinstance(m, nn.Module) or callable(m))]
    if bad:
        i = bad[0]
        raise RelayConfigError(
            f"layer {i} is a {type(modules[i]).__name__}, not an nn.Module or a function that "
            f"builds one: {SHAPE}."
        )
    return modules


def build(index: int, item: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    """The module at ``index``, built now if it is a function."""
    if isinstance(item, nn.Module):
        return item
    module = item()
    if not isinstance(module, nn.Module):
        raise RelayConfigError(
            f"the function given for layer {index} returned a {type(module).__name__}, not an "
            "nn.Module."
        )
    return module


class ParamCheck:
    """Checks each layer's parameters as layers are built: on the CPU, owned by one layer."""

    def __init__(self) -> None:
        self._owner: dict[int, tuple[int, str]] = {}  # id(param) -> (layer, name)

    def params(self, index: int, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        named = list(module.named_parameters())
        for name, p in named:
            seen = self._owner.get(id(p))
            if seen is not None:
                raise RelayConfigError(
                    f"parameter {name!r} of layer {index} is also {seen[1]!r} of layer "
                    f"{seen[0]} (tied weights): each layer's weights travel alone. Untie them "
                    "(e.g. GPT2Config(tie_word_embeddings=False), or give the head its own copy: "
                    "head.weight = nn.Parameter(head.weight.detach().clone()))."
                )
            if p.device.type != "cpu":
                raise RelayConfigError(
                    f"parameter {name!r} of layer {index} is on {p.device}; build the model on "
                    "the CPU: the relay keeps weights in host memory or on the SSD and moves "
                    "each layer to RelayConfig.device itself."
                )
            self._owner[id(p)] = (index, name)
        return named
