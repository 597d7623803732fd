"""Storage backends: where saved tensors go, and how they come back.

:func:`open_backend` turns ``Config.backend`` into a working :class:`Backend`. Every backend is
probed with a real aligned write and read before use ("auto" takes the first that passes), and
the choice and its reason are logged once per process on the ``tba.storage`` logger.
"""

from __future__ import annotations

import logging

from ..config import Config
from ..errors import ConfigError, StorageError
from .alloc import ExtentAllocator
from .base import Backend, Extent
from .buffered import BufferedBackend
from .checksum import checksum_fn
from .filebackend import SlabBackend
from .memory import MemoryBackend
from .posix import PosixBackend

__all__ = [
    "Backend",
    "BufferedBackend",
    "Extent",
    "ExtentAllocator",
    "MemoryBackend",
    "PosixBackend",
    "open_backend",
]

log = logging.getLogger("tba.storage")

_FILE_BACKENDS: dict[str, type[SlabBackend]] = {
    "posix": PosixBackend,
    "buffered": BufferedBackend,
}
_AUTO_ORDER = ("posix", "buffered")
_NOT_BUILT = ("native", "kvikio")

# (backend name, reason) pairs already logged by this process: log the choice once.
_logged: set[tuple[str, str]] = set()


_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def _announce(backend: Backend) -> None:
    key = (backend.name, backend.reason)
    if key not in _logged:
        _logged.add(key)
        log.info("tba.storage: using the %s backend (%s)", backend.name, backend.reason)
        if getattr(backend, "fs", None) in _MEMORY_FILESYSTEMS:
            log.warning(
                "tba.storage: the spill dir %s is on %s, which lives in RAM: offloading there "
                "frees no memory. Point TBA_SPILL_DIR at a local disk.",
                backend.spill_path,
                backend.fs,
            )


def _probe_failure(exc: BaseException) -> str:
    return str(exc).removeprefix("tba.storage: ")


def open_backend(cfg: Config) -> Backend:
    """The backend ``cfg.backend`` names, probed, with ``reason`` saying why it was chosen.

    "auto" tries posix (O_DIRECT), then buffered, and raises :class:`ConfigError` listing each
    probe's failure when none works. A named backend whose probe fails raises ConfigError too.
    Spill-directory problems (a symlink, no permission) raise ConfigError at once.
    """
    name = cfg.backend
    if name in _NOT_BUILT:
        raise ConfigError(
            f"TBA_BACKEND={name} is not available in this build yet. Use TBA_BACKEND=posix "
            "(O_DIRECT with a thread pool) or TBA_BACKEND=auto."
        )
    checksum_fn(cfg.checksum)  # raises ConfigError naming the missing package
    if name == "memory":
        mem = MemoryBackend(cfg)
        mem.reason = f"TBA_BACKEND=memory: {mem.reason.removeprefix('memory: ')}"
        _announce(mem)
        return mem
    backend: SlabBackend
    if name in _FILE_BACKENDS:
        try:
            backend = _FILE_BACKENDS[name](cfg)
        except (StorageError, OSError) as e:
            raise ConfigError(
                f"TBA_BACKEND={name} was requested but its probe failed: {_probe_failure(e)} "
                "Use TBA_BACKEND=auto to take the first backend that works on this filesystem, "
                "or point TBA_SPILL_DIR at a local disk."
            ) from e
        backend.reason = f"TBA_BACKEND={name}: {backend.probe_summary()}"
        _announce(backend)
        return backend
    if name != "auto":  # pragma: no cover - Config already rejects unknown names
        raise ConfigError(f"TBA_BACKEND={name!r} is not a known backend.")
    failures: list[str] = []
    for candidate in _AUTO_ORDER:
        try:
            backend = _FILE_BACKENDS[candidate](cfg)
        except (StorageError, OSError) as e:
            failures.append(f"{candidate} probe failed ({_probe_failure(e).rstrip('.')})")
            log.debug("tba.storage: %s probe failed: %s", candidate, e)
            continue
        why = "".join(f"{f}; " for f in failures)
        backend.reason = f"auto: {why}{backend.probe_summary()}"
        _announce(backend)
        return backend
    raise ConfigError(
        f"no storage backend works in {cfg.spill_dir}: "
        + "; ".join(failures)
        + ". Point TBA_SPILL_DIR at a writable local disk, or use TBA_BACKEND=memory to keep "
        "saved tensors in host memory."
    )
