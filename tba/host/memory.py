"""Aligned host memory as torch tensors, so O_DIRECT can use it without a copy."""

from __future__ import annotations

import mmap
import sys
import threading

import numpy as np
import torch

from ..errors import internal_error

PAGE = 4096


def align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


MAPPED_BYTES = 1 << 20  # buffers this large get their own mapping (see aligned_empty)


def aligned_empty(
    nbytes: int, align: int = PAGE, pin: bool = False, heap: bool = False
) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose data pointer is a multiple of ``align``.

    Buffers of 1 MiB and more (unpinned) are anonymous memory mappings of their own, which are
    page-aligned and go back to the kernel the moment the tensor dies. Through malloc, glibc's
    dynamic mmap threshold soon serves 8-32 MiB blocks from the heap and keeps them after they
    are freed, so read-back buffers that tba frees during backward would stay in the process, and
    its memory would grow with the batch several times faster than with mappings (BENCHMARKS.md,
    "Batch headroom"). Smaller ones, and any size with ``heap`` (NOTE [Read buffers from the
    heap]), over-allocate by ``align`` bytes through torch's allocator and return an aligned
    slice. With ``pin`` the memory is page-locked (CUDA hosts only), allocated by torch, whose
    pinned allocator rounds every block up to a power of two and hands out whole page-aligned
    blocks: so exactly ``nbytes`` is asked for first, and only a misaligned block is traded for
    an over-allocation (asking for ``nbytes + align`` at once took twice the pinned memory for
    every power-of-two size, the staging arena's and most activations' among them).
    """
    if not pin and not heap and nbytes >= MAPPED_BYTES and PAGE % align == 0:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(m, dtype=torch.uint8)  # keeps ``m`` alive; unmapped with it
    if pin:
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % align == 0:
            return raw
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % align
    return raw[start : start + nbytes]


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to one of 8 steps per power of two (at most 12.5% more), in pages."""
    granule = max(PAGE, (1 << (max(nbytes, 1).bit_length() - 1)) >> 3)
    return align_up(nbytes, granule)


# NOTE [Read buffers from the heap]
# Under an allocator that keeps the large blocks a process frees and serves them again
# (tcmalloc, jemalloc, mimalloc),
# mappings (aligned_empty's, and the pool's below) are the worse choice. During backward the
# allocator holds, already faulted in, the memory of the activations that were freed once
# written, and a fresh mapping puts new pages beside it, which io_uring then faults in and
# zeroes while it pins them on the training thread. So there read-back buffers come from
# torch's allocator (``aligned_empty(..., heap=True)``): the pool is not used, and what
# autograd frees goes back to that allocator (the figures: BENCHMARKS.md, "Batch headroom").
# jemalloc and mimalloc are included on the same reasoning; only tcmalloc has been measured.
# glibc's malloc, which hands large blocks back to the kernel and keeps a heap that can grow,
# keeps the pool. Which allocator serves ``malloc`` is tba/host/malloc.py's question.
# NOTE [Read buffer reuse]
# A read-back buffer is handed to autograd as (views of) a tensor, and autograd frees it when
# the node that used it is done, a moment tba cannot observe through a hook. Fresh anonymous
# mappings are returned to the kernel at once (good for peak memory, see aligned_empty) but
# every page of every read is faulted in and zeroed again, kernel work for every byte read back
# in every step, on the cores that run compute. The pool keeps mappings and hands them out again
# once their last tensor is gone. It knows that without any hook: ``torch.frombuffer`` holds
# the exporting object (the mmap) through the tensor storage's Py_buffer, so while any view of
# the buffer lives, the mmap's reference count is one higher (tests/host/test_memory.py pins this).
# The pool holds at most ``limit`` bytes of mappings (busy or free); past that, buffers are
# plain one-off mappings. ``trim()`` (at each step's start) unmaps the free ones, so forward
# runs without them. The count a free mapping has is measured at every look, on a mapping that
# is never exported, not once at import: after torch.compile has run in the process every
# count reads one higher (measured with torch 2.13, Python 3.11), and a count taken at import
# inside a compiled region would read one lower later, calling a buffer in use free.
class MappedPool:
    """Recycled page-aligned anonymous mappings for read-back buffers (NOTE [Read buffer reuse])."""

    def __init__(self, limit: int):
        self.limit = limit
        self.pooled_bytes = 0  # mappings the pool owns, free or in use
        self.reused = 0  # buffers served from a recycled mapping
        self._maps: dict[int, list[mmap.mmap]] = {}  # size class -> mappings
        self._lock = threading.Lock()
        # Never exported: the count a free mapping has, measured at each look (NOTE [Read
        # buffer reuse]).
        self._idle = [mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)]

    def _free_refs(self) -> int:
        """References a free mapping has in the loops below, counted now, through the same
        shape of code (a list, its loop variable, ``_refs``): the interpreter's own count can
        change while the process runs (torch.compile's frame evaluation adds one), and a count
        taken at import could then call a buffer in use free."""
        for m in self._idle:
            return _refs(m)
        raise internal_error("memory", "the read-buffer pool lost its idle mapping")

    def get(self, nbytes: int) -> torch.Tensor:
        size = size_class(nbytes)
        with self._lock:
            maps = self._maps.setdefault(size, [])
            free = self._free_refs()
            for m in maps:
                if _refs(m) <= free:
                    self.reused += 1
                    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes)
            m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if self.pooled_bytes + size <= self.limit:
                maps.append(m)
                self.pooled_bytes += size
            return torch.frombuffer(m, dtype=torch.uint8, count=nbytes)

    def trim(self) -> int:
        """Unmap every free pooled mapping; returns the bytes released."""
        released = 0
        with self._lock:
            free = self._free_refs()
            for size, maps in self._maps.items():
                keep = []
                for m in maps:
                    if _refs(m) <= free:
                        m.close()
                        released += size
                    else:
                        keep.append(m)
                maps[:] = keep
            self.pooled_bytes -= released
        return released


def _refs(m: mmap.mmap) -> int:
    return sys.getrefcount(m)


def _measure_free_refs() -> int:
    """References a free pooled mapping has when MappedPool's loops look at it: its list, the
    loop variable, ``_refs``'s parameter and getrefcount's argument. Measured through the same
    calls, so that no interpreter detail is assumed; then checked that a live tensor made by
    ``torch.frombuffer`` adds exactly one."""
    maps = [mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)]
    for m in maps:
        free = _refs(m)
        busy = torch.frombuffer(m, dtype=torch.uint8)
        held = _refs(m)
        del busy
        if held != free + 1 or _refs(m) != free:  # pragma: no cover - a torch change
            raise internal_error(
                "memory",
                f"torch {torch.__version__}'s frombuffer no longer holds its buffer's exporter, "
                "which tba's read-buffer pool relies on",
            )
        m.close()
    return free


_measure_free_refs()  # at import: fails loudly if frombuffer stops holding its exporter


def as_memoryview(t: torch.Tensor) -> memoryview:
    """A writable, zero-copy byte view of a contiguous uint8 CPU tensor."""
    return memoryview(t.numpy()).cast("B")


def address_of(buf: memoryview) -> int:
    """The address of a buffer's first byte."""
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]


def io_buffer(t: torch.Tensor):
    """What a backend's ``write``/``read`` takes for ``t``: a memoryview of host memory, or the
    device tensor itself (device-direct I/O, kvikio with GDS)."""
    return as_memoryview(t) if t.device.type == "cpu" else t


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes the kernel says can be allocated without swapping (``MemAvailable``), or None
    where that is not known (no /proc, an old kernel)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
