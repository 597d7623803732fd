"""What the sidecar shows: the node gauges of /metrics, the /status document, and the scan
results they are built from. Everything here runs on the event loop: it reads memory, and
asks kill(pid, 0) whether a process lives, never the filesystem."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any

from ..storage.spilldir import pid_alive
from . import endurance
from .janitor import KINDS, JanitorReport
from .node import NodeSnapshot
from .rankfiles import DirReading
from .spill import RootScan

if TYPE_CHECKING:
    from .app import Sidecar

LAG_BOUNDS = (0.01, 0.05, 0.1)  # seconds; /status counts the loop's ticks later than each

__all__ = ["Device", "Scan", "device_figures", "finite", "ranks", "snapshot", "status", "version"]


@dataclasses.dataclass
class Scan:
    """What one executor call gathered (NOTE [Sidecar concurrency] rule 1)."""

    reading: DirReading | None
    metrics_problem: str
    roots: list[RootScan]
    disks: dict[str, tuple[list[str], str]]  # root -> (disks, why none)
    sys_bytes: dict[str, int]  # disk -> bytes written since boot
    tba_bytes: dict[str, float]  # disk -> the ranks' tba_device_bytes_written_total, summed
    janitor: JanitorReport
    seconds: float


@dataclasses.dataclass
class Device:
    roots: list[str]
    sys_window: endurance.RateWindow
    tba_window: endurance.RateWindow
    sys_bytes: int = 0
    tba_bytes: float = 0.0
    problem: str = ""


def ranks(sc: Sidecar) -> list[dict[str, Any]]:
    """The processes seen: by spill directory and by metrics file, merged by (host, pid)."""
    scan = sc.scan
    by_pid: dict[tuple[str, int], dict[str, Any]] = {}
    if scan is None:
        return []
    for r in scan.roots:
        for e in r.entries:
            d = by_pid.setdefault(
                (e.host, e.pid),
                {
                    "pid": e.pid,
                    "host": e.host,
                    "ranks": set(),
                    "alive": e.alive,
                    "spill_dirs": [],
                    "metrics_files": 0,
                },
            )
            d["ranks"].add(str(e.rank))
            d["spill_dirs"].append(os.path.join(r.root, e.name))
            if e.alive:
                d["alive"] = True
    if scan.reading is not None:
        me = os.getpid()
        for f in scan.reading.files:
            if f.pid is None:
                continue
            d = by_pid.get((sc.host, f.pid))
            if d is None:
                d = by_pid[(sc.host, f.pid)] = {
                    "pid": f.pid,
                    "host": sc.host,
                    "ranks": set(),
                    "alive": f.pid != me and pid_alive(f.pid),
                    "spill_dirs": [],
                    "metrics_files": 0,
                }
            d["metrics_files"] += 1
            d["ranks"] |= scan.reading.ranks_by_pid.get(f.pid, set())
    out = []
    for d in sorted(by_pid.values(), key=lambda d: (d["host"], d["pid"])):
        d["ranks"] = sorted(d["ranks"], key=lambda r: (len(r), r))
        out.append(d)
    return out


def device_figures(sc: Sidecar, name: str, dev: Device) -> dict[str, Any]:
    """A device's endurance figures (NOTE [Endurance arithmetic])."""
    rate = dev.sys_window.rate()
    tba_rate = dev.tba_window.rate()
    out: dict[str, Any] = {
        "device": name,
        "spill_roots": dev.roots,
        "sys_bytes_written_since_boot": dev.sys_bytes,
        "tba_bytes_written": dev.tba_bytes,
        "rate_window_seconds": round(dev.sys_window.span(), 3),
        "bytes_written_per_day": None if rate is None else rate * endurance.SECONDS_PER_DAY,
        "tba_bytes_written_per_day": (
            None if tba_rate is None else tba_rate * endurance.SECONDS_PER_DAY
        ),
        "rated_tbw": sc.s.ssd_tbw,
        "projected_days_left": None,
        "problem": dev.problem,
    }
    if sc.s.ssd_tbw is not None and rate is not None:
        out["projected_days_left"] = endurance.days_left(sc.s.ssd_tbw, dev.sys_bytes, rate)
    return out


