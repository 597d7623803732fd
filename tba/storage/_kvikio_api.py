"""kvikio as each release presents itself: importing it, what it says about itself, its settings
and the errno behind its errors. No torch, and no I/O: the probe is the backend's
(tba/storage/kvikio.py, whose NOTE [kvikio] these helpers follow).

:func:`kvikio_status` is for ``tba doctor`` and backend selection; the rest serves
:class:`tba.storage.kvikio.KvikioBackend`.
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("tba.storage")

_INSTALL = "pip install 'tba[gds]'"
# Parts of kvikio's messages for failed calls: only these end in a strerror text.
_SYSCALL_MESSAGES = (
    "POSIX error",
    "system/library function call error",
    "cuFile error",
    "Unable to write file",
)
_STRERRORS = sorted(
    ((os.strerror(code), code) for code in errno.errorcode if code > 0),
    key=lambda pair: -len(pair[0]),
)


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
_OLD_GETTERS = {
    "num_threads": ("get_num_threads", "num_threads"),
    "task_size": ("task_size",),
    "gds_threshold": ("gds_threshold",),
}


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
    """Set kvikio's thread count and task size; (threads read back, how), see NOTE [kvikio] 4."""
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


_DIRECT_IO = ("auto_direct_io_read", "auto_direct_io_write")


def _direct_host_io(defaults: Any, who: str) -> tuple[bool, str]:
    """Turn on kvikio's O_DIRECT for host buffers (NOTE [kvikio] 3); (on, what was done).

    kvikio 26.02 and later read host buffers through the page cache unless
    ``auto_direct_io_read`` is on (``auto_direct_io_write`` is on by default). Both are
    process-wide and are read when a CuFile opens, so this runs before the first one.
    """
    get = getattr(defaults, "get", None)
    setter = getattr(defaults, "set", None)
    if not (callable(get) and callable(setter)):
        return False, f"host I/O buffered ({who} has no auto_direct_io_read)"
    try:
        get(_DIRECT_IO[0])
    except Exception:
        return False, f"host I/O buffered ({who} has no auto_direct_io_read)"
    try:
        setter({name: True for name in _DIRECT_IO})
        on = all(bool(get(name)) for name in _DIRECT_IO)
    except Exception as e:
        log.warning("tba.storage: could not turn on kvikio's direct I/O: %s", _describe(e))
        return False, f"host I/O buffered (setting auto_direct_io_* failed: {_describe(e)})"
    if not on:
        return False, "host I/O buffered (kvikio kept auto_direct_io_* off)"
    return True, "host I/O through O_DIRECT (auto_direct_io_read/write)"


GDS_THRESHOLD = 16 << 10  # kvikio's default gds_threshold since 23.x


def _gds_threshold(defaults: Any) -> int:
    """The size under which kvikio sends a device buffer through POSIX instead of cuFile."""
    got = _read_setting(defaults, "gds_threshold") if defaults is not None else None
    return got if got is not None and got > 0 else GDS_THRESHOLD


# -- errors -----------------------------------------------------------------------------------
# kvikio's texts (26.10, cpp/include/kvikio/error.hpp and detail/posix_io.hpp) start with where
# it threw ("KvikIO failure at: <file>:<line>: ", "cuFile error at: ...") and end with the
# strerror text of the failed call: "POSIX error on pwrite: No space left on device",
# "Linux system/library function call error at: ...: No such file or directory", "Unable to
# write file: ..." (cuFileWrite's -1 and errno). Two texts say something else than they read:
_EBADF_TEXT = "POSIX error: Operation not permitted"  # kvikio's own words for EBADF
_EOF_TEXT = "POSIX error on pread: EOF"
# "cuFile error at: ...: Operation not permitted" is strerror(1) of cuFileRead's -1, whose errno
# kvikio drops: no errno at all, not EPERM.
_CUFILE_TEXT = "cuFile error"


def _is_eof(exc: BaseException) -> bool:
    """kvikio's POSIX read hit the end of the file (a slab shorter than the extent)."""
    try:
        return _EOF_TEXT in str(exc)
    except Exception:
        return False


def _errno_of(exc: BaseException) -> int:
    """The errno behind a kvikio failure, EIO when it gives none (NOTE [kvikio] 2)."""
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and code > 0:
        return code
    try:
        text = str(exc).strip()
    except Exception:
        return errno.EIO
    if _EBADF_TEXT in text:
        return errno.EBADF
    if not any(marker in text for marker in _SYSCALL_MESSAGES):
        return errno.EIO
    for message, value in _STRERRORS:
        if text.endswith(message):
            if value == errno.EPERM and _CUFILE_TEXT in text:
                return errno.EIO
            return value
    return errno.EIO
