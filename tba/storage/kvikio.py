"""The ``kvikio`` backend: slab files moved through kvikio's ``CuFile`` (GPUDirect Storage).

kvikio is optional (``pip install 'tba[gds]'``, about 3 GB with its CUDA libraries). Without an
NVIDIA driver ``import kvikio`` still works, but every CuFile read or write raises, host buffers
included. So nothing here trusts the import: :class:`KvikioBackend` probes with a real write and
read, and :func:`kvikio_status` (for ``tba doctor`` and backend selection) only reports what kvikio
says about itself.

NOTE [kvikio]
1. Files. kvikio's Python ``CuFile`` takes a path, never an fd, and our slabs have no name
   (O_TMPFILE). Opening ``/proc/self/fd/<fd>`` (or ``/dev/fd/<fd>``) reopens the same inode, so
   each slab gets one CuFile on that path. The flags are ``"r+"`` (O_RDWR): ``"w"`` would add
   O_CREAT|O_TRUNC and cut the preallocated slab to zero bytes. kvikio opens the file twice (plain,
   and O_DIRECT for cuFile), and those fds keep the inode alive: when the slab set closes an empty
   slab (to make room, or to give it back to the node quota), its CuFile is closed too (the slab
   set's ``on_release``, before the ledger records it), or its blocks would never return to the
   filesystem. CuFiles are keyed by the slab's display name, which is never reused,
   so a recycled fd number cannot reach a stale CuFile.
2. Transfers. ``pread``/``pwrite`` return an ``IOFuture`` whose ``get()`` gives the byte count or
   raises. kvikio splits a request into tasks on its pool, and when one fails ``get()`` rethrows
   at once while the other tasks still use the buffer. So tba sends one request per task
   (``gds_task_bytes``, which kvikio then runs as a single task), waits for every one, and only
   then reports: a buffer is never freed or reused under a running task. They run on the shared
   :class:`SlabBackend` loop (NOTE [Transfers]). kvikio's POSIX path moves every byte or raises;
   only cuFile returns short counts, and the transfer resumes after the requests that moved all
   their bytes, on a 4 KiB GPU page (or the DIO unit when larger), since kvikio splits unaligned
   GDS requests into a slower path. A read of 0 bytes, or requests that make no progress, are
   errors. kvikio raises RuntimeError without an errno, so the errno comes from an OSError, or
   from kvikio's texts (26.10): most end in the strerror text of the failed call, its EBADF
   reads "POSIX error: Operation not permitted", cuFile's -1 is EIO, and "POSIX error on pread:
   EOF" is an unexpected end of file. The StorageError names op, file, offset, bytes and errno,
   and quotes kvikio. Nothing is ever zero-filled.
3. Buffers. Host buffers (aligned memoryviews, pinned staging) keep the O_DIRECT alignment check.
   kvikio sends them through POSIX pread/pwrite and never through cuFile, and reads them through
   the page cache unless ``auto_direct_io_read`` is on: tba turns on ``auto_direct_io_read`` and
   ``auto_direct_io_write`` (26.02 and later, process-wide) before its first CuFile, whose
   O_DIRECT descriptor kvikio opens then. Device buffers (CUDA tensors, objects with
   ``__cuda_array_interface__``) only need the right length: cuFile accepts any device address.
   With a checksum, a device buffer is first copied to the host on the I/O thread. That costs a
   D2H copy, so turn checksums off for device-direct runs.
4. Threads and task size come from ``io_threads`` and ``gds_task_bytes``. They are set through
   ``kvikio.defaults.set`` (25.04 and later) or ``num_threads_reset``/``task_size_reset`` (older
   releases; their ``set_num_threads`` is a context manager that does nothing when called bare).
   The values are read back for the summary. kvikio's thread pool is process-wide. Our own
   ``io_threads`` threads only submit requests and wait on them, so that many requests are in
   flight, each one split into tasks on kvikio's pool.
5. GDS or compat mode. ``device_direct`` is True only when the cuFile driver reports GDS, kvikio
   does not prefer its compat mode, and the probe passed with a device buffer. That probe is at
   least ``gds_threshold`` bytes: kvikio sends smaller device requests through POSIX, so a
   smaller probe would never reach cuFile. In compat mode, kvikio bounces device buffers through
   its own host buffers, so our pinned staging is as good. Under KVIKIO_COMPAT_MODE=AUTO, kvikio
   may still fall back to POSIX for a single file whose cuFile registration fails, and its Python
   API does not say so.

What kvikio says about itself (:func:`kvikio_status`), its settings and its errors are read in
tba/storage/_kvikio_api.py; device and host buffers are shaped in tba/storage/_kvikio_buffers.py.
This module is the Backend: the probe, one CuFile per slab, and the transfers.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from ..config import Config
from ..errors import StorageError, TBAError, hint_for, internal_error
from ..host.memory import aligned_empty, as_memoryview
from ._kvikio_api import (
    _configure,
    _describe,
    _direct_host_io,
    _errno_of,
    _facts,
    _gds_threshold,
    _is_eof,
    _load,
    _part,
    kvikio_status,
)
from ._kvikio_buffers import _CudaBytes, _device_view, _host_bytes, _host_view, _via_host
from .base import Extent, Span
from .checksum import checksum_fn
from .filebackend import SlabBackend
from .slab import Slab, open_unnamed
from .statx import dio_alignment, io_alignment

__all__ = ["KvikioBackend", "KvikioUnavailable", "kvikio_status"]

log = logging.getLogger("tba.storage")

_GPU_PAGE = 4096  # cuFile moves whole GPU pages directly; kvikio splits anything else
_ELSEWHERE = "TBA_BACKEND=posix needs no GPU."
_NO_DRIVER = "Without a working NVIDIA driver every kvikio transfer fails, host buffers included. "


class KvikioUnavailable(TBAError, OSError):
    """kvikio cannot be used here: it is not installed, fails to import, or its probe failed."""


class _ProbeMismatch(StorageError):
    """The probe read back other bytes than it wrote."""


def _cuda_probe_pair(nbytes: int) -> tuple[Any, Any] | None:
    """A random device buffer and a marker-filled one for the probe, or None without CUDA."""
    try:
        if not torch.cuda.is_available():
            return None
    except Exception:
        return None
    dev = torch.device("cuda", torch.cuda.current_device())
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize(dev)  # cuFile's DMA is ordered on no stream: the fills must be done
    return src, dst


def _close_quietly(f: Any) -> None:
    try:
        f.close()
    except Exception as e:
        log.warning("tba.storage: closing a kvikio CuFile failed: %s", _describe(e))


# -- the backend ------------------------------------------------------------------------------
class KvikioBackend(SlabBackend):
    """Slab files moved through kvikio CuFiles; device buffers go direct when GDS works.

    See NOTE [kvikio]. ``device_direct`` says whether the offloader may hand it device buffers.
    """

    name = "kvikio"
    direct = True
    mode = "kvikio"

    def __init__(self, cfg: Config, *, kvikio_module: Any = None):
        mod, why = _load(kvikio_module)
        if mod is None:
            raise KvikioUnavailable(f"tba.storage: {why}.")
        self._kvikio = mod
        self._facts = _facts(mod)
        self.version = self._facts.version
        self.gds_available = self._facts.gds_available
        self.compat_mode = self._facts.compat_mode
        self.device_direct = False
        self.task_bytes = cfg.gds_task_bytes
        defaults = _part(mod, "defaults")
        self.threads, self._threads_note = _configure(defaults, cfg.io_threads, cfg.gds_task_bytes)
        self.host_direct_io, self._direct_note = _direct_host_io(defaults, self._facts.who)
        self.gds_threshold = _gds_threshold(defaults)
        self._device_probe = "not run"
        self._files: dict[str, Any] = {}
        self._kv_lock = threading.Lock()
        self._registered: dict[int, _CudaBytes] = {}
        super().__init__(cfg)  # runs self._probe()
        self._slabs.on_release(self._close_released)  # NOTE [Slabs] 6 in slab.py

    # -- probe ------------------------------------------------------------------------------
    def _probe(self) -> tuple[tuple[int, int], int]:
        try:
            return self._probe_kvikio()
        except StorageError as e:
            why = "" if isinstance(e, _ProbeMismatch) else _NO_DRIVER
            raise KvikioUnavailable(
                f"tba.storage: {self._facts.who} imported, but its probe through CuFile failed: "
                f"{str(e).removeprefix('tba.storage: ')} {why}{_ELSEWHERE}"
            ) from e

    def _probe_kvikio(self) -> tuple[tuple[int, int], int]:
        """A page of random bytes written and read back through a CuFile (and a device pair)."""
        sp = self._spill
        shown = f"{sp.path}/probe (unlinked)"
        fd = open_unnamed(sp.fd, sp.path, self.direct, "probe")
        try:
            dio = dio_alignment(fd)
            align = io_alignment(dio)
            self._unit = max(dio) or align
            f = self._open_file(fd, shown)
            try:
                out = as_memoryview(aligned_empty(align, align))
                out[:] = os.urandom(align)
                back = as_memoryview(aligned_empty(align, align))
                back[:] = b"\xa5" * align
                self._round_trip(f, out, back, 0, shown)
                self._probe_device(f, align, shown)
            finally:
                _close_quietly(f)
        finally:
            os.close(fd)
        return dio, align

    def _round_trip(self, f: Any, out: Any, back: Any, off: int, shown: str) -> None:
        self._move("probe write", f.pwrite, out, off, shown)
        self._move("probe read", f.pread, back, off, shown)
        if bytes(_host_bytes(back)) != bytes(_host_bytes(out)):
            kind = "device" if isinstance(out, _CudaBytes) else "host"
            raise _ProbeMismatch(
                "probe read",
                shown,
                off,
                len(out),
                errno.EIO,
                f"kvikio read back different bytes than it wrote (a {kind} buffer): do not "
                "trust it on this system.",
            )

    def _probe_device(self, f: Any, align: int, shown: str) -> None:
        # kvikio sends a device request under gds_threshold through POSIX, not cuFile (NOTE 5)
        nbytes = -(-max(align, self.gds_threshold) // align) * align
        pair = _cuda_probe_pair(nbytes)
        if pair is None:
            self._device_probe = "skipped (no CUDA device)"
            return
        out, back = (_device_view(b) for b in pair)
        try:
            self._round_trip(f, out, back, align, shown)
        except _ProbeMismatch:
            raise  # corruption: refuse the backend altogether
        except StorageError as e:
            self._device_probe = f"failed ({str(e).removeprefix('tba.storage: ')})"
            log.warning("tba.storage: kvikio device-buffer probe failed: %s", e)
            return
        self._device_probe = "passed"
        self.device_direct = self._facts.gds

    def _describe(self) -> str:
        m, o = self.dio
        if self.device_direct:
            path = "GDS: device buffers go straight between GPU memory and the drive"
        elif self._facts.gds:
            path = "GDS driver available, but device_direct is off until a device buffer probes"
        else:
            path = "compat mode (POSIX): stage through pinned host memory"
        threads = self.threads if self.threads is not None else "kvikio's default"
        note = f" ({self._threads_note})" if self._threads_note else ""
        return (
            f"{self._facts.who} write+read probe passed on {self.fs} at {self._spill.root} "
            f"(dio align {m}/{o}, using {self.alignment}); device-buffer probe "
            f"{self._device_probe}; {path}; {self._direct_note}; {threads} kvikio "
            f"threads{note}, {self.task_bytes >> 10} KiB tasks"
        )

    # -- files --------------------------------------------------------------------------------
    def _open_file(self, fd: int, shown: str) -> Any:
        """A CuFile on the nameless file ``fd``, reopened through its /proc link (NOTE 1)."""
        failures = []
        for path in (f"/proc/self/fd/{fd}", f"/dev/fd/{fd}"):
            try:
                return self._kvikio.CuFile(path, "r+")
            except Exception as e:
                failures.append((path, e))
        code = _errno_of(failures[0][1])
        tried = "; ".join(f"{p}: {_describe(e)}" for p, e in failures)
        raise StorageError(
            "open",
            shown,
            0,
            0,
            code,
            f"kvikio.CuFile could not open the slab through its fd link ({tried}). Is /proc "
            "mounted?",
        )

    def _file_for(self, fd: int, shown: str) -> Any:
        with self._kv_lock:
            f = self._files.get(shown)
            if f is None:
                f = self._files[shown] = self._open_file(fd, shown)
            return f

    def _close_released(self) -> None:
        """Close the CuFiles of slabs the slab set has closed (NOTE 1)."""
        live = {s.display for s in list(self._slabs.slabs.values())}
        with self._kv_lock:
            gone = [self._files.pop(k) for k in list(self._files) if k not in live]
        for f in gone:
            _close_quietly(f)

    # -- transfers ----------------------------------------------------------------------------
    def _move(self, op: str, method: Callable[..., Any], buf: Any, off: int, shown: str) -> None:
        """All of ``buf`` at ``off`` through ``method`` (a CuFile's pread/pwrite); NOTE 2."""
        failures: list[BaseException] = []

        def call(view: Any, at: int) -> int:
            try:
                return self._tasks(method, view, at)
            except Exception as e:
                failures.append(e)
                raise OSError(_errno_of(e), str(e)) from None

        try:
            self._transfer(op, call, buf, off, shown)
        except StorageError as err:
            if not failures:
                raise
            cause = failures[-1]
            hint = hint_for(err.errno)
            if _is_eof(cause):
                hint = (
                    "Unexpected end of file: the spill file is shorter than the extent. Nothing "
                    "was zero-filled; the tensor cannot be restored."
                )
            hint = f"kvikio: {_describe(cause)}. {hint}".strip()
            raise StorageError(err.op, err.path, err.offset, err.nbytes, err.errno, hint) from cause

    def _tasks(self, method: Callable[..., Any], view: Any, at: int) -> int:
        """One kvikio request per task of ``view``, all waited for; the bytes moved from the
        start of ``view`` (NOTE 2)."""
        n, step = len(view), self.task_bytes
        futures: list[tuple[int, Any]] = []
        first: BaseException | None = None
        for start in range(0, n, step):
            part = view[start : start + step]
            try:
                futures.append((len(part), method(part, len(part), at + start, step)))
            except Exception as e:
                first = e
                break
        done, whole = 0, True
        for want, fut in futures:  # every one, even after a failure: they all use the buffer
            try:
                got = int(fut.get())
            except Exception as e:
                first = e if first is None else first
                whole = False
                continue
            if not 0 <= got <= want:
                bad = OSError(errno.EIO, f"kvikio reported {got} bytes for a {want}-byte request")
                first = bad if first is None else first
            if whole:
                done += got
                whole = got == want
        if first is not None:
            raise first
        return done

    def _resume_at(self, pos: int, n: int) -> int:
        return pos - pos % max(self._unit, _GPU_PAGE) if pos < n else pos

    def _write_all(self, fd: int, buf: Any, off: int, shown: str) -> None:
        self._move("write", self._file_for(fd, shown).pwrite, buf, off, shown)

    def _read_all(self, fd: int, buf: Any, off: int, shown: str) -> None:
        self._move("read", self._file_for(fd, shown).pread, buf, off, shown)

    def _check(self, extent: Extent, buf: Any) -> Slab:
        if not isinstance(buf, _CudaBytes):
            return super()._check(extent, buf)
        if self._closed:
            raise ValueError(f"tba.storage: I/O on a closed {self.name} backend")
        return self._slabs.slab_for(extent, len(buf))  # any device address suits cuFile

    # -- the Backend protocol -----------------------------------------------------------------
    def write(self, extent: Extent, buf: Any, checksum: str = "off", span: Span = None) -> Future:
        view = _device_view(buf)
        if view is None:
            return super().write(extent, _host_view(buf), checksum, span)
        _whole(span)
        digest = _via_host(checksum_fn(checksum))
        slab = self._check(extent, view)
        return self._submit("write", len(view), self._write_job, slab, extent.offset, view, digest)

    def read(
        self,
        extent: Extent,
        buf: Any,
        checksum: str = "off",
        expect: int | None = None,
        span: Span = None,
    ) -> Future:
        view = _device_view(buf)
        if view is None:
            return super().read(extent, _host_view(buf), checksum, expect, span)
        _whole(span)
        if view.readonly:
            raise ValueError("tba.storage: cannot read into a read-only device buffer")
        digest = _via_host(checksum_fn(checksum))
        slab = self._check(extent, view)
        return self._submit(
            "read", len(view), self._read_job, slab, extent.offset, view, checksum, digest, expect
        )

    def register(self, buf: Any) -> bool:
        """Register a long-lived device buffer with cuFile; True when it was registered.

        Only device memory under GDS gains anything: kvikio moves host buffers with POSIX calls,
        never with cuFile, and in compat mode its ``memory_register`` does nothing. cuFile
        registers the whole CUDA allocation holding ``buf``, so a second buffer in the same
        allocation is refused (False). The backend keeps ``buf`` alive and deregisters it at
        :meth:`close`.
        """
        if self._closed:
            raise ValueError(f"tba.storage: register() on a closed {self.name} backend")
        view = _device_view(buf)
        if view is None or not self.device_direct:
            return False
        reg = getattr(self._kvikio, "memory_register", None)
        if not callable(reg):
            return False
        with self._kv_lock:
            if view.ptr in self._registered:
                return True
            try:
                reg(view)
            except Exception as e:
                log.debug("tba.storage: kvikio.memory_register(%r) failed: %s", view, e)
                return False
            self._registered[view.ptr] = view
        return True

    def close(self) -> None:
        """Wait for in-flight I/O, close slabs and CuFiles, deregister buffers."""
        if self._closed:
            return
        super().close()
        with self._kv_lock:
            files = list(self._files.values())
            self._files.clear()
            registered = list(self._registered.values())
            self._registered.clear()
        for f in files:
            _close_quietly(f)
        dereg = getattr(self._kvikio, "memory_deregister", None)
        for view in registered:
            try:
                dereg(view)
            except Exception as e:
                log.warning("tba.storage: kvikio.memory_deregister(%r) failed: %s", view, e)


def _whole(span: Span) -> None:
    """Device buffers are staging blocks or read buffers, checksummed whole: a partial span
    belongs only to direct captures of CPU tensors (NOTE [Direct capture] in
    tba/datapath/capture/staging.py)."""
    if span is not None:
        raise internal_error("storage", f"a checksum span {span} for a device buffer")
