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
    """One carved piece of an arena: bytes ``[offset, offset + length)`` of ``base``.

    ``tensor`` (a uint8 view) and ``view`` (a memoryview) are made when asked for, not kept:
    the hot path slices ``base`` once itself (:meth:`part`), and an entry that lives until its
    write completes then holds no tensor object of its own for the cyclic GC to walk.
    """

    __slots__ = ("offset", "length", "base")

    def __init__(self, offset: int, length: int, base: torch.Tensor):
        self.offset = offset
        self.length = length
        self.base = base

    def part(self, start: int, stop: int) -> torch.Tensor:
        """Bytes ``[start, stop)`` of the block as a uint8 view."""
        return self.base[self.offset + start : self.offset + stop]

    @property
    def tensor(self) -> torch.Tensor:
        return self.part(0, self.length)

    @property
    def view(self) -> memoryview:
        """The block as a backend I/O buffer (a memoryview; the tensor itself on a device)."""
        return io_buffer(self.tensor)


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
        return StagingBlock(off, length, self.arena)

    def free(self, block: StagingBlock) -> None:
        with self._lock:
            self._alloc.free(block.offset)
        block.base = None  # type: ignore[assignment]
