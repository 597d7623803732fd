"""Checksums over spill buffers: crc32 (zlib, always there), crc32c and xxh64 (optional)."""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable

from ..errors import ConfigError

__all__ = ["Digest", "checksum_fn"]

Digest = Callable[[memoryview], int]

_CHUNK = 4 << 20
_PACKAGES = {"crc32c": "google-crc32c", "xxh64": "xxhash"}


def _crc32c() -> Digest:
    import google_crc32c

    # Its C extension accepts only ``bytes``-like objects without a release hook, so not a
    # memoryview: copy in 4 MiB chunks (it releases the GIL from 1 MiB up).
    def digest(buf: memoryview) -> int:
        crc = 0
        for i in range(0, len(buf), _CHUNK):
            crc = google_crc32c.extend(crc, bytes(buf[i : i + _CHUNK]))
        return crc

    return digest


def _xxh64() -> Digest:
    import xxhash

    return lambda buf: xxhash.xxh64_intdigest(buf)


_LOADERS: dict[str, Callable[[], Digest]] = {
    "crc32": lambda: zlib.crc32,  # releases the GIL on large buffers
    "crc32c": _crc32c,
    "xxh64": _xxh64,
}


@functools.cache
def checksum_fn(name: str) -> Digest | None:
    """The digest function for ``name``, or ``None`` for "off".

    Raises :class:`ConfigError` for an unknown name, or when the package it needs is missing.
    """
    if name == "off":
        return None
    loader = _LOADERS.get(name)
    if loader is None:
        raise ConfigError(
            f"TBA_CHECKSUM={name!r} is not a known checksum; expected one of "
            "off|crc32|crc32c|xxh64."
        )
    try:
        return loader()
    except ImportError:
        pkg = _PACKAGES[name]
        raise ConfigError(
            f"TBA_CHECKSUM={name} needs the {pkg} package, which is not installed. Run "
            f"`pip install {pkg}`, or use TBA_CHECKSUM=crc32, which needs nothing extra."
        ) from None
