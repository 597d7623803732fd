"""Prometheus metrics of each rank, for `tba sidecar` or the application's own exporter.

    TBA_METRICS_DIR=/run/tba-metrics   # each rank writes its files here; the sidecar serves them

    from prometheus_client import start_http_server
    start_http_server(9100, registry=tba.metrics.registry())   # or: this process only

NOTE [Metrics]
1. Names and labels are pinned (dashboards and the sidecar use them; see :data:`METRICS`).
   Every series carries ``rank`` (Config.rank).
2. Nothing runs per tensor. The counters are the sums of the per-step counters of
   tba/step.py, published as deltas when a step starts, when its forward ends, on ``stats()``
   and on ``close()``. A step keeps counting during its backward (reloads, stalls), even after
   later steps started (gradient accumulation), but only through its live entries and its
   writes: the Offloader tracks each step until none of its entries is alive and every one is
   counted (``unsettled``, NOTE [Counted once] in tba/reasons.py), so the totals equal the
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
"""

from __future__ import annotations

import bisect
import errno as _errno
import functools
import itertools
import logging
import os
import stat
import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .reasons import KEPT_REASONS as _KEPT_REASONS

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from .config import Config
    from .step import StepState

__all__ = [
    "IO_SECONDS_BUCKETS",
    "KEPT_REASONS",
    "METRICS",
    "RankMetrics",
    "registry",
    "spill_device",
]

