"""Flat layouts: a list of tensors at aligned offsets inside one byte buffer.

A layer's weights (and, on the SSD tier, its optimizer state) travel as one buffer: one read or
one write per layer, and the parameters the layer computes with are views into it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .._memory import PAGE, align_up, aligned_empty

__all__ = ["FlatLayout", "TENSOR_ALIGN", "alloc"]

# Offset of each tensor inside a buffer: a cache line, and a multiple of every dtype's size.
TENSOR_ALIGN = 64


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
    def of(cls, tensors: Sequence[torch.Tensor], io_align: int = PAGE) -> FlatLayout:
        offsets, sizes, end = [], [], 0
        for t in tensors:
            end = align_up(end, TENSOR_ALIGN)
            offsets.append(end)
            sizes.append(t.numel() * t.element_size())
            end += sizes[-1]
        return cls(
            shapes=tuple(t.shape for t in tensors),
            dtypes=tuple(t.dtype for t in tensors),
            offsets=tuple(offsets),
            sizes=tuple(sizes),
            nbytes=align_up(max(end, 1), max(io_align, TENSOR_ALIGN)),
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


def alloc(nbytes: int, device: torch.device, align: int = PAGE) -> torch.Tensor:
    """A flat uint8 buffer: page-aligned host memory (its own mapping from 1 MiB, returned to
    the kernel when it dies; see tba._memory.aligned_empty) or device memory."""
    if device.type == "cpu":
        return aligned_empty(nbytes, align)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)
