"""Helpers shared by the storage tests (importable: pytest puts this directory on sys.path)."""

from __future__ import annotations

import os

from tba._memory import aligned_empty, as_memoryview

BACKENDS = ["posix", "buffered", "memory"]
FILE_BACKENDS = ["posix", "buffered"]


def filled(nbytes: int, logical: int | None = None) -> memoryview:
    """An aligned buffer of ``nbytes``: random bytes up to ``logical``, zero padding after."""
    logical = nbytes if logical is None else logical
    mv = as_memoryview(aligned_empty(nbytes))
    mv[:logical] = os.urandom(logical)
    mv[logical:] = bytes(nbytes - logical)
    return mv


def empty(nbytes: int, fill: int = 0xA5) -> memoryview:
    """An aligned buffer pre-filled with a marker, so a read that did nothing is visible."""
    mv = as_memoryview(aligned_empty(nbytes))
    mv[:] = bytes([fill]) * nbytes
    return mv
