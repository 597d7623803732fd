"""The stash: each layer's input per micro-batch, kept from the forward pass for the backward.

NOTE [SSD stash]
1. ``put`` copies the tensor into a page-aligned staging buffer and writes it to a fresh
   extent; the caller may drop its tensor at once. The staging buffer is released when the
   write completes (a done-callback that only drops a reference: it must not do I/O, see the
   native engine's single reaper thread in README, "Known limits").
2. Staging in flight is bounded by ``tba.Config.staging_bytes``: ``put`` waits for the oldest
   writes past it (counted in ``stash_wait_seconds``), so that a slow disk cannot make memory
   grow with depth.
3. ``prefetch(keys)`` issues the reads (a read never starts before its write completed); the
   relay asks for layer l-1's inputs when layer l's backward starts, one layer ahead. ``take``
   waits for the read, frees the extent and returns the tensor; a key not prefetched is read
   at once and counted in ``stash_sync_reads``.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future

import torch

from ..errors import CapacityError
from ..host.memory import align_up, as_memoryview
from ..storage.base import Backend, Extent
from ._layout import alloc
from ._meter import Meter

__all__ = ["DiskStash", "MemoryStash", "refusal_text"]

_CPU = torch.device("cpu")
Key = tuple[int, int]  # (layer, micro-batch)


def refusal_text(backend: Backend) -> str:
    """Where the backend refused space, and why: its reason, and the first sentence of its
    detail (the errno or the numbers; the rest is the offloader's fix, which the relay's own
    message replaces). The storage layer logs refusals at debug level only, so this message is
    where a relay user learns the cause."""
    where = getattr(backend, "spill_path", "the spill directory")
    why = getattr(backend, "refusal", "") or "disk_full"
    detail = (getattr(backend, "refusal_detail", "") or "").split(". ")[0].rstrip(".")
    return f"in {where} ({why}{': ' + detail if detail else ''})"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MemoryStash:
    """Layer inputs kept as they are, in memory."""

    def __init__(self, meter: Meter):
        self._meter = meter
        self._items: dict[Key, torch.Tensor] = {}

    def put(self, key: Key, t: torch.Tensor) -> None:
        self._items[key] = t
        self._meter.hold("stash", _nbytes(t))
        self._meter.add(stash_bytes=_nbytes(t))

    def prefetch(self, keys: list[Key]) -> None:
        pass

    def take(self, key: Key) -> torch.Tensor:
        t = self._items.pop(key)
        self._meter.drop("stash", _nbytes(t))
        return t

    def holds_inputs(self) -> bool:
        """True: a stashed tensor is the same object the next layer reads (no copy)."""
        return True

    def clear(self) -> None:
        for key in list(self._items):
            self.take(key)


class _Entry:
    __slots__ = ("extent", "shape", "dtype", "nbytes", "size", "write", "stage", "buf", "read")

    def __init__(self, extent: Extent, t: torch.Tensor, size: int):
        self.extent = extent
        self.shape, self.dtype, self.nbytes, self.size = t.shape, t.dtype, _nbytes(t), size
        self.write: Future | None = None
        self.stage: torch.Tensor | None = None  # the staging copy, until the write completes
        self.buf: torch.Tensor | None = None  # the read-back buffer
        self.read: Future | None = None


class DiskStash:
    """Layer inputs written to tba slab extents and read back ahead of the backward."""

    def __init__(self, backend: Backend, checksum: str, staging_bytes: int, device, meter: Meter):
        self._backend = backend
        self._checksum = checksum
        self._align = backend.alignment
        self._limit = staging_bytes
        self._device = device
        self._meter = meter
        self._items: dict[Key, _Entry] = {}
        self._writing: collections.deque[_Entry] = collections.deque()
        self._staged = 0  # bytes of staging buffers not yet released
        self._lock = threading.Lock()

    def holds_inputs(self) -> bool:
        return False

    # -- forward -------------------------------------------------------------------------------
    def put(self, key: Key, t: torch.Tensor) -> None:
        t = t.detach()
        size = align_up(max(_nbytes(t), 1), self._align)
        self._wait_for_room(size)
        ext = self._backend.allocate(size)
        if ext is None:
            raise CapacityError(
                f"tba.relay: the SSD stash could not reserve {size} bytes for layer {key[0]}'s "
                f"input (micro-batch {key[1]}) {refusal_text(self._backend)}. Free space on the "
                "spill filesystem, raise TBA_MAX_DISK_BYTES, or use stash='memory'."
            )
        e = _Entry(ext, t, size)
        e.stage = alloc(size, _CPU, self._align)
        e.stage[: e.nbytes].copy_(t.reshape(-1).view(torch.uint8))
        with self._lock:
            self._staged += size
        self._meter.hold("stash", size)
        self._meter.add(stash_bytes=e.nbytes, stash_bytes_written=e.nbytes)
        self._items[key] = e
        self._writing.append(e)
        e.write = self._backend.write(ext, as_memoryview(e.stage), self._checksum)
        e.write.add_done_callback(lambda f, e=e: self._written(e, f))

    def _written(self, e: _Entry, f: Future) -> None:
        # On an I/O thread: only drop the staging buffer (NOTE [SSD stash] 1).
        self._unstage(e)

    def _unstage(self, e: _Entry) -> None:
        with self._lock:
            if e.stage is None:
                return
            e.stage = None
            self._staged -= e.size
        self._meter.drop("stash", e.size)

    def _wait_for_room(self, size: int) -> None:
        while self._writing and self._staged + size > self._limit:
            oldest = self._writing.popleft()
            if not oldest.write.done():
                with self._meter.waiting("stash_wait_seconds"):
                    oldest.write.exception()  # waits; the error, if any, surfaces at its read
        while self._writing and self._writing[0].write.done():
            self._writing.popleft()

    # -- backward ------------------------------------------------------------------------------
    def prefetch(self, keys: list[Key]) -> None:
        for key in keys:
            e = self._items.get(key)
            if e is not None and e.read is None:
                self._issue_read(e)

    def _issue_read(self, e: _Entry) -> None:
        digest = e.write.result()  # raises the write's StorageError, if it failed
        e.buf = alloc(e.size, _CPU, self._align)
        self._meter.hold("stash", e.size)
        e.read = self._backend.read(e.extent, as_memoryview(e.buf), self._checksum, digest)

    def take(self, key: Key) -> torch.Tensor:
        e = self._items.pop(key)
        if e.read is None:
            self._meter.add(stash_sync_reads=1)
            self._issue_read(e)
        with self._meter.waiting("stash_wait_seconds"):
            e.read.result()
        self._backend.free(e.extent)
        self._meter.add(stash_bytes_read=e.nbytes)
        buf, e.buf = e.buf, None
        self._meter.drop("stash", e.size)
        t = buf[: e.nbytes].view(e.dtype).view(e.shape)
        return t if t.device == self._device else t.to(self._device)

    def clear(self) -> None:
        """Drop everything (after a failed step): wait for I/O in flight, free the extents."""
        for e in list(self._items.values()):
            for f in (e.write, e.read):
                if f is not None:
                    f.exception()
            self._backend.free(e.extent)
            self._unstage(e)
            if e.buf is not None:
                e.buf = None
                self._meter.drop("stash", e.size)
        self._items.clear()
        self._writing.clear()
