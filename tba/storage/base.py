"""The `Backend` protocol every storage engine implements, and the `Extent` it hands out.

Contract (the cache relies on each line):
- ``allocate(n)`` reserves an extent of at least ``n`` bytes, rounded up to ``alignment``. It
  returns ``None`` (never raises) when the quota, the free-space check or the filesystem refuses;
  the caller then keeps the tensor in memory and counts it. It may grow a slab (fallocate) but
  does no data I/O.
- ``write(extent, buf)`` and ``read(extent, buf)`` are asynchronous. ``buf`` is a writable
  memoryview whose address and length are multiples of ``alignment`` and ``len(buf) ==
  extent.length``. The returned future resolves to ``None`` or raises :class:`tba.StorageError`
  naming the file, offset, byte count and errno. A short transfer is retried to completion; an
  error is never turned into zeros.
- ``checksum`` (optional, "auto", "xxh3", "crc32" etc.): ``write`` computes it over ``buf`` (or
  over ``buf[start:stop]`` for a ``span``) on the I/O thread and its future resolves to the
  digest; ``read`` with ``expect`` verifies it over the same span and raises
  StorageError(EBADMSG) on mismatch, naming the file, offset, expected and actual digests.
- ``free(extent)`` returns the space at once; it is only called once no I/O on it is in flight.
- ``close()`` waits for in-flight I/O, closes every file and removes the process directory.
- ``refusal`` names why the last ``allocate`` returned None, as the kept reason the offloader
  counts ("quota", "disk_full", "node_quota", "spill_dir_gone", "permission", "read_only",
  "io_error"); ``refusal_detail`` says what refused, with the numbers or errno, and the fix.
- ``register(buf)`` offers a long-lived buffer (a staging arena) for the engine to pin or map
  once; False when it cannot (every transfer still works without it).
- ``device_direct`` is True when ``write``/``read`` take device tensors themselves (GPUDirect
  Storage); then the offloader keeps staging on the device.
- ``spill_path`` is the per-process directory of the slab files, or None when nothing goes to
  a disk (the memory backend).
- ``set_rate(op, bps)`` caps "write" or "read" at ``bps`` bytes per second (None: no cap) from
  now on, as ``TBA_MAX_WRITE_BPS`` / ``TBA_MAX_READ_BPS`` do at construction. Capped ops wait for
  tokens on the I/O side; ``write``/``read`` still return at once. ``usage()`` has
  ``throttle_seconds_write`` / ``_read`` (floats), and ``reason`` names the caps in force. See
  NOTE [Rate caps] in ratelimit.py.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

Span = tuple[int, int] | None  # the [start, stop) of a buffer a checksum covers (None: all)


@dataclass(frozen=True, slots=True)
class Extent:
    slab: int
    offset: int
    length: int


@runtime_checkable
class Backend(Protocol):
    name: str
    reason: str
    alignment: int
    device_direct: bool

    @property
    def refusal(self) -> str: ...

    @property
    def refusal_detail(self) -> str: ...

    @property
    def spill_path(self) -> str | None: ...

    def register(self, buf: Any) -> bool: ...

    def allocate(self, nbytes: int) -> Extent | None: ...

    def free(self, extent: Extent) -> None: ...

    def write(
        self, extent: Extent, buf: memoryview, checksum: str = "off", span: Span = None
    ) -> Future: ...

    def read(
        self,
        extent: Extent,
        buf: memoryview,
        checksum: str = "off",
        expect: int | None = None,
        span: Span = None,
    ) -> Future: ...

    def set_rate(self, op: str, bps: int | None, *, burst: int | None = None) -> None: ...

    def usage(self) -> dict[str, int | float]: ...

    def close(self) -> None: ...
