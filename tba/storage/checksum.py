"""Checksums over spill buffers, verified on every read.

``auto`` (the default) takes the fastest one installed: xxh3 (the xxhash package, a dependency
of tba: about 8 GiB/s on one core of a small VM), else crc32c when google-crc32c has its C
extension, else crc32 (zlib, always there, about 1 GiB/s). ``off`` turns checksums off.

A digest may cover only part of a buffer (``span``): a direct capture writes whole pages around
a tensor, and only the tensor's own bytes are guarded by its version check (NOTE [Direct
capture] rule 3 in tba/datapath/capture/staging.py), so only they are checksummed.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable

from ..errors import ConfigError

__all__ = ["Digest", "checksum_fn", "digest_for", "mismatch_hint", "resolve"]

Digest = Callable[[memoryview], int]

_CHUNK = 4 << 20
_PACKAGES = {"crc32c": "google-crc32c", "xxh64": "xxhash", "xxh3": "xxhash"}
_AUTO_ORDER = ("xxh3", "crc32c", "crc32")


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


def _xxh3() -> Digest:
    import xxhash

    return lambda buf: xxhash.xxh3_64_intdigest(buf)


_LOADERS: dict[str, Callable[[], Digest]] = {
    "crc32": lambda: zlib.crc32,  # releases the GIL on large buffers
    "crc32c": _crc32c,
    "xxh64": _xxh64,
    "xxh3": _xxh3,
}


def _fast_crc32c() -> bool:
    try:
        import google_crc32c
    except ImportError:
        return False
    return getattr(google_crc32c, "implementation", "") == "c"


@functools.cache
def resolve(name: str) -> str:
    """The checksum ``name`` stands for: ``auto`` becomes the fastest one installed."""
    if name != "auto":
        return name
    for candidate in _AUTO_ORDER:
        if candidate == "crc32c" and not _fast_crc32c():
            continue
        try:
            _LOADERS[candidate]()
        except ImportError:
            continue
        return candidate
    return "crc32"  # pragma: no cover - zlib is always there


@functools.cache
def checksum_fn(name: str) -> Digest | None:
    """The digest function for ``name`` (``auto`` resolved), or ``None`` for "off".

    Raises :class:`ConfigError` for an unknown name, or when the package it needs is missing.
    """
    name = resolve(name)
    if name == "off":
        return None
    loader = _LOADERS.get(name)
    if loader is None:
        raise ConfigError(
            f"TBA_CHECKSUM={name!r} is not a known checksum; expected one of "
            "auto|off|xxh3|crc32|crc32c|xxh64."
        )
    try:
        return loader()
    except ImportError:
        pkg = _PACKAGES[name]
        raise ConfigError(
            f"TBA_CHECKSUM={name} needs the {pkg} package, which is not installed. Run "
            f"`pip install {pkg}`, or use TBA_CHECKSUM=crc32, which needs nothing extra (or "
            "auto, which takes the fastest one installed)."
        ) from None


def digest_for(name: str, span: tuple[int, int] | None = None) -> Digest | None:
    """The digest for a transfer: over the whole buffer, or over ``buf[start:stop]``."""
    digest = checksum_fn(name)
    if digest is None or span is None:
        return digest
    start, stop = span
    return lambda buf: digest(buf[start:stop])


DEVICE_CAUSE = (
    "The spilled bytes were corrupted on the way to or from the device; check dmesg and the "
    "drive's health."
)


def mismatch_hint(name: str, expect: int, got: int, cause: str = DEVICE_CAUSE) -> str:
    """The explanation a StorageError(EBADMSG) carries when a read fails its checksum."""
    return f"Checksum {resolve(name)} mismatch: expected {expect:#x}, got {got:#x}. {cause}"
