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
   raises. They run on the shared :class:`SlabBackend` loop (NOTE [Transfers]). A short count is
   resubmitted for the rest, starting on a 4 KiB GPU page (or the DIO unit when larger), since
   kvikio splits unaligned GDS requests into a slower path. A read of 0 bytes, or requests that
   make no progress, are errors. kvikio raises RuntimeError without an errno, so the errno comes
   from an OSError, or from the strerror text of kvikio's own syscall failures ("POSIX error
   ...", "... system/library function call error ..."), else it is EIO. The StorageError names
   op, file, offset, bytes and errno, and quotes kvikio. Nothing is ever zero-filled.
3. Buffers. Host buffers (aligned memoryviews, pinned staging) keep the O_DIRECT alignment check.
   kvikio sends them through POSIX pread/pwrite and never through cuFile. Device buffers (CUDA
   tensors, objects with ``__cuda_array_interface__``) only need the right length: cuFile accepts
   any device address. With a checksum, a device buffer is first copied to the host on the I/O
   thread. That costs a D2H copy, so turn checksums off for device-direct runs.
4. Threads and task size come from ``io_threads`` and ``gds_task_bytes``. They are set through
   ``kvikio.defaults.set`` (25.04 and later) or ``num_threads_reset``/``task_size_reset`` (older
   releases; their ``set_num_threads`` is a context manager that does nothing when called bare).
   The values are read back for the summary. The task size is also passed with every call, which
   every release accepts. kvikio's thread pool is process-wide. Our own ``io_threads`` threads only
   submit requests and wait on them, so that many requests are in flight, each one split into
   tasks on kvikio's pool.
5. GDS or compat mode. ``device_direct`` is True only when the cuFile driver reports GDS, kvikio
   does not prefer its compat mode, and the probe passed with a device buffer. In compat mode,
   kvikio bounces device buffers through its own host buffers, so our pinned staging is as good.
   Under KVIKIO_COMPAT_MODE=AUTO, kvikio may still fall back to POSIX for a single file whose
   cuFile registration fails, and its Python API does not say so.
