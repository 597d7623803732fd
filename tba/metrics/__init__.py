"""Prometheus metrics of each rank, for `tba sidecar` or the application's own exporter.

    TBA_METRICS_DIR=/run/tba-metrics   # each rank writes its files here; the sidecar serves them

    from prometheus_client import start_http_server
    start_http_server(9100, registry=tba.metrics.registry())   # or: this process only

NOTE [Metrics]
1. Names and labels are pinned (dashboards and the sidecar use them; see :data:`METRICS`).
   Every series carries ``rank`` (Config.rank).
2. Nothing runs per tensor. The counters are the sums of the per-step counters of
   tba/records/step.py, published as deltas when a step starts, when its forward ends, on
   ``stats()`` and on ``close()``. A step keeps counting during its backward (reloads, stalls), even
   after later steps started (gradient accumulation), but only through its live entries and its
   writes: the Offloader tracks each step until none of its entries is alive and every one is
   counted (``unsettled``, NOTE [Counted once] in tba/records/reasons.py), so the totals equal the
   sums of ``stats()`` exactly. Per I/O (not per tensor), one list append, read by the next publish:
   ``tba_io_seconds`` and the device byte counter. Per failed entry, like
   ``stats()["io_errors"]``: ``tba_io_errors_total``. The gauges are sampled at the same
   moments as the counters are published.
3. Values live in a process-wide store per metrics directory (all Offloaders of the process add
   to it). With ``TBA_METRICS_DIR`` the store also writes prometheus_client's multiprocess
   files, ``counter_<pid>.db``, ``histogram_<pid>.db``, ``gauge_livesum_<pid>.db`` and
   ``gauge_livemax_<pid>.db``, with the library's own ``MmapedDict`` and ``mmap_key``, so that
   ``MultiProcessCollector(registry, path=dir)`` in another process reads them. tba creates no
   prometheus_client metric objects: their multiprocess mode is chosen from
   PROMETHEUS_MULTIPROC_DIR at import time, which tba neither needs nor changes, so a user's
   own metrics in the same process are unaffected.
4. Gauges are ``live*``: ``livesum`` for the byte gauges (summed over the Offloaders of a
   process), ``livemax`` for ``tba_keep_last`` and ``tba_backend_info``. The collector drops
   their pid label, so there is one series per rank, and ``mark_process_dead(pid, dir)`` (the
   sidecar's janitor) removes a dead process's gauges. Counter and histogram files stay, so a
   dead process's counts stay in the sums. ``close()`` withdraws the Offloader's gauge values
   (to 0 when it was the last) and leaves every file in place.
5. Without ``TBA_METRICS_DIR`` the store stays in memory; :func:`registry` exposes it.

The metric definitions are in tba/metrics/defs.py; the store, its files and :func:`registry` in
tba/metrics/store.py. This module is what an Offloader uses: :class:`RankMetrics`, which
follows its steps and pushes deltas to the store.
"""

from __future__ import annotations

import bisect
import errno as _errno
import itertools
from collections import Counter
from typing import TYPE_CHECKING, Any

from .defs import _BOUNDS, _STEP_FIELDS, IO_SECONDS_BUCKETS, KEPT_REASONS, METRICS, _les
from .store import _store_for, registry

if TYPE_CHECKING:
    from ..config import Config
    from ..records.step import StepState

__all__ = [
    "IO_SECONDS_BUCKETS",
    "KEPT_REASONS",
    "METRICS",
    "RankMetrics",
    "registry",
    "spill_device",
]


# -- the block device of a spill dir --------------------------------------------------------
def spill_device(path: str) -> str:
    """The block device holding ``path`` as /sys/block names it ("nvme0n1", "vda", "dm-0"): a
    partition gives its disk. "unknown" when there is none (tmpfs, a network filesystem, a
    path that does not exist). The sidecar joins its endurance figures on this label, with the
    same rule: NOTE [Block device of a path] in tba/storage/blockdev.py."""
    from ..storage.blockdev import block_device  # here: `import tba` loads no storage module

    return block_device(path).label


_owners = itertools.count()  # who set a gauge value, per RankMetrics


