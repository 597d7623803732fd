"""The ``buffered`` backend, for filesystems that refuse O_DIRECT (tmpfs, some network ones).

NOTE [Bounded page cache]
Buffered writes land in the page cache. Left alone, the cache fills RAM with dirty spill pages
and the kernel flushes them in large stalls. So every ``sync_bytes`` (128 MiB) written to a slab,
we ``fdatasync`` it and drop the written range with ``posix_fadvise(POSIX_FADV_DONTNEED)``; reads
drop their range once copied out. ``fdatasync`` is also where a deferred write error surfaces,
so it raises :class:`StorageError` like a failed write.
"""

from __future__ import annotations

import errno
import os

from ..config import Config
from ..errors import StorageError, hint_for
from .filebackend import SlabBackend
from .slab import Slab

__all__ = ["BufferedBackend"]


class BufferedBackend(SlabBackend):
    """Buffered I/O on nameless slab files, with the page cache kept flat. See the NOTE."""

    name = "buffered"
    direct = False
    mode = "buffered"
    sync_bytes = 128 << 20

    def __init__(self, cfg: Config):
        self._fdatasync = os.fdatasync
        self._fadvise = os.posix_fadvise
        super().__init__(cfg)

    def _describe(self) -> str:
        return (
            super()._describe()
            + f"; page cache bounded by fdatasync+DONTNEED every {self.sync_bytes >> 20} MiB"
        )

    def _after_write(self, slab: Slab, off: int, n: int) -> None:
        with slab.lock:
            if slab.dirty == 0:
                slab.dirty_lo, slab.dirty_hi = off, off + n
            else:
                slab.dirty_lo = min(slab.dirty_lo, off)
                slab.dirty_hi = max(slab.dirty_hi, off + n)
            slab.dirty += n
            if slab.dirty < self.sync_bytes:
                return
            lo, hi = slab.dirty_lo, slab.dirty_hi
            slab.dirty = 0
        # Every write counted above has returned from pwrite, so fdatasync covers it.
        try:
            self._fdatasync(slab.fd)
        except OSError as e:
            code = e.errno or errno.EIO
            raise StorageError(
                "fdatasync", slab.display, lo, hi - lo, code, hint_for(code)
            ) from None
        self._drop(slab, lo, hi - lo)

    def _after_read(self, slab: Slab, off: int, n: int) -> None:
        self._drop(slab, off, n)

    def _drop(self, slab: Slab, off: int, n: int) -> None:
        try:
            self._fadvise(slab.fd, off, n, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # advice only: a filesystem without it just keeps its cache
