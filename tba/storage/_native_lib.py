"""The native engine's C library: finding and loading it, and its ABI as ctypes declares it.

The library is native/tba_engine.c, loaded with ctypes (NOTE [Native engine] in
tba/storage/native.py); the structures and signatures below mirror native/tba_engine.h. This
module also says what the library reports about the host: :func:`engine_status`, and why
io_uring or a buffer registration was refused. Imports no torch, and starts no engine but the
tiny one :func:`engine_status` opens and closes.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import functools
import importlib.machinery
import os
import resource
from pathlib import Path
from typing import Any

from ..config import format_size
from ..errors import TBAError

_ABI = 3
_READ, _WRITE = 0, 1
_OPS = {"read": 0, "write": 1, "register": 2, "files": 3}
_KINDS = {"clear": 0, "short": 1, "fail": 2, "clock": 3}
_IO_URING, _THREADS = 1, 2
_STAGES = {
    1: "io_uring_setup",
    2: "mmap of the io_uring rings",
    3: "IORING_REGISTER_PROBE",
    4: "eventfd for the reaper",
}

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