def snapshot(sc: Sidecar) -> NodeSnapshot:
    """The node gauges, built on the event loop (NOTE [Sidecar concurrency] rule 3)."""
    snap = NodeSnapshot()
    scan = sc.scan
    snap.add("tba_sidecar_up", 1)
    snap.add("tba_sidecar_info", 1, version=version(), host=sc.host)
    snap.add("tba_sidecar_start_time_seconds", sc.started)
    snap.add("tba_sidecar_scrapes_total", sc.scrapes)
    snap.add("tba_sidecar_scrape_duration_seconds", sc.scrape_seconds)
    snap.add("tba_sidecar_loop_lag_seconds", sc.lag_last)
    snap.add("tba_janitor_runs_total", sc.janitor.runs)
    snap.add("tba_janitor_paused", 1 if sc.janitor.paused else 0)
    for kind in KINDS:
        snap.add("tba_janitor_removed_total", sc.janitor.removed[kind], kind=kind)
    for (kind, reason), n in sorted(sc.janitor.refused.items()):
        snap.add("tba_janitor_refused_total", n, kind=kind, reason=reason)
    if scan is None:
        return snap
    snap.add("tba_sidecar_scan_duration_seconds", scan.seconds)
    snap.add("tba_sidecar_last_scan_timestamp_seconds", sc.scan_wall)
    if scan.reading is not None:
        snap.add(
            "tba_sidecar_metrics_files",
            len(scan.reading.files) - len(scan.reading.bad),
            state="ok",
        )
        snap.add("tba_sidecar_metrics_files", len(scan.reading.bad), state="unreadable")
        snap.add("tba_sidecar_metrics_files", len(scan.reading.odd), state="not_regular")
    seen = ranks(sc)
    snap.add("tba_sidecar_ranks", sum(1 for r in seen if r["alive"]), state="alive")
    snap.add("tba_sidecar_ranks", sum(1 for r in seen if not r["alive"]), state="dead")
    for r in scan.roots:
        if r.size_bytes is not None:
            snap.add("tba_spill_fs_size_bytes", r.size_bytes, root=r.root)
            snap.add("tba_spill_fs_free_bytes", r.free_bytes, root=r.root)
            snap.add("tba_spill_fs_used_bytes", r.used_bytes, root=r.root)
        for state, alive in (("live", True), ("dead", False), ("other_host", None)):
            n = sum(1 for e in r.entries if e.alive is alive)
            snap.add("tba_spill_dirs", n, root=r.root, state=state)
        used, limit = _ledger_numbers(r.ledger)
        if used is not None:
            snap.add("tba_node_quota_used_bytes", used, root=r.root)
        if limit is not None:
            snap.add("tba_node_quota_limit_bytes", limit, root=r.root)
    for name, dev in sorted(sc.devices.items()):
        fig = device_figures(sc, name, dev)
        snap.add("tba_ssd_sys_bytes_written_total", dev.sys_bytes, device=name)
        snap.add("tba_ssd_rate_window_seconds", fig["rate_window_seconds"], device=name)
        if fig["bytes_written_per_day"] is not None:
            snap.add("tba_ssd_bytes_written_per_day", fig["bytes_written_per_day"], device=name)
        if fig["tba_bytes_written_per_day"] is not None:
            snap.add(
                "tba_ssd_tba_bytes_written_per_day",
                fig["tba_bytes_written_per_day"],
                device=name,
            )
        if sc.s.ssd_tbw is not None:
            snap.add("tba_ssd_rated_endurance_bytes", sc.s.ssd_tbw * 1e12, device=name)
            if fig["projected_days_left"] is not None:
                snap.add("tba_ssd_projected_days_left", fig["projected_days_left"], device=name)
    return snap


def status(sc: Sidecar) -> dict[str, Any]:
    """The /status document."""
    scan = sc.scan
    ok, why = sc.health()
    out: dict[str, Any] = {
        "healthy": ok,
        "health": why,
        "sidecar": {
            "version": version(),
            "pid": os.getpid(),
            "host": sc.host,
            "listen": None if sc.address is None else f"{sc.address[0]}:{sc.address[1]}",
            "started": sc.started,
            "uptime_seconds": round(time.time() - sc.started, 3),
            "interval_seconds": sc.s.interval,
            "rate_window_seconds": sc.s.rate_window,
            "scan_seconds": None if scan is None else round(scan.seconds, 6),
            "loop_lag_seconds": {
                "last_interval": sc.lag_last,
                "max": sc.lag_max,
                "ticks": sc.lag_ticks,
                "ticks_over": {f"{b:g}": n for b, n in zip(LAG_BOUNDS, sc.lag_over)},
            },
            "scrapes": sc.scrapes,
        },
        "metrics_dir": {"path": sc.s.metrics_dir},
        "ranks": ranks(sc),
        "spill_roots": [],
        "devices": [device_figures(sc, n, d) for n, d in sorted(sc.devices.items())],
        "janitor": {
            "enabled": sc.s.janitor,
            "paused": sc.janitor.paused,
            "runs": sc.janitor.runs,
            "removed": dict(sc.janitor.removed),
            "refused": [],
        },
    }
    if scan is None:
        return out
    r = scan.reading
    out["metrics_dir"].update(
        problem=scan.metrics_problem,
        files=0 if r is None else len(r.files),
        unreadable=[] if r is None else r.bad,
        not_regular=[] if r is None else r.odd,
    )
    for root in scan.roots:
        disks, why = scan.disks.get(root.root, ([], ""))
        out["spill_roots"].append(
            {
                "root": root.root,
                "problem": root.problem,
                "size_bytes": root.size_bytes,
                "free_bytes": root.free_bytes,
                "used_bytes": root.used_bytes,
                "devices": disks,
                "device_problem": why,
                "dirs": [
                    {
                        "name": e.name,
                        "host": e.host,
                        "pid": e.pid,
                        "rank": e.rank,
                        "kind": e.kind,
                        "locked": e.locked,
                        "alive": e.alive,
                    }
                    for e in root.entries
                ],
                "node_quota": root.ledger,
            }
        )
    out["janitor"]["refused"] = [
        {"kind": k, "reason": why, "path": p} for k, why, p in scan.janitor.refused
    ]
    return out


def _ledger_numbers(ledger: Any) -> tuple[float | None, float | None]:
    if not isinstance(ledger, dict) or not ledger.get("available"):
        return None, None
    data = ledger.get("ledger")
    if not isinstance(data, dict):
        return None, None

    def pick(*names: str) -> float | None:
        for n in names:
            v = data.get(n)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
        return None

    return pick("used_bytes", "used", "total_bytes"), pick("limit_bytes", "limit", "max_bytes")


def finite(value: Any) -> Any:
    """JSON has no Infinity: +Inf days left (no writes) becomes null."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def version() -> str:
    from .. import __version__

    return __version__