"""

from __future__ import annotations

import errno
import importlib
import logging
import math
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from .._memory import aligned_empty, as_memoryview
from ..config import Config
from ..errors import StorageError, TBAError, hint_for
from .base import Extent
from .checksum import Digest, checksum_fn
from .filebackend import SlabBackend
from .slab import Slab, open_unnamed
from .statx import dio_alignment, io_alignment

__all__ = ["KvikioBackend", "KvikioUnavailable", "kvikio_status"]

log = logging.getLogger("tba.storage")

_INSTALL = "pip install 'tba[gds]'"
_GPU_PAGE = 4096  # cuFile moves whole GPU pages directly; kvikio splits anything else
_ELSEWHERE = "TBA_BACKEND=posix needs no GPU."
_NO_DRIVER = "Without a working NVIDIA driver every kvikio transfer fails, host buffers included. "
# Prefixes of kvikio's messages for failed syscalls: only these end in a strerror text.
_SYSCALL_MESSAGES = ("POSIX error", "system/library function call error")
_STRERRORS = sorted(
    ((os.strerror(code), code) for code in errno.errorcode if code > 0),
    key=lambda pair: -len(pair[0]),
)


class KvikioUnavailable(TBAError, OSError):
    """kvikio cannot be used here: it is not installed, fails to import, or its probe failed."""


class _ProbeMismatch(StorageError):
    """The probe read back other bytes than it wrote."""


# -- what kvikio says about itself (no I/O) ---------------------------------------------------
def _describe(exc: BaseException) -> str:
    try:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    except Exception:
        text = "<unprintable>"
    name = type(exc).__name__
    return f"{name}: {text[:300]}" if text else name


def _load(kvikio_module: Any = None) -> tuple[Any, str]:
    """(the kvikio module, "") or (None, why it cannot be imported)."""
    if kvikio_module is not None:
        return kvikio_module, ""
    try:
        return importlib.import_module("kvikio"), ""
    except ModuleNotFoundError as e:
        if e.name in ("kvikio", None):
            return None, f"kvikio is not installed ({_INSTALL})"
        return None, (
            f"kvikio is installed but part of it or of its dependencies is missing "
            f"({_describe(e)}); reinstall it with {_INSTALL}"
        )
    except Exception as e:
        return None, (
            f"kvikio is installed but failed to import ({_describe(e)}); reinstall it with "
            f"{_INSTALL}, in the kvikio-cu* flavour matching your CUDA driver"
        )


def _part(mod: Any, name: str) -> Any:
    """``kvikio.<name>``: its ``__init__`` does not import ``defaults`` or ``cufile_driver``."""
    try:
        sub = getattr(mod, name, None)
    except Exception:
        sub = None
    if sub is not None:
        return sub
    modname = getattr(mod, "__name__", None)
    if isinstance(modname, str) and sys.modules.get(modname) is mod:
        try:
            return importlib.import_module(f"{modname}.{name}")
        except Exception:
            return None
    return None


def _version(mod: Any) -> str | None:
    try:
        v = getattr(mod, "__version__", None)
        return None if v is None else str(v)
    except Exception:
        return None


def _gds_available(driver: Any) -> tuple[bool | None, str]:
    """Whether the cuFile driver reports GDS: 25.x ``get``, 24.12 ``properties``, 24.x class."""
    if driver is None:
        return None, "kvikio.cufile_driver is missing"
    try:
        get = getattr(driver, "get", None)
        if callable(get):
            return bool(get("is_gds_available")), ""
        props = getattr(driver, "properties", None)
        if props is None:
            cls = getattr(driver, "DriverProperties", None)
            props = cls() if callable(cls) else None
        if props is None:
            return None, "kvikio.cufile_driver has no is_gds_available"
        return bool(props.is_gds_available), ""
    except Exception as e:
        return None, f"querying the cuFile driver failed: {_describe(e)}"


def _mode_name(raw: Any) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, bool):  # releases before 24.10 answer "compat mode on?" with a bool
        return "ON" if raw else "OFF"
    name = getattr(raw, "name", None)
    text = name if isinstance(name, str) else str(raw).rsplit(".", 1)[-1]
    text = text.upper()
    return text if text in ("ON", "OFF", "AUTO") else None


def _compat(defaults: Any) -> tuple[str | None, bool | None]:
    """(requested compat mode ON/OFF/AUTO, whether kvikio will do POSIX I/O); None if unknown."""
    if defaults is None:
        return None, None
    requested = None
    try:
        get = getattr(defaults, "get", None)
        if callable(get):
            requested = _mode_name(get("compat_mode"))
        else:
            old = getattr(defaults, "compat_mode", None)
            requested = _mode_name(old()) if callable(old) else None
    except Exception:
        requested = None
    preferred = None
    try:
        fn = getattr(defaults, "is_compat_mode_preferred", None)
        if callable(fn):
            preferred = bool(fn())
    except Exception:
        preferred = None
    if preferred is None and requested in ("ON", "OFF"):
        preferred = requested == "ON"
    return requested, preferred


@dataclass(frozen=True)
class _Facts:
    version: str | None
    gds_available: bool | None
    compat_mode: str | None
    compat_preferred: bool | None
    note: str

    @property
    def who(self) -> str:
        return f"kvikio {self.version}" if self.version else "kvikio (version unknown)"

    @property
    def gds(self) -> bool:
        """kvikio will use cuFile (GDS), as far as it can tell without a transfer."""
        return (
            self.gds_available is True
            and self.compat_preferred is not True
            and self.compat_mode != "ON"
        )

    def reason(self) -> str:
        mode = self.compat_mode or "unknown"
        if self.compat_mode == "ON":
            state = "compat mode is forced ON (KVIKIO_COMPAT_MODE): POSIX I/O, no GDS"
        elif self.gds_available is False:
            state = "GDS driver not available, kvikio would run in compat mode (POSIX)"
        elif self.gds_available is None:
            state = f"GDS driver state unknown ({self.note}); compat mode {mode}"
        elif self.compat_preferred:
            state = f"GDS driver loaded but kvikio prefers compat mode (POSIX); compat mode {mode}"
        else:
            state = (
                f"GDS driver available (compat mode {mode}): device buffers can go straight "
                "between GPU memory and the drive"
            )
        return f"{self.who} imported; {state}"


def _facts(mod: Any) -> _Facts:
    gds, note = _gds_available(_part(mod, "cufile_driver"))
    requested, preferred = _compat(_part(mod, "defaults"))
    return _Facts(_version(mod), gds, requested, preferred, note)


def kvikio_status(kvikio_module: Any = None) -> dict[str, Any]:
    """What kvikio says about itself: importable, version, GDS driver, compat mode, and why.

    Never raises and never does I/O (no file is opened). Importing proves little: without an
    NVIDIA driver, kvikio imports and then fails every transfer, which only the backend's probe
    shows.
    """
    try:
        mod, why = _load(kvikio_module)
        if mod is None:
            return {
                "importable": False,
                "version": None,
                "gds_available": None,
                "compat_mode": None,
                "reason": why,
            }
        f = _facts(mod)
        return {
            "importable": True,
            "version": f.version,
            "gds_available": f.gds_available,
            "compat_mode": f.compat_mode,
            "reason": f.reason(),
        }
    except Exception as e:  # pragma: no cover - every step above already guards itself
        return {
            "importable": False,
            "version": None,
            "gds_available": None,
            "compat_mode": None,
            "reason": f"kvikio status unknown: {_describe(e)}",
        }


# -- settings ---------------------------------------------------------------------------------
_OLD_GETTERS = {"num_threads": ("get_num_threads", "num_threads"), "task_size": ("task_size",)}


def _read_setting(defaults: Any, name: str) -> int | None:
    try:
        get = getattr(defaults, "get", None)
        if callable(get):
            return int(get(name))
        for attr in _OLD_GETTERS[name]:
            fn = getattr(defaults, attr, None)
            if callable(fn):
                return int(fn())
    except Exception:
        pass
    return None


def _configure(defaults: Any, threads: int, task_bytes: int) -> tuple[int | None, str]:
    """Set kvikio's thread count and task size; (threads read back, how), see NOTE 4."""
    if defaults is None:
        return None, "kvikio.defaults is missing; kvikio keeps its own thread count"
    try:
        setter = getattr(defaults, "set", None)
        if callable(setter):
            setter({"num_threads": threads, "task_size": task_bytes})
        else:
            reset_threads = getattr(defaults, "num_threads_reset", None)
            reset_task = getattr(defaults, "task_size_reset", None)
            if not (callable(reset_threads) and callable(reset_task)):
                raise AttributeError("kvikio.defaults has neither set() nor num_threads_reset()")
            reset_threads(threads)
            reset_task(task_bytes)
    except Exception as e:
        log.warning("tba.storage: could not set kvikio's thread count: %s", _describe(e))
        return _read_setting(defaults, "num_threads"), f"could not set ({_describe(e)})"
    return _read_setting(defaults, "num_threads"), ""


