"""tba: offload the activations PyTorch saves for backward to local SSD, and prefetch them back.

    import tba
    off = tba.Offloader(tba.Config(spill_dir="/nvme/tba"))
    with off.step(model):
        loss = model(batch)
    loss.backward()
    print(off.stats())

or, configured from ``TBA_*`` variables only: ``with tba.offload(model): ...``.

``Offloader`` and ``PINNED_KEYS`` (and torch with them) are imported on first use, so that
torch-free parts (``tba sidecar``, ``tba.metrics``, ``tba.config``) start without torch.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from typing import TYPE_CHECKING, Any

from . import metrics  # tba.metrics.registry(), METRICS: docs/observability.md
from .config import Config
from .errors import (
    CapacityError,
    ConfigError,
    StorageError,
    TBAError,
    UnpackError,
    UsageError,
)

if TYPE_CHECKING:
    from .datapath.blocks.groups import compile_blocks
    from .datapath.offloader import Offloader
    from .records.step import PINNED_KEYS

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "CapacityError",
    "Offloader",
    "PINNED_KEYS",
    "StorageError",
    "TBAError",
    "UnpackError",
    "UsageError",
    "compile_blocks",
    "default_offloader",
    "metrics",
    "offload",
]

_default: Offloader | None = None
_default_lock = threading.Lock()


def __getattr__(name: str) -> Any:
    if name == "Offloader":
        from .datapath.offloader import Offloader as value
    elif name == "compile_blocks":
        from .datapath.blocks.groups import compile_blocks as value
    elif name == "PINNED_KEYS":
        from .records.step import PINNED_KEYS as value
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def default_offloader() -> Offloader:
    """The process-wide Offloader, built from the environment on first use."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            from .datapath.offloader import Offloader

            _default = Offloader(Config())
            atexit.register(_default.close)
        return _default


def offload(model: Any = None) -> contextlib.AbstractContextManager:
    """``with tba.offload(model): loss = model(x)``: the process-wide Offloader's step.

    With ``TBA_ENABLED=0`` it does nothing and creates nothing.
    """
    if not Config().enabled:
        return contextlib.nullcontext()
    return default_offloader().step(model)
