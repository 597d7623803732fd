"""Reads of the machine for ``tba doctor``: optional modules, /proc and /sys files, io_uring,
capabilities, where tcmalloc is installed, and what this process made in a spill root. No rows
here."""

from __future__ import annotations

import ctypes
import errno
import importlib
import os
import platform
from typing import Any

from ..host.memory import aligned_empty, as_memoryview
from ..storage.spilldir import dir_name_pattern, host_tag

_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)


def find_tcmalloc(dirs: tuple[str, ...] = _LIB_DIRS) -> str | None:
    """The path of an installed libtcmalloc_minimal.so.4 (or libtcmalloc.so.4), if any."""
    for d in dirs:
        for lib in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            path = os.path.join(d, lib)
            if os.path.exists(path):
                return path
    return None


def _our_dirs(root: str) -> list[str]:
    """Per-process directories of this process (host and pid) in ``root``."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    pattern, host, pid = dir_name_pattern(), host_tag(), str(os.getpid())
    out = []
    for name in names:
        m = pattern.match(name)
        if m and m.group("host") == host and m.group("pid") == pid:
            out.append(os.path.join(root, name))
    return out


def _missing_components(root: str) -> list[str]:
    """The components of ``root`` that do not exist yet, shallowest first."""
    missing: list[str] = []
    path = os.path.abspath(root)
    while True:
        try:
            os.lstat(path)
            break
        except FileNotFoundError:
            missing.append(path)
        except OSError:
            break
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return list(reversed(missing))


def _aligned_roundtrip(fd: int, align: int) -> None:
    out = as_memoryview(aligned_empty(align, align))
    out[:] = os.urandom(align)
    back = as_memoryview(aligned_empty(align, align))
    n = os.pwrite(fd, out, 0)
    if n != align:
        raise OSError(errno.EIO, f"short O_DIRECT write: {n} of {align} bytes")
    n = os.preadv(fd, [back], 0)
    if n != align:
        raise OSError(errno.EIO, f"short O_DIRECT read: {n} of {align} bytes")
    if back != out:
        raise OSError(errno.EIO, "O_DIRECT read returned other bytes than were written")


def _optional_status(module: str, func: str) -> tuple[dict[str, Any] | None, str | None]:
    """``module.func()``, or (None, why) when the module is missing or the call fails."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:  # also when sys.modules[module] is None
            return None, f"not in this install ({module} is missing)"
        return None, f"{module} cannot be imported: {e}"
    except ImportError as e:
        return None, f"{module} cannot be imported: {e}"
    except Exception as e:  # a broken optional module must not stop the doctor
        return None, f"{module} failed to import: {type(e).__name__}: {e}"
    fn = getattr(mod, func, None)
    if fn is None:
        return None, f"{module} has no {func}()"
    try:
        status = fn()
    except Exception as e:
        return None, f"{module}.{func}() failed: {type(e).__name__}: {e}"
    if not isinstance(status, dict):
        return None, f"{module}.{func}() returned {type(status).__name__}, not a dict"
    return status, None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


# io_uring_setup is 425 on x86_64 and in the generic table (arm64, riscv64, ...).
_IO_URING_SETUP = {"x86_64": 425, "aarch64": 425, "arm64": 425, "riscv64": 425, "ppc64le": 425}


def _probe_io_uring() -> tuple[bool | None, str]:
    """Create and close a 1-entry io_uring: (True, ...) works, (False, why) refused."""
    nr = _IO_URING_SETUP.get(platform.machine())
    if nr is None:
        return None, f"no io_uring probe for {platform.machine()}"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError as e:  # pragma: no cover
        return None, f"libc: {e}"
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    libc.syscall.restype = ctypes.c_long
    fd = libc.syscall(ctypes.c_long(nr), ctypes.c_long(1), params)
    if fd >= 0:
        os.close(fd)
        return True, "io_uring_setup works"
    code = ctypes.get_errno()
    name = errno.errorcode.get(code, str(code))
    return False, f"io_uring_setup failed: {name} ({os.strerror(code)})"


def _has_cap_ipc_lock() -> bool:
    """CAP_IPC_LOCK in the effective set, in the initial user namespace (what io_uring checks)."""
    try:
        with open("/proc/self/status") as f:
            caps = next((ln for ln in f if ln.startswith("CapEff:")), "")
        with open("/proc/self/uid_map") as f:
            uid_map = f.read().split()
    except OSError:
        return False
    if uid_map[:3] != ["0", "0", "4294967295"]:
        return False  # in a user namespace: its capabilities do not count for the initial one
    try:
        return bool(int(caps.split()[1], 16) >> 14 & 1)
    except (IndexError, ValueError):
        return False
