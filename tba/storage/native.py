"""The ``native`` backend: tba's C I/O engine (io_uring, or a pthread pool) under SlabBackend.

NOTE [Native engine]
1. The engine is native/tba_engine.c, built by setup.py as the optional extension ``tba._engine``
   (a plain shared library without Python headers) and loaded with ctypes (_native_lib.py), which
   releases the GIL during every foreign call. When the library is missing this module still
   imports: :func:`engine_status` says why, and :class:`NativeBackend` raises
   :class:`NativeUnavailable`.
2. The engine uses io_uring when the kernel allows it, else ``io_depth`` threads doing
   pread/pwrite; the Python side is the same for both. ``engine_status()`` and a backend's
   ``reason`` say which runs and why.
3. ``write``/``read`` submit from the caller's thread (one io_uring_enter, no hand-off). One reaper
   thread per backend blocks in the engine's reap call and resolves futures in batches;
   checksums are computed there, and done-callbacks run there, so they must not block on I/O.
4. The engine applies NOTE [Transfers] itself (short transfers resume from the last multiple of
   the DIO unit, EAGAIN is retried, a 0-byte read is an error) and reports where an op failed,
   so a StorageError names the same offset and byte count as the posix backend's would.
5. Slab fds join the engine (its registered file table) at a slab's first I/O and leave it when
   the slab set closes the slab, which only ``allocate`` does.
6. Bandwidth caps live in the engine (``tba_engine_set_rate``): an op leaves the engine's
   per-direction queue for the kernel or a worker only once its tokens have accrued, and the
   reaper's reap call sleeps no longer than until the next one may go. Same rules as NOTE
   [Rate caps] in ratelimit.py; the Python token buckets of SlabBackend are not used here.

The library, its ABI and :func:`engine_status` live in tba/storage/_native_lib.py; one running
engine and its reaper in tba/storage/_native_engine.py. This module is the Backend: slab files
in the engine, registered buffers, bandwidth caps and fault injection.
"""

from __future__ import annotations

import errno as _errno
import logging
import threading
import weakref
from concurrent.futures import Future
from typing import Any

from ..config import Config, format_size
from ..errors import StorageError, hint_for
from ..host.memory import address_of
from ._native_engine import _Engine, _release_native, _Request
from ._native_lib import (
    _IO_URING,
    _KINDS,
    _OPS,
    _READ,
    _WRITE,
    NativeUnavailable,
    _buffer_refusal,
    _Info,
    _load,
    _name,
    _ring_reason,
    engine_status,
)
from .base import Extent, Span
from .checksum import Digest, digest_for
from .filebackend import SlabBackend
from .slab import Slab

__all__ = ["NativeBackend", "NativeUnavailable", "engine_status"]

log = logging.getLogger("tba.storage")


def _region_of(buf: Any) -> tuple[int, int]:
    """(address, bytes) of a contiguous CPU torch tensor or a memoryview."""
    if hasattr(buf, "data_ptr"):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("tba.storage: register() needs a contiguous CPU tensor")
        return buf.data_ptr(), buf.numel() * buf.element_size()
    view = memoryview(buf)
    return address_of(view), view.nbytes