# -- per Offloader --------------------------------------------------------------------------
class RankMetrics:
    """The metrics of one Offloader: tracks its steps and pushes deltas to the store.

    Every method is called with the Offloader's lock held (NOTE [Metrics] 2).
    """

    def __init__(self, config: Config, backend: Any):
        self.store = _store_for(config.metrics_dir)
        self.rank = str(config.rank)
        self._owner = next(_owners)
        self._steps: list[tuple[StepState, list[float], Counter[str]]] = []
        # (write, seconds, bytes) per successful I/O, appended by the Offloader (lock held) and
        # turned into the histogram and the device bytes by the next publish: an append is the
        # whole cost per I/O.
        self.io_log: list[tuple[bool, float, int]] = []
        self._errors: Counter[tuple[str, str]] = Counter()
        r = (self.rank,)
        self._field_keys = [(f, (fam, "", r)) for f, fam in _STEP_FIELDS]
        spill = backend.spill_path  # None: nothing goes to a disk (the memory backend)
        self._device_key = None
        if spill is not None:
            self._device_key = ("tba_device_bytes_written", "", (self.rank, spill_device(spill)))
        self._gauge_keys = tuple(
            (name, "", r)
            for name in (
                "tba_resident_bytes",
                "tba_staging_bytes_in_use",
                "tba_disk_bytes_in_use",
                "tba_keep_last",
            )
        )
        self._backend = backend
        self._info_key = ("tba_backend_info", "", (self.rank, backend.name, backend.reason))
        self._closed = False
        # Every series whose labels are known exists from the start, at 0.
        zeros = [key for _, key in self._field_keys]
        zeros += [("tba_tensors_kept", "", (self.rank, why)) for why in KEPT_REASONS]
        for op in ("write", "read"):
            zeros.append(("tba_io_errors", "", (self.rank, op, "EIO")))
            zeros.append(("tba_io_seconds", "_sum", (self.rank, op)))
            zeros += [("tba_io_seconds", "_bucket", (self.rank, op, le)) for le in _les()]
        if self._device_key is not None:
            zeros.append(self._device_key)
        with self.store.lock:
            try:
                self.store.open_files()
            except BaseException:
                self.store.users -= 1
                if self.store.users == 0:
                    self.store.close_files()
                raise
            for key in zeros:
                self.store.add(key, 0)
            self.store.gauge(self._info_key, self._owner, 1.0)
            for key in self._gauge_keys:
                self.store.gauge(key, self._owner, 0.0)

    # -- recording ----------------------------------------------------------------------------
    def track(self, st: StepState) -> None:
        """Follow ``st`` until it settles (a new step starts)."""
        self._steps.append((st, [0.0] * len(_STEP_FIELDS), Counter()))

    def io_error(self, op: str, err: BaseException) -> None:
        code = getattr(err, "errno", None)
        name = _errno.errorcode.get(code, "unknown") if isinstance(code, int) else "unknown"
        self._errors[(op, name)] += 1

    # -- publishing ---------------------------------------------------------------------------
    def publish(
        self,
        busy: set[Any] | None,
        resident: int,
        staging: int,
        disk: int,
        keep_last: int,
    ) -> None:
        """Push what changed since the last call. ``busy``: the steps that may still count
        (those with live entries); the others are dropped after this last push. None: drop
        none."""
        if self._closed:
            return
        s = self.store
        with s.lock:
            s.check_fork()
            keep = []
            for item in self._steps:
                st, sent, kept = item
                for i, (field, key) in enumerate(self._field_keys):
                    v = getattr(st, field)
                    if v != sent[i]:
                        s.add(key, v - sent[i])
                        sent[i] = v
                if st.kept_reasons != kept:
                    for reason, n in st.kept_reasons.items():
                        if n != kept[reason]:
                            s.add(("tba_tensors_kept", "", (self.rank, reason)), n - kept[reason])
                            kept[reason] = n
                if busy is None or st in busy or not st.forward_end or st.unsettled:
                    keep.append(item)
            self._steps = keep
            self._push_io()
            if self._backend.reason != self._info_key[2][2]:  # e.g. buffers registered, caps
                s.gauge(self._info_key, self._owner, None)
                b = self._backend
                self._info_key = ("tba_backend_info", "", (self.rank, b.name, b.reason))
                s.gauge(self._info_key, self._owner, 1.0)
            for key, value in zip(self._gauge_keys, (resident, staging, disk, keep_last)):
                s.gauge(key, self._owner, float(value))

    def _push_io(self) -> None:
        s = self.store
        if self.io_log:
            counts = ([0] * len(_BOUNDS), [0] * len(_BOUNDS))  # reads, writes
            sums = [0.0, 0.0]
            written = 0
            for write, seconds, nbytes in self.io_log:
                counts[write][bisect.bisect_left(_BOUNDS, seconds)] += 1
                sums[write] += seconds
                if write:
                    written += nbytes
            self.io_log.clear()
            for i, op in ((0, "read"), (1, "write")):
                for j, n in enumerate(counts[i]):
                    if n:
                        s.add(("tba_io_seconds", "_bucket", (self.rank, op, _les()[j])), n)
                if any(counts[i]):
                    s.add(("tba_io_seconds", "_sum", (self.rank, op)), sums[i])
            if written and self._device_key is not None:
                s.add(self._device_key, written)
        for (op, name), n in self._errors.items():
            s.add(("tba_io_errors", "", (self.rank, op, name)), n)
        self._errors.clear()

    def close(self) -> None:
        """Withdraw this Offloader's gauges; the files stay for the sidecar (NOTE 4)."""
        if self._closed:
            return
        s = self.store
        with s.lock:
            self._closed = True
            self._steps = []
            for key in (*self._gauge_keys, self._info_key):
                s.gauge(key, self._owner, None)
            s.users -= 1
            if s.users == 0:
                s.close_files()
