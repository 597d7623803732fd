"""The ``posix`` backend: O_DIRECT slab files, ``os.pwrite``/``os.preadv`` on a thread pool.

The GIL is released during each syscall, so ``io_threads`` threads keep that many requests in
flight on the drive. Pages never enter the page cache, so spilling does not compete with the
training process for RAM.
"""

from __future__ import annotations

from .filebackend import SlabBackend

__all__ = ["PosixBackend"]


class PosixBackend(SlabBackend):
    """O_DIRECT I/O on nameless preallocated slab files. See :class:`SlabBackend`."""

    name = "posix"
    direct = True
    mode = "O_DIRECT"
