"""Which allocator serves this process's ``malloc``: glibc's, or one that keeps the large blocks
a process frees (tcmalloc, jemalloc, mimalloc), which changes where read-back buffers should
come from (NOTE [Read buffers from the heap] in tba/host/memory.py). Asked once per process.
"""

from __future__ import annotations

import ctypes
import functools
import os

__all__ = ["CACHING_MALLOCS", "malloc_family", "malloc_library", "malloc_name"]

CACHING_MALLOCS = ("tcmalloc", "jemalloc", "mimalloc")


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def malloc_family(path: str) -> str:
    """ "tcmalloc", "jemalloc" or "mimalloc" for a library of that family (by its file name,
    e.g. libtcmalloc_minimal.so.4), else "glibc"."""
    base = os.path.basename(path)
    for name in CACHING_MALLOCS:
        if base.startswith("lib" + name):
            return name
    return "glibc"


@functools.cache
def malloc_library() -> tuple[str, str | None]:
    """The allocator behind this process's ``malloc`` and the library that defines the symbol
    the process resolves (an LD_PRELOAD, or a link): (:func:`malloc_family` of it, its path),
    or ("glibc", None) for glibc's own and when that cannot be told."""
    try:
        libc = ctypes.CDLL(None)
        addr = ctypes.cast(libc.malloc, ctypes.c_void_p)
        info = _DlInfo()
        if not libc.dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
            return "glibc", None
        path = os.fsdecode(info.dli_fname)
    except (OSError, AttributeError, ValueError):
        return "glibc", None
    name = malloc_family(path)
    return name, None if name == "glibc" else path


def malloc_name() -> str:
    """:func:`malloc_library`'s family alone."""
    return malloc_library()[0]
