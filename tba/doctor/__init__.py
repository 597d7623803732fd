"""``tba doctor``: check a node before a training run, and say which ``TBA_*`` settings fit it.

NOTE [Doctor]
1. Every check is one row: a key, a status and a one-line detail. The status is ``ok``,
   ``warn``, ``FAIL``, or ``skip`` (not run because a check it depends on failed). Any FAIL means
   the spill dir is unusable and the exit code is 1; warnings alone leave it at 0.
2. It writes only inside the spill dir, through the same code tba uses: per-process directories
   made by :class:`SpillDir` (removed on close), nameless files (``O_TMPFILE``, or unlinked at
   once), and the components of the root that did not exist before the run, which are removed
   at the end when still empty. The ``cleanup`` row checks that nothing is left, also after a
   probe that failed midway.
3. Throughput goes through the backend tba would use (``auto``'s pick, or the one named), on
   16 MiB extents of one preallocated slab with several requests in flight: one write pass
   (first writes into preallocated space, as in the first training step), then read passes with
   1, 2, 4 and 8 requests in flight. Under O_DIRECT every read comes from the device. Each 4 KiB
   block carries a tag (run, extent, block) that the reads check, so a misplaced or stale block
   fails the probe, and no two blocks are identical (a deduplicating device cannot cheat).
4. The native engine (``tba.storage.native``) and kvikio (``tba.storage.kvikio``) are optional
   modules, imported lazily; a missing module is reported, never raised.
5. The recommendations are rules of thumb, each stated next to its code in
   :func:`tba.doctor.recommend.recommend` and printed with its reason. The doctor measures one
   node at one moment.
6. The checks read the machine through :class:`tba.doctor.state.Probes`, and the environment
   only through :func:`tba.config.environment` (config.py is tba's only reader of it).

Modules: ``report`` (rows, advice, the report), ``state`` (one run's state), ``probes`` (reads
of the machine), ``host``, ``disk`` and ``throughput`` (the checks), ``recommend``, ``render``.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

from ..config import Config, environment, format_size
from ..errors import ConfigError
from ..storage.statx import fs_type
from .disk import check_filesystem, check_o_direct, check_spill_dir, cleanup
from .host import (
    check_config,
    check_host_malloc,
    check_kvikio_and_cuda,
    check_memlock,
    check_native_and_io_uring,
)

# The probes are looked up in this namespace at each run (_probes), so a test may substitute
# one here; the rows and the rules' arithmetic are re-exported for tests and tools.
from .probes import _has_cap_ipc_lock as _has_cap_ipc_lock
from .probes import _missing_components, _our_dirs
from .probes import _probe_io_uring as _probe_io_uring
from .probes import _read_int as _read_int
from .probes import find_tcmalloc as find_tcmalloc
from .recommend import PREFETCH_CAP as PREFETCH_CAP
from .recommend import QUOTA_SHARE as QUOTA_SHARE
from .recommend import SATURATION as SATURATION
from .recommend import _env_size as _env_size
from .recommend import in_flight_for as in_flight_for
from .recommend import prefetch_for as prefetch_for
from .recommend import quota_for as quota_for
from .recommend import recommend
from .render import TABLE_WIDTH as TABLE_WIDTH
from .render import render_json, render_table
from .report import DEFAULT_PROBE_BYTES, MIN_PROBE_BYTES, Check, Recommendation, Report
from .report import ROWS as ROWS
from .report import STATUSES as STATUSES
from .state import Probes, Run
from .throughput import check_backend, measure

__all__ = [
    "DEFAULT_PROBE_BYTES",
    "Check",
    "Recommendation",
    "Report",
    "run",
    "render_json",
    "render_table",
]


def run(
    spill_dir: str | None = None,
    probe_bytes: int = DEFAULT_PROBE_BYTES,
    backend: str | None = None,
    environ: dict[str, str] | None = None,
) -> Report:
    """Run every check. Raises :class:`ConfigError` for bad settings (arguments or TBA_*).

    ``environ`` stands for the environment (default: :func:`tba.config.environment`)."""
    t0 = time.perf_counter()
    env = environment() if environ is None else dict(environ)
    if probe_bytes < MIN_PROBE_BYTES:
        raise ConfigError(f"--probe-bytes must be at least {format_size(MIN_PROBE_BYTES)}")
    kw: dict[str, Any] = {}
    if spill_dir is not None:
        kw["spill_dir"] = spill_dir
    if backend is not None:
        kw["backend"] = backend
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = Config(environ=env, **kw)
    d = Run(cfg, probe_bytes, env, _probes())
    storage_log = logging.getLogger("tba.storage")
    level = storage_log.level
    storage_log.setLevel(logging.ERROR)  # the rows say it all; no duplicate log lines
    try:
        _check(d)
    finally:
        storage_log.setLevel(level)
    for w in caught:
        c = d.checks["config"]
        d.set("config", "warn", f"{c.detail}; {str(w.message).removeprefix('tba.config: ')}")
    rep = Report(d.checks, d.facts, [], 0.0)
    rep.recommendations = recommend(d)
    rep.elapsed = time.perf_counter() - t0
    return rep


def _probes() -> Probes:
    # Looked up in this module's namespace at each run, so that a test can substitute one.
    return Probes(fs_type, _read_int, _probe_io_uring, _has_cap_ipc_lock, find_tcmalloc)


def _check(d: Run) -> None:
    """Every check, in order; a check that the ones before it make pointless is skipped."""
    check_config(d)
    check_native_and_io_uring(d)
    check_kvikio_and_cuda(d)
    check_memlock(d)
    check_host_malloc(d)
    root = d.cfg.spill_dir
    d.created = _missing_components(root)
    d.facts["spill_dir"]["created_root"] = bool(d.created)
    d.ours_before = set(_our_dirs(root))
    try:
        sd = check_spill_dir(d)
        if sd is not None:
            try:
                room = check_filesystem(d)
                check_o_direct(d, sd)
            finally:
                sd.close()
            backend = check_backend(d)
            if backend is not None:
                try:
                    if room:
                        measure(d, backend)
                    else:
                        d.set("write", "skip", "not enough free space for the probe")
                        d.set("read", "skip", "not enough free space for the probe")
                finally:
                    backend.close()
    finally:
        cleanup(d)
