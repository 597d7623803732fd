"""The ``memory`` backend: the ``save_on_cpu``-style baseline. Nothing touches the disk.

Each extent is an aligned host buffer; ``write`` and ``read`` are synchronous copies whose
futures are already resolved. It measures what offloading costs over keeping tensors in RAM.

Bandwidth caps (TBA_MAX_WRITE_BPS / TBA_MAX_READ_BPS, ``set_rate``) are accepted, shown in
``reason`` and ignored: nothing goes to a disk, and throttling the baseline's memory copies would
only blur what it measures. ``throttle_seconds_*`` stay 0.
"""

from __future__ import annotations

import errno
import itertools
import threading
from concurrent.futures import Future
from typing import Any

import torch

from ..config import Config
from ..errors import StorageError, internal_error
from ..host.memory import PAGE, aligned_empty, as_memoryview
from .base import Extent, Span
from .checksum import checksum_fn, digest_for, mismatch_hint
from .ratelimit import DIRECTIONS, check_rate, format_rate

__all__ = ["MemoryBackend"]


def _done(value: Any = None, exc: BaseException | None = None) -> Future:
    f: Future = Future()
    if exc is not None:
        f.set_exception(exc)
    else:
        f.set_result(value)
    return f


class MemoryBackend:
    """Extents in host memory. ``allocate`` always succeeds (no quota: it is the baseline)."""

    name = "memory"
    alignment = PAGE
    device_direct = False
    refusal = "disk_full"  # never refuses: ``allocate`` always succeeds
    refusal_detail = ""
    spill_path = None  # nothing goes to a disk

    def register(self, buf: Any) -> bool:
        """Nothing to pin: copies are plain memcpy."""
        return False

    def __init__(self, cfg: Config):
        checksum_fn(cfg.checksum)
        self._caps: dict[str, int | None] = {"write": cfg.max_write_bps, "read": cfg.max_read_bps}
        self.reason = f"memory: {self._summary()}"
        self._bufs: dict[int, torch.Tensor] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._used = 0
        self._stats = dict.fromkeys(
            ("bytes_written", "bytes_read", "writes", "reads", "io_errors", "checksum_errors"), 0
        )
        self._closed = False

    def _summary(self) -> str:
        text = "saved tensors stay in host memory; nothing is written to disk"
        ignored = [f"{op} cap of {format_rate(bps)}" for op, bps in self._caps.items() if bps]
        if ignored:
            text += f"; {' and '.join(ignored)} ignored (no disk I/O)"
        return text

    @property
    def caps(self) -> dict[str, int | None]:
        """The caps set, in bytes per second; recorded, never applied."""
        return dict(self._caps)

    def set_rate(self, op: str, bps: int | None, *, burst: int | None = None) -> None:
        """Record a cap, as the disk backends take it; the memory backend does not apply it."""
        if op not in DIRECTIONS:
            raise ValueError(f"tba.storage: set_rate({op!r}): the op is 'write' or 'read'")
        bps = check_rate(bps)
        before = self._summary()
        self._caps[op] = bps
        self.reason = self.reason.replace(before, self._summary())

    def allocate(self, nbytes: int) -> Extent | None:
        if nbytes < 0:
            raise ValueError(f"tba.storage: cannot allocate {nbytes} bytes")
        n = max(PAGE, (nbytes + PAGE - 1) // PAGE * PAGE)
        buf = aligned_empty(n, PAGE)
        with self._lock:
            if self._closed:
                raise ValueError("tba.storage: allocate() on a closed memory backend")
            key = next(self._ids)
            self._bufs[key] = buf
            self._used += n
        return Extent(key, 0, n)

    def free(self, extent: Extent) -> None:
        with self._lock:
            if self._closed:
                return  # teardown order: handles may be released after the backend closed
            buf = self._bufs.pop(extent.slab, None)
            if buf is None:
                raise internal_error(
                    "storage",
                    f"free of an unknown extent (slab {extent.slab}, offset {extent.offset}): "
                    "double free, or an extent of another backend",
                )
            self._used -= buf.numel()

    def _view(self, extent: Extent, buf: memoryview) -> memoryview:
        if self._closed:
            raise ValueError("tba.storage: I/O on a closed memory backend")
        t = self._bufs.get(extent.slab)
        if t is None:
            raise ValueError(
                f"tba.storage: I/O on an extent that is not allocated (slab {extent.slab}, "
                f"offset {extent.offset}); it was freed or belongs to another backend"
            )
        if len(buf) != extent.length or extent.length != t.numel():
            raise ValueError(
                f"tba.storage: buffer of {len(buf)} bytes for an extent of {extent.length} "
                "bytes; the buffer must be exactly extent.length bytes"
            )
        return as_memoryview(t)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._stats[k] += v

    def write(
        self, extent: Extent, buf: memoryview, checksum: str = "off", span: Span = None
    ) -> Future:
        digest = digest_for(checksum, span)
        dst = self._view(extent, buf)
        value = digest(buf) if digest is not None else None
        dst[:] = buf
        self._count(writes=1, bytes_written=len(buf))
        return _done(value)

    def read(
        self,
        extent: Extent,
        buf: memoryview,
        checksum: str = "off",
        expect: int | None = None,
        span: Span = None,
    ) -> Future:
        digest = digest_for(checksum, span)
        src = self._view(extent, buf)
        buf[:] = src
        if digest is not None and expect is not None:
            got = digest(buf)
            if got != expect:
                self._count(io_errors=1, checksum_errors=1)
                return _done(
                    exc=StorageError(
                        "read",
                        f"memory extent {extent.slab}",
                        0,
                        len(buf),
                        errno.EBADMSG,
                        mismatch_hint(
                            checksum, expect, got, "Host memory was overwritten while it was held."
                        ),
                    )
                )
        self._count(reads=1, bytes_read=len(buf))
        return _done()

    def usage(self) -> dict[str, int | float]:
        with self._lock:
            return {
                "disk_bytes_in_use": self._used,
                "slab_bytes": 0,
                "slabs": 0,
                "refused_quota": 0,
                "refused_space": 0,
                "refused_error": 0,
                **self._stats,
                "throttle_seconds_write": 0.0,
                "throttle_seconds_read": 0.0,
                "alignment": self.alignment,
            }

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._bufs.clear()
            self._used = 0

    def __enter__(self) -> MemoryBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
