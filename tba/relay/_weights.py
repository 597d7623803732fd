"""Binding fetched weights to a layer's modules, and keeping them out of kept autograd graphs.

NOTE [Weights out of the graph]
With ``recompute=False`` the relay keeps each layer's autograd graph from the forward pass
until the layer's backward, but not the layer's weights: they are fetched again for the
backward, like the recompute path does. Two things would otherwise pin them:
1. Saved tensors. Ops save their weight operands (``linear`` saves ``weight.t()``). While a
   layer's forward runs with the pack hook below, a saved tensor whose storage is the layer's
   weight buffer is packed as a token (offset, size, stride, dtype) instead of the tensor. In
   the backward, unpack rebuilds the same view on the buffer fetched for the backward, which
   holds the same values: the update of a layer runs after its backward (NOTE [EPS contract] 2-3).
2. The parameters themselves. Autograd's AccumulateGrad nodes hold the parameter objects, not
   their data: ``Slots.unbind`` swaps every parameter's data for an empty placeholder, and
   ``bind`` swaps the fetched views back in before the backward, so the graph holds no bytes.
Everything else a layer saves (activations, its input) stays in the graph, in memory.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from ..errors import UsageError
from ._eps import empty_like_param
from ._layout import FlatLayout
from ._meter import Meter

__all__ = ["Slots", "WeightTokens"]


class Slots:
    """One layer module's parameters, bound to a fetched buffer or to empty placeholders."""

    def __init__(self, module: nn.Module, layout: FlatLayout):
        self.params = list(module.parameters())
        self.layout = layout
        self.trainable = [p for p in self.params if p.requires_grad]

    def bind(self, buf: torch.Tensor) -> None:
        for p, view in zip(self.params, self.layout.views(buf)):
            p.data = view

    def unbind(self) -> None:
        for p in self.params:
            p.data = empty_like_param(p)

    def take_grads(self) -> list[torch.Tensor | None]:
        """The trainable parameters' gradients (summed over the micro-batches), cleared."""
        grads = []
        for p in self.trainable:
            grads.append(p.grad)
            p.grad = None
        return grads


@dataclasses.dataclass(frozen=True)
class _Token:
    layer: int
    offset: int  # bytes from the start of the layer's buffer (not of its storage)
    size: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


class WeightTokens:
    """saved_tensors_hooks that pack weight views as tokens (NOTE [Weights out of the graph])."""

    def __init__(self, meter: Meter):
        self._ptr_layer: dict[int, int] = {}  # storage address of a bound buffer -> layer
        self._bufs: dict[int, torch.Tensor] = {}  # layer -> its bound buffer (flat uint8)
        self._meter = meter
        self._packing = -1  # the layer whose forward is running
        self._kept: dict[int, int] = {}  # storage address -> bytes, of activations kept
        self._kept_by_layer: dict[int, int] = {}

    def attach(self, layer: int, buf: torch.Tensor) -> None:
        self._bufs[layer] = buf
        self._ptr_layer[buf.untyped_storage().data_ptr()] = layer
        self._packing = layer

    def detach(self, layer: int) -> None:
        buf = self._bufs.pop(layer, None)
        if buf is not None:
            self._ptr_layer.pop(buf.untyped_storage().data_ptr(), None)

    def pack(self, t: torch.Tensor):
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return t
        layer = self._ptr_layer.get(ptr) if ptr else None
        if layer is None:
            self._count(ptr, t)
            return t
        # A buffer may start inside its storage (aligned_empty slices small ones), and the
        # backward's buffer at another place than the forward's: keep the offset relative.
        offset = t.storage_offset() * t.element_size() - self._bufs[layer].storage_offset()
        return _Token(layer, offset, t.size(), t.stride(), t.dtype)

    def unpack(self, packed):
        if not isinstance(packed, _Token):
            return packed
        buf = self._bufs.get(packed.layer)
        if buf is None:
            raise UsageError(
                f"tba.relay: layer {packed.layer}'s graph was used while its weights were not "
                "fetched; a kept graph can only run backward inside Relay.step()."
            )
        t = torch.empty(0, dtype=packed.dtype, device=buf.device)
        start = (buf.storage_offset() + packed.offset) // t.element_size()
        return t.set_(buf.untyped_storage(), start, packed.size, packed.stride)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    # -- the stash counters: activations the kept graphs hold ---------------------------------
    def _count(self, ptr: int, t: torch.Tensor) -> None:
        # All kept graphs live until their layer's backward, so within a step's forward a
        # storage address seen before is the same storage (saved again, or a view of it).
        if ptr in self._kept:
            return
        n = self._kept[ptr] = t.untyped_storage().nbytes()
        layer = self._packing
        self._kept_by_layer[layer] = self._kept_by_layer.get(layer, 0) + n
        self._meter.hold("stash", n)
        self._meter.add(stash_bytes=n)

    def release(self, layer: int) -> None:
        """Layer ``layer``'s graphs are gone: its kept activations no longer count."""
        self._meter.drop("stash", self._kept_by_layer.pop(layer, 0))

    def reset(self) -> None:
        """A new step (or a failed one): forget every graph's activations."""
        for layer in list(self._kept_by_layer):
            self.release(layer)
        self._kept.clear()
