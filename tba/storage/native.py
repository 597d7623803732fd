"""The ``native`` backend: tba's C I/O engine (io_uring, or a pthread pool) under SlabBackend.

NOTE [Native engine]
1. The engine is native/tba_engine.c, built by setup.py as the optional extension ``tba._engine``
   (a plain shared library without Python headers) and loaded here with ctypes, which releases
   the GIL during every foreign call. When the library is missing this module still imports:
   :func:`engine_status` says why, and :class:`NativeBackend` raises :class:`NativeUnavailable`.
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
"""

from __future__ import annotations

import ctypes
import errno as _errno
import functools
import importlib.machinery
import itertools
import logging
import os
import resource
import threading
import weakref
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import Any

from ..config import Config, format_size
from ..errors import StorageError, TBAError, hint_for
from .base import Extent
from .checksum import Digest, checksum_fn
from .filebackend import SlabBackend, _address, _release
from .slab import Slab

__all__ = ["NativeBackend", "NativeUnavailable", "engine_status"]

log = logging.getLogger("tba.storage")

_ABI = 2
_READ, _WRITE = 0, 1
_OPS = {"read": 0, "write": 1, "register": 2, "files": 3}
_KINDS = {"clear": 0, "short": 1, "fail": 2}
_IO_URING, _THREADS = 1, 2
_STAGES = {
    1: "io_uring_setup",
    2: "mmap of the io_uring rings",
    3: "IORING_REGISTER_PROBE",
    4: "eventfd for the reaper",
}
_WHY_EOF, _WHY_STALLED, _WHY_RETRIES, _WHY_SUBMIT = 2, 3, 4, 5
_BATCH = 64

_REBUILD = (
    "Reinstall tba where a C compiler is available (e.g. `apt-get install gcc`, then "
    "`pip install -e .` or `pip install --force-reinstall --no-deps .`; add -v to see the "
    "compiler's output), or use TBA_BACKEND=posix."
)


class NativeUnavailable(TBAError, OSError):
    """The native engine cannot serve: its library is not built, or io_uring was required.

    ``errno`` says why (ENOENT: no library; EPERM, ENOSYS...: io_uring_setup's refusal)."""

    def __init__(self, err: int, message: str):
        OSError.__init__(self, err, message)

    def __str__(self) -> str:  # the message already names the errno
        return self.strerror or ""


# -- the C ABI (native/tba_engine.h) ---------------------------------------------------------
def _fields(ctype: Any, names: str) -> list[tuple[str, Any]]:
    return [(name, ctype) for name in names.split()]


_P, _I, _I32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int32
_U32, _U64 = ctypes.c_uint32, ctypes.c_uint64


class _Config(ctypes.Structure):  # struct tba_engine_config
    _fields_ = (
        _fields(_U32, "size depth flags")
        + _fields(_I32, "simulate_setup_errno")
        + _fields(_U32, "max_files max_buffers max_again max_stalls")
    )


class _Info(ctypes.Structure):  # struct tba_engine_info
    _fields_ = (
        _fields(_U32, "size")
        + _fields(_I32, "kind")
        + _fields(_U32, "depth ring_entries features")
        + _fields(_I32, "setup_errno setup_stage files_errno")
        + _fields(_U32, "files_table files_registered files_plain")
        + _fields(_I32, "buffers_errno")
        + _fields(_U32, "buffers_registered threads")
        + _fields(
            _U64,
            "buffer_bytes ops_fixed ops_plain resubmit_short resubmit_again injected outstanding "
            "rate_read rate_write burst_read burst_write throttle_ns_read throttle_ns_write "
            "queued_read queued_write",
        )
    )


class _Completion(ctypes.Structure):  # struct tba_completion
    _fields_ = [
        ("user_data", _U64),
        ("result", ctypes.c_int64),
        ("done", _U64),
        ("why", _U32),
        ("tries", _U32),
    ]