# -- errors -----------------------------------------------------------------------------------
def _errno_of(exc: BaseException) -> int:
    """The errno behind a kvikio failure, EIO when it gives none (NOTE 2)."""
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and code > 0:
        return code
    try:
        text = str(exc)
    except Exception:
        return errno.EIO
    if any(prefix in text for prefix in _SYSCALL_MESSAGES):
        for message, value in _STRERRORS:
            if message in text:
                return value
    return errno.EIO


# -- buffers ----------------------------------------------------------------------------------
class _CudaBytes:
    """A contiguous byte range of device memory, exported through ``__cuda_array_interface__``.

    Slicing gives a sub-range (the transfer loop resubmits ``buf[pos:]``); ``owner`` keeps the
    memory alive.
    """

    __slots__ = ("ptr", "nbytes", "owner", "device", "readonly")

    def __init__(
        self, ptr: int, nbytes: int, owner: Any, device: int | None, readonly: bool = False
    ):
        self.ptr = ptr
        self.nbytes = nbytes
        self.owner = owner
        self.device = device
        self.readonly = readonly

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, key: slice) -> _CudaBytes:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("tba.storage: a device buffer slices only as buf[start:stop]")
        start, stop, _ = key.indices(self.nbytes)
        stop = max(start, stop)
        return _CudaBytes(self.ptr + start, stop - start, self.owner, self.device, self.readonly)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        # No "stream" key: our callers order the memory themselves (NOTE [CUDA ordering]).
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, self.readonly),
            "version": 3,
            "strides": None,
        }

    def __repr__(self) -> str:
        return f"<device bytes {self.ptr:#x}+{self.nbytes}>"


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    step = itemsize
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != step:
            return False
        step *= size
    return True


