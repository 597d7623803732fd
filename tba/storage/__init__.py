"""Storage backends: where saved tensors go, and how they come back.

:func:`open_backend` turns ``Config.backend`` into a working :class:`Backend`. Every backend is
probed with a real aligned write and read before use ("auto" takes the first that passes), and
the choice and its reason are logged once per process on the ``tba.storage`` logger.

The backend classes (and torch, which their buffers use) are imported on first use, so that
torch-free parts such as ``tba.storage.spilldir`` (the sidecar's) do not load torch.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from ..config import Config
from ..errors import ConfigError, StorageError
from .alloc import ExtentAllocator
from .base import Backend, Extent
from .checksum import checksum_fn

if TYPE_CHECKING:
    from .buffered import BufferedBackend
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

_LAZY = {  # name -> module that defines it (PEP 562 __getattr__ below)
    "BufferedBackend": ".buffered",
    "MemoryBackend": ".memory",
    "PosixBackend": ".posix",
    "SlabBackend": ".filebackend",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


# "auto" tries these in order; kvikio only for a CUDA host with GDS, native only with a ring.
_AUTO_ORDER = ("kvikio", "native", "posix", "buffered")

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


def _construct(name: str, cfg: Config, auto: bool) -> SlabBackend:
    """Build and probe backend ``name``; raises OSError/StorageError (or a subclass) if unusable."""
    if name == "native":
        from .native import NativeBackend

        # Under "auto" the native engine must have a working io_uring: its thread-pool mode
        # brings nothing over posix, so auto falls back to posix instead (and says why).
        return NativeBackend(cfg, require_ring=auto)
    if name == "kvikio":
        from .kvikio import KvikioBackend

        return KvikioBackend(cfg)
    if name == "posix":
        from .posix import PosixBackend

        return PosixBackend(cfg)
    from .buffered import BufferedBackend

    return BufferedBackend(cfg)


_NO_CUDA = "no CUDA device"


def _kvikio_skip() -> str | None:
    """Why "auto" does not even try kvikio here (no CUDA, no kvikio, no GDS), else None."""
    import torch

    if not torch.cuda.is_available():
        return _NO_CUDA
    from .kvikio import kvikio_status

    st = kvikio_status()
    if not st["importable"] or not st["gds_available"]:
        return st["reason"]
    return None


def open_backend(cfg: Config) -> Backend:
    """The backend ``cfg.backend`` names, probed, with ``reason`` saying why it was chosen.

    "auto" tries kvikio (CUDA host with GPUDirect Storage), the native io_uring engine, posix
    (O_DIRECT threads), then buffered, and raises :class:`ConfigError` listing each probe's
    failure when none works. A named backend whose probe fails raises ConfigError with the
    probe's reason. Spill-directory problems (a symlink, no permission) raise ConfigError at once.
    """
    name = cfg.backend
    checksum_fn(cfg.checksum)  # raises ConfigError naming the missing package
    if name == "memory":
        from .memory import MemoryBackend

        mem = MemoryBackend(cfg)
        mem.reason = f"TBA_BACKEND=memory: {mem.reason.removeprefix('memory: ')}"
        _announce(mem)
        return mem
    backend: SlabBackend
    if name != "auto":
        try:
            backend = _construct(name, cfg, auto=False)
        except (StorageError, OSError) as e:
            raise ConfigError(
                f"TBA_BACKEND={name} was requested but its probe failed: {_probe_failure(e)} "
                "Use TBA_BACKEND=auto to take the first backend that works on this host, "
                "or point TBA_SPILL_DIR at a local disk."
            ) from e
        backend.reason = f"TBA_BACKEND={name}: {backend.probe_summary()}"
        _announce(backend)
        return backend
    failures: list[str] = []
    for candidate in _AUTO_ORDER:
        if candidate == "kvikio":
            skip = _kvikio_skip()
            if skip == _NO_CUDA:
                continue  # the common case on a CPU host: not worth a word
            if skip:
                failures.append(f"kvikio skipped ({skip.rstrip('.')})")
                continue
        try:
            backend = _construct(candidate, cfg, auto=True)
        except (StorageError, OSError) as e:
            failures.append(f"{candidate} probe failed ({_probe_failure(e).rstrip('.')})")
            log.debug("tba.storage: %s probe failed: %s", candidate, e)
            continue
        why = "".join(f"{f}; " for f in failures)
        backend.reason = f"auto: {why}{backend.probe_summary()}"
        native = [f for f in failures if f.startswith("native")]
        if native and ("native-fallback", native[0]) not in _logged:
            _logged.add(("native-fallback", native[0]))
            log.warning("tba.storage: %s; using the %s backend instead", native[0], backend.name)
        _announce(backend)
        return backend
    raise ConfigError(
        f"no storage backend works in {cfg.spill_dir}: "
        + "; ".join(failures)
        + ". Point TBA_SPILL_DIR at a writable local disk, or use TBA_BACKEND=memory to keep "
        "saved tensors in host memory."
    )
