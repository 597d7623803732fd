"""The sidecar's settings and their checks. Bad settings raise :class:`SidecarError` naming the
setting, what is wrong and the fix; ``tba sidecar`` turns them into exit code 2."""

from __future__ import annotations

import dataclasses
import errno
import os
import stat

from ..errors import TBAError

__all__ = ["DEFAULT_PORT", "Settings", "SidecarError", "check_metrics_dir"]

# Not registered anywhere; next to the exporters' 9100-9999 range (docs/observability.md).
DEFAULT_PORT = 9477


class SidecarError(TBAError, ValueError):
    """A sidecar setting is unusable (missing metrics dir, port in use, ...)."""

    def __init__(self, text: str):
        super().__init__(f"tba.sidecar: {text}")


@dataclasses.dataclass(frozen=True)
class Settings:
    metrics_dir: str
    spill_roots: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    interval: float = 10.0  # seconds between scans (and janitor passes)
    ssd_tbw: float | None = None  # rated terabytes written, per drive
    rate_window: float = 3600.0  # seconds of samples behind the write rates
    janitor: bool = True
    shutdown_grace: float = 10.0  # seconds requests in flight get at SIGTERM

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics_dir", os.path.abspath(self.metrics_dir))
        roots = tuple(dict.fromkeys(os.path.abspath(r) for r in self.spill_roots))
        object.__setattr__(self, "spill_roots", roots)


def check_metrics_dir(path: str, writable: bool) -> None:
    """Raise :class:`SidecarError` unless ``path`` is a real, readable (and, for the janitor,
    writable) directory."""
    fix = (
        "Create it (mkdir -p) and point both the training processes' TBA_METRICS_DIR and the "
        "sidecar's --metrics-dir at it."
    )
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise SidecarError(f"metrics dir {path} does not exist. {fix}") from None
    except OSError as e:
        raise SidecarError(f"cannot inspect metrics dir {path}: {os.strerror(e.errno)}.") from None
    if stat.S_ISLNK(st.st_mode):
        raise SidecarError(
            f"metrics dir {path} is a symbolic link (to {os.readlink(path)}); the sidecar does "
            "not follow symlinks. Pass the real directory (realpath) instead."
        )
    if not stat.S_ISDIR(st.st_mode):
        raise SidecarError(f"metrics dir {path} is not a directory. {fix}")
    need = os.R_OK | os.X_OK | (os.W_OK if writable else 0)
    if not os.access(path, need):
        what = "readable"
        if writable:
            what = "readable and writable (the janitor removes dead ranks' files)"
        raise SidecarError(
            f"metrics dir {path} is not {what} by uid {os.geteuid()}: "
            f"{os.strerror(errno.EACCES)}. Run the sidecar as the training processes' user, "
            "or fix the directory's permissions" + (", or pass --no-janitor." if writable else ".")
        )
