"""Helpers shared by the storage tests (importable: pytest puts this directory on sys.path)."""

from __future__ import annotations

import os

from tba.host.memory import aligned_empty, as_memoryview
from tba.storage.native import engine_status

_NATIVE = ["native"] if engine_status()["built"] else []
# Every backend available here (kvikio needs a GPU; tests/storage/test_kvikio.py fakes it).
BACKENDS = ["posix", "buffered", *_NATIVE, "memory"]
# Those with slab files in a spill directory.
SLAB_BACKENDS = ["posix", "buffered", *_NATIVE]
# Those whose syscalls are Python attributes (``_pwrite``...) a test can replace; the native
# engine has its own injection hook (tests/storage/test_native.py).
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


def assert_round_trip(backend, nbytes: int) -> None:
    """Write ``nbytes`` of random bytes to a fresh extent and read back the same bytes."""
    ext = backend.allocate(nbytes)
    data = filled(ext.length)
    backend.write(ext, data).result()
    back = empty(ext.length)
    backend.read(ext, back).result()
    assert back == data
    backend.free(ext)
