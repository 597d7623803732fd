"""The state of one ``tba doctor`` run: its settings, its rows and facts, what it made on disk,
and the probes it reads the machine with; plus how failures become row text."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from ..config import Config
from ..errors import ConfigError
from ..host.memory import align_up
from .report import EXTENT_BYTES, ROWS, STATUSES, Check

_NO_VALUE: Any = object()  # "the engine did not say" (None means unlimited)


@dataclasses.dataclass(frozen=True)
class Probes:
    """The reads of the machine that the checks make through this object, so that a test can
    substitute one (tba/doctor/__init__.py builds it from the package's names at each run)."""

    fs_type: Callable[[str], str]
    read_int: Callable[[str], int | None]
    probe_io_uring: Callable[[], tuple[bool | None, str]]
    has_cap_ipc_lock: Callable[[], bool]
    find_tcmalloc: Callable[[], str | None]


class Run:
    """One run: fills the rows and the facts; see :func:`tba.doctor.run`."""

    def __init__(self, cfg: Config, probe_bytes: int, variables: dict[str, str], probes: Probes):
        self.cfg = cfg
        self.probes = probes
        self.probe_bytes = probe_bytes
        self.variables = variables  # the environment as tba.config.environment() gives it
        self.checks = {k: Check(k, label, "skip", "not run") for k, label in ROWS}
        self.facts: dict[str, Any] = {
            "probe_bytes": probe_bytes,
            "spill_dir": {
                "root": cfg.spill_dir,
                "source": cfg.sources["spill_dir"],
                "created_root": False,
                "fs_type": None,
                "device": None,
                "mount_point": None,
                "free_bytes": None,
                "total_bytes": None,
            },
            "o_direct": {
                "works": None,
                "error": None,
                "dio_mem_align": None,
                "dio_offset_align": None,
                "alignment": None,
            },
            "io_uring": {"available": None, "reason": None, "source": None, "sysctl": None},
            "native": {
                "module": False,
                "error": None,
                "built": None,
                "library": None,
                "build_error": None,
            },
            "memlock": {
                "limit_bytes": None,
                "unlimited": False,
                "cap_ipc_lock": False,
                "needed_bytes": cfg.staging_bytes,
            },
            "kvikio": {
                "module": False,
                "error": None,
                "importable": None,
                "version": None,
                "gds_available": None,
                "compat_mode": None,
                "reason": None,
            },
            "cuda": {
                "torch": None,
                "built": False,
                "available": False,
                "device_count": 0,
                "devices": [],
            },
            "backend": {
                "requested": cfg.backend,
                "auto": None,
                "auto_reason": None,
                "name": None,
                "reason": None,
                "alignment": None,
                "error": None,
            },
            "throughput": {
                "bytes": None,
                "extent_bytes": None,
                "extents": None,
                "in_flight": None,
                "write_gib_s": None,
                "write_seconds": None,
                "read_gib_s": None,
                "read_seconds": None,
                "read_sweep_gib_s": {},
                "error": None,
            },
            "cleanup": {"clean": None, "leftovers": [], "removed": []},
            "host_malloc": {"malloc": None, "library": None, "suggested": None},
        }
        self.made_dirs: list[str] = []  # per-process directories this run made
        self.created: list[str] = []  # root components that did not exist, shallowest first
        self.ours_before: set[str] = set()  # this pid's directories already there (Offloaders)
        self.memlock_from_engine: Any = _NO_VALUE

    def set(self, key: str, status: str, detail: str) -> None:
        assert status in STATUSES, status
        c = self.checks[key]
        c.status, c.detail = status, detail

    def probe_total(self, align: int = 4096) -> int:
        extent = min(EXTENT_BYTES, align_up(self.probe_bytes, align))
        return math.ceil(self.probe_bytes / extent) * extent


# -- helpers -----------------------------------------------------------------------------------
class _ProbeFailed(Exception):
    pass


def _strip(e: BaseException) -> str:
    return _strip_prefix(str(e))


def _why(e: BaseException) -> str:
    """A failure as text: our own errors speak for themselves; others are named."""
    if isinstance(e, (ConfigError, OSError, _ProbeFailed)):
        return _strip(e)
    return f"{type(e).__name__}: {e}"


def _strip_prefix(text: str) -> str:
    for p in ("tba.config: ", "tba.storage: "):
        text = text.removeprefix(p)
    return text.replace("TBA_SPILL_DIR: ", "")