class NativeBackend(SlabBackend):
    """O_DIRECT slab files served by the C engine. See NOTE [Native engine]."""

    name = "native"
    direct = True
    mode = "O_DIRECT"

    def __init__(self, cfg: Config, *, require_ring: bool = False, _setup_errno: int | None = None):
        lib, _path, error = _load()
        if lib is None:
            raise NativeUnavailable(_errno.ENOENT, f"tba.storage: {error}")
        engine = _Engine(lib, cfg.io_depth, _setup_errno)
        info = engine.info()
        if require_ring and info.kind != _IO_URING:
            engine.close()
            raise NativeUnavailable(
                info.setup_errno or _errno.ENOSYS,
                f"tba.storage: io_uring is required but unavailable: {_ring_reason(info)}. Allow "
                "the io_uring_* syscalls (docker run --security-opt seccomp=<a profile with "
                "them>), set kernel.io_uring_disabled=0, or let the engine fall back to threads.",
            )
        self._engine = engine
        self.kind = "io_uring" if info.kind == _IO_URING else "threads"
        self.depth = info.depth
        self.ring_reason = _ring_reason(info)
        self.registered_files = info.files_table > 0
        self.registered_buffers = False
        self.buffer_reason = "no buffer registered yet"
        self._handles: dict[int, int] = {}  # slab index -> engine file handle
        self._handles_lock = threading.Lock()
        self._regions: dict[tuple[int, int], tuple[int, Any]] = {}  # -> (region id, the buffer)
        try:
            super().__init__(cfg)
        except BaseException:
            engine.close()
            raise
        engine.stats, engine.stats_lock = self._stats, self._stats_lock
        self._slabs.on_release(self._forget_closed_slabs)  # NOTE [Slabs] 6 in slab.py
        self._finalizer.detach()
        self._finalizer = weakref.finalize(
            self, _release_native, engine, self._pool, self._slabs, self._spill
        )

    # -- what runs, and why ----------------------------------------------------------------
    def engine_info(self) -> dict[str, int]:
        """The engine's counters: ops_fixed, ops_plain, resubmit_short, files_registered..."""
        info = self._engine.info()
        return {name: getattr(info, name) for name, _type in _Info._fields_ if name != "size"}

    def _engine_summary(self) -> str:
        if self.kind == "threads":
            return f"thread engine with {self.depth} threads ({self.ring_reason})"
        info = self._engine.info()
        if info.files_table == 0:
            files = f"plain slab fds (file table refused: {_name(info.files_errno)})"
        elif info.files_plain and info.files_errno:
            files = (
                f"registered slab files, {info.files_plain} by plain fd ({_name(info.files_errno)})"
            )
        else:
            files = "registered slab files"
        if info.buffers_registered:
            buffers = (
                f"{info.buffers_registered} registered buffer region(s) of "
                f"{format_size(info.buffer_bytes)}"
            )
        else:
            buffers = f"unregistered buffers ({self.buffer_reason})"
        return f"io_uring engine, depth {self.depth}, {files}, {buffers}"

    def _describe(self) -> str:
        return f"{self._engine_summary()}; {super()._describe()}"

    # -- bandwidth caps, in the engine -----------------------------------------------------
    def _apply_rate(self, op: str, bps: int | None, burst: int | None) -> tuple[int, int] | None:
        code = _WRITE if op == "write" else _READ
        rc = self._engine.call("tba_engine_set_rate", code, bps or 0, burst or 0)
        if rc < 0:
            raise ValueError(f"tba.storage: the native engine refused the cap: {_name(-rc)}")
        if not bps:
            return None
        info = self._engine.info()
        return bps, info.burst_write if op == "write" else info.burst_read

    def _throttle_seconds(self) -> dict[str, float]:
        info = self._engine.info()
        return {"write": info.throttle_ns_write / 1e9, "read": info.throttle_ns_read / 1e9}

    # -- the probe goes through the engine -------------------------------------------------
    def _sync(self, code: int, fd: int, buf: memoryview, off: int, shown: str) -> None:
        h = self._engine.call("tba_engine_add_file", fd)
        if h < 0:
            raise StorageError("open", shown, 0, 0, -h, hint_for(-h))
        try:
            op = "write" if code == _WRITE else "read"
            req = _Request(op, shown, off, buf, None, "off", None, False)
            self._engine.submit(code, h, buf, off, self._unit, req).result()
        finally:
            self._engine.call("tba_engine_remove_file", h)

    def _write_all(self, fd: int, buf: memoryview, off: int, shown: str) -> None:
        self._sync(_WRITE, fd, buf, off, shown)

    def _read_all(self, fd: int, buf: memoryview, off: int, shown: str) -> None:
        self._sync(_READ, fd, buf, off, shown)

    # -- slab files in the engine ----------------------------------------------------------
    def _handle(self, slab: Slab) -> int:
        h = self._handles.get(slab.index)
        if h is None:
            with self._handles_lock:
                h = self._handles.get(slab.index)
                if h is None:
                    h = self._engine.call("tba_engine_add_file", slab.fd)
                    if h < 0:
                        raise StorageError("open", slab.display, 0, 0, -h, hint_for(-h))
                    self._handles[slab.index] = h
        return h

    def _forget_closed_slabs(self) -> None:
        with self._handles_lock:
            for index in self._handles.keys() - self._slabs.slabs.keys():
                self._engine.call("tba_engine_remove_file", self._handles.pop(index))

    # -- the Backend protocol --------------------------------------------------------------
    def write(
        self, extent: Extent, buf: memoryview, checksum: str = "off", span: Span = None
    ) -> Future:
        digest: Digest | None = digest_for(checksum, span)
        slab = self._check(extent, buf)
        req = _Request("write", slab.display, extent.offset, buf, digest, checksum, None, True)
        return self._engine.submit(_WRITE, self._handle(slab), buf, extent.offset, self._unit, req)

    def read(
        self,
        extent: Extent,
        buf: memoryview,
        checksum: str = "off",
        expect: int | None = None,
        span: Span = None,
    ) -> Future:
        digest = digest_for(checksum, span)
        slab = self._check(extent, buf)
        if buf.readonly:
            raise ValueError("tba.storage: read() needs a writable buffer")
        req = _Request("read", slab.display, extent.offset, buf, digest, checksum, expect, True)
        return self._engine.submit(_READ, self._handle(slab), buf, extent.offset, self._unit, req)

    # -- registration and fault injection --------------------------------------------------
    def register(self, buf: Any) -> bool:
        """Register a long-lived buffer (a CPU uint8 tensor or a memoryview), e.g. the staging
        arena, so ops inside it use READ_FIXED/WRITE_FIXED. False, with ``buffer_reason`` saying
        why, when the kernel refuses (RLIMIT_MEMLOCK) or no ring runs; I/O works either way.
        The backend keeps ``buf`` alive until :meth:`unregister` or close()."""
        addr, nbytes = _region_of(buf)
        if (addr, nbytes) in self._regions:
            return True
        before = self.probe_summary()
        rc = self._engine.call("tba_engine_register_buffer", addr, nbytes)
        if rc < 0:
            self.buffer_reason = _buffer_refusal(-rc, nbytes, self.kind)
            log.info("tba.storage: native: %s", self.buffer_reason)
        else:
            self._regions[(addr, nbytes)] = (rc, buf)
            self.registered_buffers = True
        self._refresh_reason(before)
        return rc >= 0

    def unregister(self, buf: Any) -> bool:
        """Undo :meth:`register`; only once no I/O on ``buf`` is in flight."""
        entry = self._regions.pop(_region_of(buf), None)
        if entry is None:
            return False
        before = self.probe_summary()
        self._engine.call("tba_engine_unregister_buffer", entry[0])
        self.registered_buffers = bool(self._regions)
        self._refresh_reason(before)
        return True

    def inject(
        self,
        op: str,
        kind: str,
        count: int = 1,
        errno: int = 0,
        nbytes: int | None = None,
        jump_ns: int = 0,
    ) -> None:
        """Tests: the next ``count`` attempts of ``op`` ("read", "write", "register", "files")
        go ``kind``: "short" (at most ``nbytes``, default one alignment unit, then the engine
        resubmits the rest), "fail" (with ``errno``), or "clear" (drop pending rules).
        "clock" (op "read" or "write", either: it is the engine's one clock) makes each of the
        engine's next ``count`` clock readings land ``jump_ns`` later than the one before would
        have, for the caps' timing in io_uring mode (TBA_INJECT_CLOCK in native/tba_engine.h)."""
        if op not in _OPS or kind not in _KINDS:
            raise ValueError(f"tba.storage: inject({op!r}, {kind!r}): unknown op or kind")
        if kind == "fail" and errno <= 0:
            raise ValueError("tba.storage: inject(..., 'fail') needs errno > 0")
        if kind == "clock":
            value = jump_ns
        elif kind == "fail":
            value = errno
        else:
            value = self.alignment if nbytes is None else nbytes
        rc = self._engine.call("tba_engine_inject", _OPS[op], _KINDS[kind], value, count)
        if rc < 0:
            raise ValueError(f"tba.storage: inject refused: {_name(-rc)}")
