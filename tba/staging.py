"""A bounded arena of page-aligned (pinned on CUDA) staging memory.

Offloaded tensors are copied here before their write, so a write never races with later
in-place updates of the source. The arena is one allocation carved by an
:class:`~tba.storage.alloc.ExtentAllocator`; when it is full, :meth:`StagingPool.alloc`
returns None and the caller keeps the tensor resident instead of blocking the forward.
"""

from __future__ import annotations

import threading

import torch

from ._memory import io_buffer
from .storage.alloc import ExtentAllocator


class StagingBlock:
    """One carved piece of the arena: ``tensor`` (uint8 view) and ``view`` (memoryview)."""

    __slots__ = ("offset", "length", "tensor", "_view")

    def __init__(self, offset: int, length: int, tensor: torch.Tensor):
        self.offset = offset
        self.length = length
        self.tensor = tensor
        self._view: memoryview | None = None

    @property
    def view(self) -> memoryview:
        """The block as a backend I/O buffer (a memoryview; the tensor itself on a device)."""
        if self._view is None:
            self._view = io_buffer(self.tensor)
        return self._view


class StagingPool:
    """``capacity`` bytes of aligned host memory, handed out in ``align`` multiples."""

    def __init__(self, arena: torch.Tensor, align: int):
        self.arena = arena
        self.align = align
        self._alloc = ExtentAllocator(arena.numel(), align)
        self._lock = threading.Lock()
        self.peak = 0
        self.refusals = 0

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def in_use(self) -> int:
        return self._alloc.used

    def alloc(self, nbytes: int) -> StagingBlock | None:
        with self._lock:
            off = self._alloc.alloc(nbytes)
            if off is None:
                self.refusals += 1
                return None
            length = self._alloc.size_of(off)
            self.peak = max(self.peak, self._alloc.used)
        return StagingBlock(off, length, self.arena[off : off + length])

    def free(self, block: StagingBlock) -> None:
        with self._lock:
            self._alloc.free(block.offset)
        block.tensor = None  # type: ignore[assignment]
        block._view = None