_SIGNATURES: dict[str, list[Any]] = {
    "tba_engine_abi": [],
    "tba_engine_open": [ctypes.POINTER(_Config), ctypes.POINTER(_P)],
    "tba_engine_info": [_P, ctypes.POINTER(_Info)],
    "tba_engine_add_file": [_P, _I],
    "tba_engine_remove_file": [_P, _I],
    "tba_engine_register_buffer": [_P, _P, _U64],
    "tba_engine_unregister_buffer": [_P, _I],
    "tba_engine_submit": [_P, _I, _I, _P, _U64, _U64, _U32, _U64],
    "tba_engine_reap": [_P, ctypes.POINTER(_Completion), _I, _I],
    "tba_engine_wake": [_P],
    "tba_engine_inject": [_P, _I, _I, ctypes.c_int64, _I],
    "tba_engine_set_rate": [_P, _I, _U64, _U64],
    "tba_engine_shutdown": [_P],
    "tba_engine_close": [_P],
}


def _library_path() -> Path | None:
    package = Path(__file__).resolve().parent.parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = package / f"_engine{suffix}"
        if path.is_file():
            return path
    return None


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None, str | None]:
    """(library, its path, None), or (None, path or None, why it cannot be used and the fix)."""
    path = _library_path()
    if path is None:
        return (
            None,
            None,
            "the native engine (tba/_engine*.so) is not built: no C compiler was found, or it "
            "failed, when tba was installed (the build is optional, so the install went on). "
            + _REBUILD,
        )
    try:
        lib = ctypes.CDLL(str(path))
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
        abi = lib.tba_engine_abi()
    except (OSError, AttributeError) as e:
        return None, str(path), f"the native engine {path} cannot be loaded: {e}. " + _REBUILD
    if abi != _ABI:
        return (
            None,
            str(path),
            f"the native engine {path} has ABI {abi}, this tba needs {_ABI}: a stale build. "
            + _REBUILD,
        )
    return lib, str(path), None


def _buffer_address(buf: memoryview) -> int:
    if buf.readonly:
        return _address(buf)
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))  # 6x cheaper than numpy's


def _name(err: int) -> str:
    return _errno.errorcode.get(err, str(err))