# Upper bounds of tba_io_seconds (seconds; +Inf is added): from a 64 KiB I/O on a fast NVMe
# (tens of microseconds) to a 256 MiB one queued behind others on a slow or capped disk.
IO_SECONDS_BUCKETS = (
    5e-05,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
_BOUNDS = (*IO_SECONDS_BUCKETS, float("inf"))


@dataclass(frozen=True)
class _Def:
    kind: str  # counter | histogram | gauge
    help: str
    labels: tuple[str, ...] = ()  # besides rank
    mode: str = ""  # gauges: livesum | livemax

    @property
    def labelnames(self) -> tuple[str, ...]:
        return ("rank", *self.labels)


# Family names as prometheus_client stores them (counters without "_total").
_DEFS: dict[str, _Def] = {
    "tba_bytes_offloaded": _Def("counter", "Bytes of saved tensors captured for the spill files."),
    "tba_bytes_reloaded": _Def("counter", "Bytes of saved tensors read back from disk."),
    "tba_tensors_offloaded": _Def("counter", "Saved tensors captured for the spill files."),
    "tba_tensors_kept": _Def(
        "counter",
        "Saved tensors kept in memory, by reason (small, group, staging_full, disk_full, "
        "node_quota, unsupported).",
        ("reason",),
    ),
    "tba_dedup_hits": _Def("counter", "Saves that reused bytes already captured."),
    "tba_forwarded": _Def("counter", "Unpacks served from memory without a read."),
    "tba_sync_loads": _Def("counter", "Unpacks whose read had not been issued in advance."),
    "tba_stall_seconds": _Def("counter", "Seconds unpack waited for I/O."),
    "tba_io_errors": _Def(
        "counter", "Failed spill reads and writes, per affected tensor.", ("op", "errno")
    ),
    "tba_device_bytes_written": _Def(
        "counter",
        "Bytes written to spill files (aligned extents), by block device of the spill dir.",
        ("device",),
    ),
    "tba_io_seconds": _Def(
        "histogram", "Spill I/O time from issue to completion, successful I/Os.", ("op",)
    ),
    "tba_resident_bytes": _Def(
        "gauge", "Bytes of saved tensors tba holds in memory.", (), "livesum"
    ),
    "tba_staging_bytes_in_use": _Def(
        "gauge",
        "Bytes of the staging budget in use (pools, and CPU tensors held for direct writes).",
        (),
        "livesum",
    ),
    "tba_disk_bytes_in_use": _Def("gauge", "Bytes in live extents on disk.", (), "livesum"),
    "tba_keep_last": _Def(
        "gauge", "Blocks kept resident at the end of the forward (K).", (), "livemax"
    ),
    "tba_backend_info": _Def(
        "gauge", "The storage backend in use and why (value 1).", ("backend", "reason"), "livemax"
    ),
}


# The multiprocess files, as prometheus_client names them (<prefix>_<pid>.db).
_PREFIXES = ("counter", "histogram", "gauge_livesum", "gauge_livemax")


def _exposed(name: str, d: _Def) -> str:
    return name + "_total" if d.kind == "counter" else name


# The names as they appear on /metrics (histograms add _bucket, _sum, _count), with labels.
METRICS: dict[str, tuple[str, ...]] = {_exposed(n, d): d.labelnames for n, d in _DEFS.items()}

# The reasons pack keeps a tensor in memory (tba/hook.py, tba/offloader.py).
KEPT_REASONS = tuple(_KEPT_REASONS)  # the ``reason`` label values of tba_tensors_kept

# StepState attribute -> counter family (NOTE [Metrics] 2).
_STEP_FIELDS = (
    ("bytes_offloaded", "tba_bytes_offloaded"),
    ("bytes_reloaded", "tba_bytes_reloaded"),
    ("tensors_offloaded", "tba_tensors_offloaded"),
    ("dedup_hits", "tba_dedup_hits"),
    ("forwarded", "tba_forwarded"),
    ("sync_loads", "tba_sync_loads"),
    ("stall_seconds", "tba_stall_seconds"),
)

# A key: (family, sample suffix, label values in _Def.labelnames order, le for a bucket).
_Key = tuple[str, str, tuple[str, ...]]


# -- the block device of a spill dir --------------------------------------------------------
def spill_device(path: str) -> str:
    """The block device holding ``path`` as /sys/block names it ("nvme0n1", "vda", "dm-0"): a
    partition gives its disk. "unknown" when there is none (tmpfs, a network filesystem, a
    path that does not exist). The sidecar joins its endurance figures on this label, with the
    same rule: NOTE [Block device of a path] in tba/storage/blockdev.py."""
    from .storage.blockdev import block_device  # here: `import tba` loads no storage module

    return block_device(path).label


# -- the process-wide store -----------------------------------------------------------------
class _Store:
    """The values of one metrics directory (or of memory only) for this process."""

    def __init__(self, path: str | None):
        self.path = path
        self.lock = threading.Lock()
        self.values: dict[_Key, float] = {}  # counters and histogram samples
        self.gauges: dict[_Key, dict[int, float]] = {}  # key -> owner -> value
        self.users = 0
        self._files: dict[str, Any] = {}  # file prefix -> MmapedDict
        self._mkeys: dict[_Key, str] = {}
        self._pid = os.getpid()
        self.warned = False

    # Lock held from here on.
    def _file(self, prefix: str) -> Any:
        md = self._files.get(prefix)
        if md is None:
            from prometheus_client.mmap_dict import MmapedDict

            name = f"{prefix}_{self._pid}.db"
            _create_file(self.path, name)  # type: ignore[arg-type]
            md = self._files[prefix] = MmapedDict(os.path.join(self.path, name))  # type: ignore[arg-type]
        return md

    def open_files(self) -> None:
        """Open (create) every file now, so that a bad directory fails the Offloader's
        construction, not a step."""
        if self.path is None:
            return
        for prefix in _PREFIXES:
            try:
                self._file(prefix)
            except OSError as e:
                raise ConfigError(
                    f"TBA_METRICS_DIR: cannot open {self.path}/{prefix}_{self._pid}.db: "
                    f"{os.strerror(e.errno or 0)}. Point TBA_METRICS_DIR at a writable directory "
                    "on a filesystem with free space, or unset it."
                ) from None

    def _slot(self, key: _Key) -> tuple[Any, str]:
        """The file holding ``key`` and its key in prometheus_client's format."""
        family, suffix, labels = key
        d = _DEFS[family]
        mk = self._mkeys.get(key)
        if mk is None:
            from prometheus_client.mmap_dict import mmap_key

            names = d.labelnames + (("le",) if suffix == "_bucket" else ())
            sample = family + ("_total" if d.kind == "counter" else suffix)
            mk = self._mkeys[key] = mmap_key(family, sample, names, labels, d.help)
        return self._file(f"gauge_{d.mode}" if d.kind == "gauge" else d.kind), mk

    def _write(self, key: _Key, value: float) -> None:
        if self.path is None:
            return
        try:
            md, mk = self._slot(key)
            md.write_value(mk, value, 0.0)
        except (OSError, ConfigError) as e:  # metrics never fail a training step
            self._failed(e)

    def _failed(self, e: Exception) -> None:
        if not self.warned:
            self.warned = True
            log.warning("tba.metrics: cannot update the files in %s: %s", self.path, e)

    def add(self, key: _Key, delta: float) -> None:
        v = self.values.get(key)
        if v is None:
            v = 0.0
            if self.path is not None:  # continue a file of this pid (like prometheus_client)
                try:
                    md, mk = self._slot(key)
                    v = md.read_value(mk)[0]
                except (OSError, ConfigError) as e:
                    self._failed(e)
        v = self.values[key] = v + delta
        self._write(key, v)

    def gauge(self, key: _Key, owner: int, value: float | None) -> None:
        """Set (or, with None, withdraw) ``owner``'s value of a gauge; writes the aggregate."""
        by = self.gauges.setdefault(key, {})
        if value is None:
            by.pop(owner, None)
        else:
            by[owner] = value
        self._write(key, _aggregate(_DEFS[key[0]], by))

    def check_fork(self) -> None:
        """A forked child starts its own files (like prometheus_client), at zero."""
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._files.clear()  # the parent's mappings; the child never writes them
            self.values.clear()
            self.gauges.clear()

    def close_files(self) -> None:
        for md in self._files.values():
            md.close()
        self._files.clear()


def _aggregate(d: _Def, by: dict[int, float]) -> float:
    if not by:
        return 0.0
    return max(by.values()) if d.mode == "livemax" else sum(by.values())


def _create_file(path: str, name: str) -> None:
    """Create ``name`` in ``path`` (0600) unless it is there; never through a symlink."""
    try:
        fd = os.open(
            os.path.join(path, name),
            os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
            0o600,
        )
    except OSError as e:
        raise ConfigError(
            f"TBA_METRICS_DIR: cannot create {os.path.join(path, name)}: "
            f"{os.strerror(e.errno or 0)}. Point TBA_METRICS_DIR at a directory this process "
            "can write, or unset it."
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(
                f"TBA_METRICS_DIR: {os.path.join(path, name)} is not a regular file. Remove it, "
                "or point TBA_METRICS_DIR at a directory for tba's metrics only."
            )
    finally:
        os.close(fd)


def _prepare_dir(path: str) -> str:
    """Create ``path`` (0700, and so are the missing parents) if missing; check that it is a
    writable directory. An existing directory keeps its mode (e.g. a shared emptyDir)."""
    missing = []
    at = path
    while not os.path.lexists(at) and os.path.dirname(at) != at:
        missing.append(at)
        at = os.path.dirname(at)
    for comp in reversed(missing):
        try:
            os.mkdir(comp, 0o700)
        except FileExistsError:
            pass  # another rank made it first
        except OSError as e:
            raise ConfigError(
                f"TBA_METRICS_DIR: cannot create {comp}: {os.strerror(e.errno or 0)}. Point "
                "TBA_METRICS_DIR at a directory this process can create or write, or unset it."
            ) from None
    if not os.path.isdir(path):
        raise ConfigError(
            f"TBA_METRICS_DIR: {path} exists and is not a directory. Point TBA_METRICS_DIR at a "
            "directory (tba creates it if missing), or unset it."
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(
            f"TBA_METRICS_DIR: {path} is not writable by this process (uid {os.geteuid()}). "
            "Make it writable, or point TBA_METRICS_DIR elsewhere."
        )
    return os.path.realpath(path)


_owners = itertools.count()  # who set a gauge value, per RankMetrics
_stores: dict[str | None, _Store] = {}
_stores_lock = threading.Lock()
_registry: Any = None


def _store_for(path: str | None) -> _Store:
    if path is not None:
        path = _prepare_dir(path)
    with _stores_lock:
        store = _stores.get(path)
        if store is None:
            store = _stores[path] = _Store(path)
        with store.lock:
            store.check_fork()
            store.users += 1
        return store


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


@functools.cache
def _les() -> tuple[str, ...]:
    """The bucket bounds as prometheus_client writes ``le`` ("5e-05", "+Inf"); imported late,
    so that ``import tba`` does not import prometheus_client."""
    from prometheus_client.utils import floatToGoString

    return tuple(floatToGoString(b) for b in _BOUNDS)


# -- in-process exposition ------------------------------------------------------------------
class _Collector:
    """Yields this process's values (every store) as metric families."""

    def collect(self) -> Any:
        from prometheus_client.metrics_core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        merged: dict[str, dict[tuple[str, ...], Any]] = {n: {} for n in _DEFS}
        with _stores_lock:
            stores = list(_stores.values())
        for s in stores:
            with s.lock:
                values = dict(s.values)
                gauges = {k: _aggregate(_DEFS[k[0]], by) for k, by in s.gauges.items() if by}
            for (family, suffix, labels), v in values.items():
                d = _DEFS[family]
                if d.kind == "histogram":
                    le = labels[-1] if suffix == "_bucket" else None
                    base = labels[:-1] if le is not None else labels
                    h = merged[family].setdefault(base, ({}, [0.0]))
                    if le is None:
                        h[1][0] += v
                    else:
                        h[0][le] = h[0].get(le, 0.0) + v
                else:
                    merged[family][labels] = merged[family].get(labels, 0.0) + v
            for (family, _, labels), v in gauges.items():
                merged[family][labels] = merged[family].get(labels, 0.0) + v
        for family, series in merged.items():
            d = _DEFS[family]
            names = list(d.labelnames)
            if d.kind == "counter":
                fam: Any = CounterMetricFamily(family, d.help, labels=names)
            elif d.kind == "gauge":
                fam = GaugeMetricFamily(family, d.help, labels=names)
            else:
                fam = HistogramMetricFamily(family, d.help, labels=names)
            for labels, v in sorted(series.items()):
                if d.kind == "histogram":
                    buckets, acc = [], 0.0
                    for le in _les():
                        acc += v[0].get(le, 0.0)
                        buckets.append((le, acc))
                    fam.add_metric(list(labels), buckets, v[1][0])
                else:
                    fam.add_metric(list(labels), v)
            yield fam


def registry() -> CollectorRegistry:
    """A prometheus_client registry with this process's tba metrics (every Offloader, every
    rank), for the application's own exporter, e.g.
    ``prometheus_client.start_http_server(9100, registry=tba.metrics.registry())``. It is not
    the default registry: tba adds nothing to prometheus_client.REGISTRY."""
    global _registry
    from prometheus_client import CollectorRegistry

    with _stores_lock:
        if _registry is None:
            _registry = CollectorRegistry(auto_describe=False)
            _registry.register(_Collector())
        return _registry
