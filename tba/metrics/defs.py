"""What tba's metrics are: their names, kinds, labels and help texts, the histogram buckets, and
how a gauge combines the values of several Offloaders (NOTE [Metrics] 1 and 4 in
tba/metrics/__init__.py).

Tables and two small rules; imports neither torch nor prometheus_client (``_les`` imports the
latter on first use).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..records.reasons import KEPT_REASONS as _KEPT_REASONS

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
    "tba_bytes_offloaded": _Def("counter", "Bytes of saved tensors written to the spill files."),
    "tba_bytes_reloaded": _Def("counter", "Bytes of saved tensors read back from disk."),
    "tba_tensors_offloaded": _Def("counter", "Saved tensors written to the spill files."),
    "tba_tensors_kept": _Def(
        "counter",
        "Saved tensors kept in memory, by reason (the keys of tba.records.reasons.KEPT_REASONS).",
        ("reason",),
    ),
    "tba_host_tier_bytes": _Def(
        "counter", "Bytes of offloaded saved tensors placed in the host tier (extent bytes)."
    ),
    "tba_ssd_tier_bytes": _Def(
        "counter", "Bytes of offloaded saved tensors placed on the spill disk (extent bytes)."
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


def _exposed(name: str, d: _Def) -> str:
    return name + "_total" if d.kind == "counter" else name


# The names as they appear on /metrics (histograms add _bucket, _sum, _count), with labels.
METRICS: dict[str, tuple[str, ...]] = {_exposed(n, d): d.labelnames for n, d in _DEFS.items()}

# Why tba keeps a saved tensor in memory (tba/records/reasons.py; counted by tba/datapath/pack.py).
KEPT_REASONS = tuple(_KEPT_REASONS)  # the ``reason`` label values of tba_tensors_kept

# StepState attribute -> counter family (NOTE [Metrics] 2).
_STEP_FIELDS = (
    ("bytes_offloaded", "tba_bytes_offloaded"),
    ("bytes_reloaded", "tba_bytes_reloaded"),
    ("tensors_offloaded", "tba_tensors_offloaded"),
    ("host_tier_bytes", "tba_host_tier_bytes"),
    ("ssd_tier_bytes", "tba_ssd_tier_bytes"),
    ("dedup_hits", "tba_dedup_hits"),
    ("forwarded", "tba_forwarded"),
    ("sync_loads", "tba_sync_loads"),
    ("stall_seconds", "tba_stall_seconds"),
)

# A key: (family, sample suffix, label values in _Def.labelnames order, le for a bucket).
_Key = tuple[str, str, tuple[str, ...]]


def _aggregate(d: _Def, by: dict[int, float]) -> float:
    if not by:
        return 0.0
    return max(by.values()) if d.mode == "livemax" else sum(by.values())


@functools.cache
def _les() -> tuple[str, ...]:
    """The bucket bounds as prometheus_client writes ``le`` ("5e-05", "+Inf"); imported late,
    so that ``import tba`` does not import prometheus_client."""
    from prometheus_client.utils import floatToGoString

    return tuple(floatToGoString(b) for b in _BOUNDS)
