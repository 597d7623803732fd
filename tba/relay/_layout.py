"""Flat layouts: a list of tensors at aligned offsets inside one byte buffer.

A layer's weights (and, on the SSD tier, its optimizer state) travel as one buffer: one read or
one write per layer, and the parameters the layer computes with are views into it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..host.memory import PAGE, align_up, aligned_empty

__all__ = ["DEVICE_TENSOR_ALIGN", "FlatLayout", "TENSOR_ALIGN", "alloc", "tensor_align"]

# Offset of each tensor inside a buffer: a cache line, and a multiple of every dtype's size.
TENSOR_ALIGN = 64
# On a CUDA device: the caching allocator's own granule, so that a weight bound as a view of a
# fetched buffer starts as aligned as the same weight allocated on its own. cuBLASLt picks its
# kernel by the operands' alignment (up to 256 bytes): at 64 a layer could run other kernels,
# with another summation order, than the same layer in plain training.
DEVICE_TENSOR_ALIGN = 512


def tensor_align(device: torch.device) -> int:
    """The alignment of each tensor inside the buffers that layers on ``device`` compute with."""
    return TENSOR_ALIGN if device.type == "cpu" else DEVICE_TENSOR_ALIGN


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a list sits in one buffer of ``nbytes`` (a multiple of the I/O
    alignment, so that the whole buffer is one O_DIRECT transfer)."""

    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]  # bytes of each tensor
    nbytes: int

    @classmethod
    def of(
        cls, tensors: Sequence[torch.Tensor], io_align: int = PAGE, align: int = TENSOR_ALIGN
    ) -> FlatLayout:
        offsets, sizes, end = [], [], 0
        for t in tensors:
            end = align_up(end, align)
            offsets.append(end)
            sizes.append(t.numel() * t.element_size())
            end += sizes[-1]
        return cls(
            shapes=tuple(t.shape for t in tensors),
            dtypes=tuple(t.dtype for t in tensors),
            offsets=tuple(offsets),
            sizes=tuple(sizes),
            nbytes=align_up(max(end, 1), max(io_align, align)),
        )

    @property
    def data_bytes(self) -> int:
        """The tensors' own bytes, without padding."""
        return sum(self.sizes)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """The tensors as views of ``buf`` (a flat uint8 tensor of at least ``nbytes``)."""
        return [
            buf[o : o + n].view(dt).view(shape)
            for o, n, dt, shape in zip(self.offsets, self.sizes, self.dtypes, self.shapes)
        ]

    def fill(self, buf: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` into their places in ``buf``."""
        for view, t in zip(self.views(buf), tensors):
            view.copy_(t.detach())

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        return len(tensors) == len(self.shapes) and all(
            t.shape == s and t.dtype == d for t, s, d in zip(tensors, self.shapes, self.dtypes)
        )


def alloc(nbytes: int, device: torch.device, align: int = PAGE, pin: bool = False) -> torch.Tensor:
    """A flat uint8 buffer: page-aligned host memory (its own mapping from 1 MiB, returned to
    the kernel when it dies; see tba.host.memory.aligned_empty; page-locked with ``pin``) or device
    memory."""
    if device.type == "cpu":
        return aligned_empty(nbytes, align, pin=pin)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)