def _device_view(buf: Any) -> _CudaBytes | None:
    """``buf`` as device bytes, or None when it is host memory."""
    if isinstance(buf, _CudaBytes):
        return buf
    if isinstance(buf, (memoryview, bytes, bytearray)):
        return None
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cuda":
            return None
        if not buf.is_contiguous():
            raise ValueError("tba.storage: a device buffer must be contiguous")
        return _CudaBytes(buf.data_ptr(), buf.numel() * buf.element_size(), buf, buf.device.index)
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is None:
        return None
    shape = tuple(cai["shape"])
    itemsize = int(cai["typestr"][2:])
    ptr, readonly = cai["data"]
    strides = cai.get("strides")
    if strides is not None and not _c_contiguous(shape, tuple(strides), itemsize):
        raise ValueError("tba.storage: a device buffer must be C-contiguous")
    return _CudaBytes(int(ptr), itemsize * math.prod(shape), buf, None, bool(readonly))


def _host_view(buf: Any) -> Any:
    """Host tensors become byte memoryviews; other host buffers pass through."""
    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ValueError("tba.storage: a host tensor buffer must be contiguous")
        return as_memoryview(buf.reshape(-1).view(torch.uint8))
    return buf


def _device_to_host(view: _CudaBytes) -> memoryview:
    """A host copy of device bytes (for checksums and the probe's comparison)."""
    where = "cuda" if view.device is None else f"cuda:{view.device}"
    return as_memoryview(torch.as_tensor(view, device=where).cpu())


def _host_bytes(buf: Any) -> memoryview:
    return _device_to_host(buf) if isinstance(buf, _CudaBytes) else memoryview(buf)


def _via_host(digest: Digest | None) -> Digest | None:
    if digest is None:
        return None
    return lambda view: digest(_device_to_host(view))


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
        self.threads, self._threads_note = _configure(
            _part(mod, "defaults"), cfg.io_threads, cfg.gds_task_bytes
        )
        self._device_probe = "not run"
        self._files: dict[str, Any] = {}
        self._kv_lock = threading.Lock()
        self._registered: dict[int, _CudaBytes] = {}
        super().__init__(cfg)  # runs self._probe()
        self._slabs.on_release(self._close_released)  # NOTE [Slabs] 5 in slab.py

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
        pair = _cuda_probe_pair(align)
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
            f"{self._device_probe}; {path}; {threads} kvikio threads{note}, "
            f"{self.task_bytes >> 10} KiB tasks"
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
            want = len(view)
            try:
                got = int(method(view, want, at, self.task_bytes).get())
            except Exception as e:
                failures.append(e)
                raise OSError(_errno_of(e), str(e)) from None
            if not 0 <= got <= want:
                bad = OSError(errno.EIO, f"kvikio reported {got} bytes for a {want}-byte request")
                failures.append(bad)
                raise bad
            return got

        try:
            self._transfer(op, call, buf, off, shown)
        except StorageError as err:
            if not failures:
                raise
            cause = failures[-1]
            hint = f"kvikio: {_describe(cause)}. {hint_for(err.errno)}".strip()
            raise StorageError(err.op, err.path, err.offset, err.nbytes, err.errno, hint) from cause

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
    def write(self, extent: Extent, buf: Any, checksum: str = "off") -> Future:
        view = _device_view(buf)
        if view is None:
            return super().write(extent, _host_view(buf), checksum)
        digest = _via_host(checksum_fn(checksum))
        slab = self._check(extent, view)
        return self._submit("write", len(view), self._write_job, slab, extent.offset, view, digest)

    def read(
        self, extent: Extent, buf: Any, checksum: str = "off", expect: int | None = None
    ) -> Future:
        view = _device_view(buf)
        if view is None:
            return super().read(extent, _host_view(buf), checksum, expect)
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
