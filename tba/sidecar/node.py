"""The node gauges the sidecar computes itself, as a collector over a frozen snapshot.

Each name here is emitted on every scrape (a labelled family may have no samples yet, e.g. the
endurance gauges before two scans have run); deploy/grafana-dashboard.json may use only these
and the ranks' names (tests/sidecar/test_deploy.py checks it against a real scrape).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["NodeCollector", "NodeSnapshot", "NODE_METRICS"]

# name -> (type, help); the one list of what the sidecar itself emits.
NODE_METRICS: dict[str, tuple[str, str]] = {
    "tba_sidecar_up": ("gauge", "1 while the sidecar serves"),
    "tba_sidecar_info": ("gauge", "The sidecar's version and host, value 1"),
    "tba_sidecar_start_time_seconds": ("gauge", "When the sidecar started (Unix time)"),
    "tba_sidecar_scrapes_total": ("counter", "Requests to /metrics served"),
    "tba_sidecar_scrape_duration_seconds": ("gauge", "Time the previous /metrics took"),
    "tba_sidecar_scan_duration_seconds": ("gauge", "Time the last scan and janitor pass took"),
    "tba_sidecar_last_scan_timestamp_seconds": ("gauge", "When the last scan ended (Unix time)"),
    "tba_sidecar_loop_lag_seconds": (
        "gauge",
        "Largest event-loop delay over the last scan interval (a 50 ms timer's overshoot)",
    ),
    "tba_sidecar_metrics_files": ("gauge", "Files in the metrics dir, by state"),
    "tba_sidecar_ranks": ("gauge", "Processes with metrics files or spill dirs, by state"),
    "tba_spill_fs_size_bytes": ("gauge", "Size of the filesystem holding the spill root"),
    "tba_spill_fs_free_bytes": ("gauge", "Bytes available to unprivileged users there"),
    "tba_spill_fs_used_bytes": ("gauge", "Bytes used on that filesystem, by anyone"),
    "tba_spill_dirs": (
        "gauge",
        "Per-process spill directories under the root: live, dead, other_host (not judged)",
    ),
    "tba_node_quota_used_bytes": ("gauge", "Bytes charged to the node quota ledger"),
    "tba_node_quota_limit_bytes": ("gauge", "TBA_NODE_MAX_DISK_BYTES, as in the ledger"),
    "tba_janitor_runs_total": ("counter", "Janitor passes"),
    "tba_janitor_removed_total": ("counter", "Files and directories the janitor removed"),
    "tba_janitor_refused_total": (
        "counter",
        "Leftovers of dead processes the janitor would not touch, by reason",
    ),
    "tba_janitor_paused": ("gauge", "1 when the janitor removes nothing (see /status)"),
    "tba_ssd_sys_bytes_written_total": (
        "counter",
        "Bytes written to the device since boot, by every writer (/sys/block/<dev>/stat)",
    ),
    "tba_ssd_bytes_written_per_day": (
        "gauge",
        "Write rate to the device over the rate window, by every writer, per day",
    ),
    "tba_ssd_tba_bytes_written_per_day": (
        "gauge",
        "tba's share of that rate (the ranks' tba_device_bytes_written_total), per day",
    ),
    "tba_ssd_rate_window_seconds": ("gauge", "Span of the samples behind the rates"),
    "tba_ssd_rated_endurance_bytes": ("gauge", "TBA_SSD_TBW x 1e12"),
    "tba_ssd_projected_days_left": (
        "gauge",
        "Days until the rated TBW is reached at the current rate; assumes no writes before "
        "this boot, so an upper bound (docs/observability.md, SSD endurance)",
    ),
}

Sample = tuple[dict[str, str], float]


@dataclasses.dataclass
class NodeSnapshot:
    """name -> samples; filled by the sidecar on the event loop, read by a scrape."""

    samples: dict[str, list[Sample]] = dataclasses.field(default_factory=dict)

    def add(self, name: str, value: float, **labels: str) -> None:
        if name not in NODE_METRICS:
            raise KeyError(f"tba.sidecar: {name} is not in NODE_METRICS; add it there first")
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        self.samples.setdefault(name, []).append((labels, float(value)))


class NodeCollector:
    def __init__(self, snapshot: NodeSnapshot):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        for name, (typ, doc) in NODE_METRICS.items():
            samples = self.snapshot.samples.get(name, [])
            keys = sorted({k for labels, _ in samples for k in labels})
            if typ == "counter":
                fam: Metric = CounterMetricFamily(name, doc, labels=keys)
            else:
                fam = GaugeMetricFamily(name, doc, labels=keys)
            for labels, value in samples:
                fam.add_metric([labels.get(k, "") for k in keys], value)
            yield fam
