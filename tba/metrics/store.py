"""Where tba's metric values live: one store per metrics directory (or memory only) per process,
which writes prometheus_client's multiprocess files, and the collector behind :func:`registry`
that exposes every store of the process (NOTE [Metrics] 3 to 5 in tba/metrics/__init__.py).

Imports neither torch nor prometheus_client at import time.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .defs import _DEFS, _aggregate, _Key, _les

log = logging.getLogger("tba.metrics")

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

# The multiprocess files, as prometheus_client names them (<prefix>_<pid>.db).
_PREFIXES = ("counter", "histogram", "gauge_livesum", "gauge_livemax")


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