def _read_sysctl(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _setup_failure(err: int, stage: int) -> str:
    """Why io_uring could not be used, e.g. 'io_uring_setup: EPERM (blocked by ...)'."""
    call = _STAGES.get(stage, "io_uring")
    if err == _errno.EPERM:
        disabled = _read_sysctl("/proc/sys/kernel/io_uring_disabled")
        if disabled == "2":
            why = "disabled for everyone by the sysctl kernel.io_uring_disabled=2"
        elif disabled == "1":
            why = (
                "kernel.io_uring_disabled=1 allows it only to kernel.io_uring_group, and this "
                "process is not in that group"
            )
        else:
            why = "blocked by a seccomp profile, e.g. Docker's default"
    elif err == _errno.ENOSYS:
        why = "the kernel has no io_uring (older than 5.1, built without it, or a sandbox hides it)"
    elif err == _errno.ENOMEM:
        why = "no memory for the rings (before Linux 5.12 they count against RLIMIT_MEMLOCK)"
    elif err == _errno.EOPNOTSUPP and stage == 3:
        why = "the kernel lacks IORING_OP_READ/WRITE (Linux 5.6 or newer is needed)"
    elif err == _errno.EINVAL and stage == 3:
        why = "the kernel is older than 5.6"
    else:
        why = os.strerror(err)
    return f"{call}: {_name(err)} ({why})"


def _ring_reason(info: _Info) -> str:
    if info.kind == _IO_URING:
        return f"io_uring: a {info.ring_entries}-entry ring works (features {info.features:#x})"
    if info.setup_stage == 5:
        return "io_uring was not tried: the thread pool was asked for"
    return _setup_failure(info.setup_errno, info.setup_stage)


def _memlock_bytes() -> int | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def _buffer_refusal(err: int, nbytes: int, kind: str) -> str:
    """Why registering a buffer failed; the I/O still works, through unregistered buffers."""
    if kind != "io_uring":
        return "the thread engine has nothing to register buffers with (no io_uring)"
    if err == _errno.ENOMEM:
        limit = _memlock_bytes()
        shown = "unlimited" if limit is None else format_size(limit)
        why = (
            f"pinning {format_size(nbytes)} would exceed RLIMIT_MEMLOCK ({shown}, counted per "
            "user). Raise it (ulimit -l, LimitMEMLOCK= in systemd, docker run --ulimit "
            "memlock=-1) or grant CAP_IPC_LOCK"
        )
    elif err == _errno.EBUSY:
        why = "this kernel (before 5.19) registers one buffer region at a time"
    elif err == _errno.ENOSPC:
        why = "the engine's registered-buffer table is full"
    elif err == _errno.EFAULT:
        why = "the kernel cannot pin this memory (file-backed or not anonymous)"
    else:
        why = os.strerror(err)
    return f"IORING_REGISTER_BUFFERS: {_name(err)}: {why}; I/O uses unregistered buffers"


def _failure_hint(err: int, why: int, tries: int) -> str:
    if why == _WHY_EOF:
        return (
            "Unexpected end of file: the spill file is shorter than the extent. Nothing was "
            "zero-filled; the tensor cannot be restored."
        )
    if why == _WHY_STALLED:
        return f"The device made no progress in {tries} attempts."
    if why == _WHY_RETRIES:
        return f"Still {_name(err)} after {tries} attempts. " + hint_for(err)
    if why == _WHY_SUBMIT:
        return "io_uring_enter refused the request itself. " + hint_for(err)
    if err == _errno.ESHUTDOWN:
        return "The backend was closed while the request was being submitted."
    if err == _errno.ECHILD:
        return (
            "This process was forked from the one that opened the backend, whose io_uring it "
            "shares: open a new backend in this process."
        )
    return hint_for(err)


def _mismatch_hint(name: str, expect: int, got: int) -> str:
    return (
        f"Checksum {name} mismatch: expected {expect:#x}, got {got:#x}. The spilled bytes were "
        "corrupted on the way to or from the device; check dmesg and the drive's health."
    )


# -- one engine and its reaper ---------------------------------------------------------------
class _Request:
    """What the reaper needs to finish one op. Holds the buffer alive until then."""

    __slots__ = ("future", "op", "shown", "offset", "buf", "digest", "name", "expect", "counted")

    def __init__(self, op, shown, offset, buf, digest, name, expect, counted):
        self.future: Future = Future()
        self.future.set_running_or_notify_cancel()  # in flight: cancel() can no longer stop it
        self.op = op
        self.shown = shown
        self.offset = offset
        self.buf = buf
        self.digest = digest
        self.name = name
        self.expect = expect
        self.counted = counted


class _Engine:
    """A C engine and the reaper thread resolving its futures. Holds no reference to a backend,
    so an unclosed backend can still be collected (its finalizer closes this)."""

    def __init__(self, lib: ctypes.CDLL, depth: int, setup_errno: int | None):
        cfg = _Config(size=ctypes.sizeof(_Config), depth=depth)
        cfg.simulate_setup_errno = setup_errno or 0
        handle = _P()
        rc = lib.tba_engine_open(ctypes.byref(cfg), ctypes.byref(handle))
        if rc < 0:
            raise NativeUnavailable(
                -rc,
                f"tba.storage: the native engine could not start: {_name(-rc)} "
                f"({os.strerror(-rc)}). Lower TBA_IO_DEPTH, or use TBA_BACKEND=posix.",
            )
        self.lib = lib
        self.eng: int | None = handle.value
        self.pid = os.getpid()  # a forked child must not use (or wait on) the parent's engine
        self.pending: dict[int, _Request] = {}
        self.stats: dict[str, int] = {}
        self.stats_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._gate = threading.Lock()  # no C call may race with tba_engine_close
        self._closed = False
        self._final: _Info | None = None  # the counters as they were at close
        self._thread = threading.Thread(target=self._run, name="tba-native-reaper", daemon=True)
        self._thread.start()

    # -- calls into the engine -------------------------------------------------------------
    def call(self, name: str, *args: Any) -> int:
        if os.getpid() != self.pid:
            return -_errno.ECHILD
        with self._gate:
            if self.eng is None:
                return -_errno.ESHUTDOWN
            return getattr(self.lib, name)(self.eng, *args)

    def info(self) -> _Info:
        info = _Info(size=ctypes.sizeof(_Info))
        if self.call("tba_engine_info", ctypes.byref(info)) < 0 and self._final is not None:
            return self._final  # closed: the last counters still stand
        return info

    def submit(self, code: int, handle: int, buf: memoryview, offset: int, unit: int, req):
        uid = next(self._ids)
        self.pending[uid] = req
        n = buf.nbytes
        if os.getpid() != self.pid:
            rc = -_errno.ECHILD
        else:
            rc = self._submit(code, handle, buf, n, offset, unit, uid)
        if rc < 0:
            del self.pending[uid]
            err = -rc
            req.future.set_exception(
                StorageError(req.op, req.shown, offset, n, err, _failure_hint(err, 0, 0))
            )
        return req.future

    def _submit(self, code, handle, buf, n, offset, unit, uid) -> int:
        with self._gate:
            if self.eng is None:
                return -_errno.ESHUTDOWN
            return self.lib.tba_engine_submit(
                self.eng, code, handle, _buffer_address(buf), n, offset, unit, uid
            )

    # -- completions -----------------------------------------------------------------------
    def _run(self) -> None:
        out = (_Completion * _BATCH)()
        reap = self.lib.tba_engine_reap
        while True:
            eng = self.eng
            if eng is None:
                return  # closed by a callback on this thread
            n = reap(eng, out, _BATCH, -1)
            if n < 0:
                if n != -_errno.ESHUTDOWN:
                    log.error("tba.storage: the native reaper stops: %s", _name(-n))
                return
            self._dispatch([(c.user_data, c.result, c.done, c.why, c.tries) for c in out[:n]])

    def _dispatch(self, batch: list[tuple[int, int, int, int, int]]) -> None:
        """Settle a batch (checksums, errors), count it, then resolve its futures: the usage
        counters already include an op when its future resolves, as with the other backends."""
        tally = dict.fromkeys(self.stats, 0)
        settled = []
        for uid, result, done, why, tries in batch:
            req = self.pending.pop(uid, None)
            if req is not None:
                try:
                    settled.append((req, *self._settle(req, tally, result, done, why, tries)))
                except BaseException as e:  # never let one op stop the reaper
                    settled.append((req, False, e))
        if any(tally.values()):
            with self.stats_lock:
                for k, v in tally.items():
                    self.stats[k] += v
        for req, ok, value in settled:
            try:
                if ok:
                    req.future.set_result(value)
                else:
                    req.future.set_exception(value)
            except InvalidStateError:  # pragma: no cover - the future is ours alone
                pass

    def _settle(
        self, req: _Request, tally: dict[str, int], result: int, done: int, why: int, tries: int
    ) -> tuple[bool, Any]:
        """(True, the future's value) or (False, its exception); adds the op to ``tally``."""
        buf = req.buf
        n = buf.nbytes
        counted = req.counted and bool(tally)
        if result < 0:
            err = -result
            if counted:
                tally["io_errors"] += 1
            hint = _failure_hint(err, why, tries)
            return False, StorageError(req.op, req.shown, req.offset + done, n - done, err, hint)
        if req.op == "write":
            value = req.digest(buf) if req.digest is not None else None
            if counted:
                tally["writes"] += 1
                tally["bytes_written"] += n
            return True, value
        if req.digest is not None and req.expect is not None:
            got = req.digest(buf)
            if got != req.expect:
                if counted:
                    tally["io_errors"] += 1
                    tally["checksum_errors"] += 1
                hint = _mismatch_hint(req.name, req.expect, got)
                return False, StorageError("read", req.shown, req.offset, n, _errno.EBADMSG, hint)
        if counted:
            tally["reads"] += 1
            tally["bytes_read"] += n
        return True, None

    def close(self) -> None:
        """Refuse new ops, let the reaper finish every op in flight, then free the engine."""
        if os.getpid() != self.pid:  # a forked child: drop its copies, leave the parent's ops
            if self.eng is not None:
                self.lib.tba_engine_close(self.eng)
                self.eng = None
            return
        with self._gate:
            if self._closed:
                return
            self._closed = True
            self.lib.tba_engine_shutdown(self.eng)
        if threading.current_thread() is self._thread:
            self._run()  # closed from a done-callback: finish the rest right here
        else:
            self._thread.join()
        self._final = self.info()
        with self._gate:
            self.lib.tba_engine_close(self.eng)
            self.eng = None
        # Every op has been reaped. Closed from a callback, the rest of that callback's batch is
        # still in `pending`: the reaper resolves it as soon as the callback returns.


def _release_native(engine: _Engine, *slab_parts: Any) -> None:
    engine.close()  # before the slab fds close: in-flight ops still use them
    _release(*slab_parts)


@functools.cache
def engine_status() -> dict[str, Any]:
    """Whether the native engine is built and whether io_uring works here (cached per process).

    Keys: ``built``, ``library``, ``build_error``, ``io_uring``, ``io_uring_reason``,
    ``memlock_bytes`` (None when unlimited). Creates and closes one tiny ring.
    """
    lib, path, error = _load()
    status: dict[str, Any] = {
        "built": lib is not None,
        "library": path if lib is not None else None,
        "build_error": error,
        "io_uring": False,
        "io_uring_reason": "unknown: the native engine is not built",
        "memlock_bytes": _memlock_bytes(),
    }
    if lib is None:
        return status
    cfg = _Config(size=ctypes.sizeof(_Config), depth=2)
    handle = _P()
    rc = lib.tba_engine_open(ctypes.byref(cfg), ctypes.byref(handle))
    if rc < 0:
        status["io_uring_reason"] = f"the engine could not start: {_name(-rc)}"
        return status
    info = _Info(size=ctypes.sizeof(_Info))
    lib.tba_engine_info(handle, ctypes.byref(info))
    lib.tba_engine_close(handle)
    status["io_uring"] = info.kind == _IO_URING
    status["io_uring_reason"] = _ring_reason(info)
    return status


def _region_of(buf: Any) -> tuple[int, int]:
    """(address, bytes) of a contiguous CPU torch tensor or a memoryview."""
    if hasattr(buf, "data_ptr"):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("tba.storage: register() needs a contiguous CPU tensor")
        return buf.data_ptr(), buf.numel() * buf.element_size()
    view = memoryview(buf)
    return _address(view), view.nbytes


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
        self._slabs.on_release(self._forget_closed_slabs)  # NOTE [Slabs] 5 in slab.py
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
    def write(self, extent: Extent, buf: memoryview, checksum: str = "off") -> Future:
        digest: Digest | None = checksum_fn(checksum)
        slab = self._check(extent, buf)
        req = _Request("write", slab.display, extent.offset, buf, digest, checksum, None, True)
        return self._engine.submit(_WRITE, self._handle(slab), buf, extent.offset, self._unit, req)

    def read(
        self, extent: Extent, buf: memoryview, checksum: str = "off", expect: int | None = None
    ) -> Future:
        digest = checksum_fn(checksum)
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
        self, op: str, kind: str, count: int = 1, errno: int = 0, nbytes: int | None = None
    ) -> None:
        """Tests: the next ``count`` attempts of ``op`` ("read", "write", "register", "files")
        go ``kind``: "short" (at most ``nbytes``, default one alignment unit, then the engine
        resubmits the rest), "fail" (with ``errno``), or "clear" (drop pending rules)."""
        if op not in _OPS or kind not in _KINDS:
            raise ValueError(f"tba.storage: inject({op!r}, {kind!r}): unknown op or kind")
        if kind == "fail" and errno <= 0:
            raise ValueError("tba.storage: inject(..., 'fail') needs errno > 0")
        value = errno if kind == "fail" else (self.alignment if nbytes is None else nbytes)
        rc = self._engine.call("tba_engine_inject", _OPS[op], _KINDS[kind], value, count)
        if rc < 0:
            raise ValueError(f"tba.storage: inject refused: {_name(-rc)}")
