"""The ranks' prometheus-client multiprocess files, read without following symlinks.

prometheus-client names each file ``<type>_<pid>.db`` (``counter``, ``histogram``, ``summary``)
or ``gauge_<mode>_<pid>.db``. The sidecar reads them two ways:

- :class:`RankCollector` serves them on ``/metrics``: prometheus-client's own
  ``MultiProcessCollector.merge`` over the regular ``*.db`` files (a symlink is never opened,
  where ``MultiProcessCollector.collect`` would follow one). A file that cannot be parsed (being
  created right now, or truncated) is left out of that scrape and counted, instead of failing
  the whole scrape.
- :func:`read_dir`, once per scan: which pids and ranks have files, and the bytes each rank
  reports per block device (``tba_device_bytes_written_total``), for the endurance figures.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector

__all__ = [
    "DEVICE_BYTES_METRIC",
    "DirReading",
    "RankCollector",
    "RankFile",
    "list_files",
    "parse_name",
    "read_dir",
]

DEVICE_BYTES_METRIC = "tba_device_bytes_written_total"
LIVE_GAUGE_MODES = ("liveall", "livesum", "livemax", "livemin", "livemostrecent")

_NAME_RE = re.compile(
    r"^(?P<typ>counter|histogram|summary|gauge)_(?:(?P<mode>[a-z]+)_)?(?P<id>.+)\.db$"
)


@dataclasses.dataclass(frozen=True)
class RankFile:
    name: str
    typ: str  # counter | gauge | histogram | summary
    mode: str | None  # the gauge's multiprocess mode
    pid: int | None  # None: a custom process identifier that is not a pid (never reclaimed)
    size: int
    mtime: float

    @property
    def live_gauge(self) -> bool:
        return self.typ == "gauge" and self.mode in LIVE_GAUGE_MODES


def parse_name(name: str) -> tuple[str, str | None, int | None] | None:
    """``("gauge", "livesum", 123)`` for ``gauge_livesum_123.db``; None for other names."""
    m = _NAME_RE.match(name)
    if m is None or (m.group("typ") == "gauge") != (m.group("mode") is not None):
        return None
    ident = m.group("id")
    return m.group("typ"), m.group("mode"), int(ident) if ident.isdigit() else None


def list_files(path: str) -> tuple[list[RankFile], list[str]]:
    """The regular metrics files in ``path``, and the names of ``*.db`` entries that are not
    regular files (symlinks included: they are reported, never opened)."""
    files: list[RankFile] = []
    odd: list[str] = []
    with os.scandir(path) as it:
        for entry in it:
            if not entry.name.endswith(".db"):
                continue
            parsed = parse_name(entry.name)
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if parsed is None or not stat.S_ISREG(st.st_mode):
                odd.append(entry.name)
                continue
            files.append(RankFile(entry.name, *parsed, size=st.st_size, mtime=st.st_mtime))
    files.sort(key=lambda f: f.name)
    return files, odd


def _values(path: str) -> Iterator[tuple[str, float]]:
    for key, value, _ts, _pos in MmapedDict.read_all_values_from_file(path):
        yield key, value


@dataclasses.dataclass
class DirReading:
    """One scan of the metrics directory."""

    files: list[RankFile]
    odd: list[str]  # *.db entries that are not regular files, or not named by prometheus-client
    bad: list[str]  # files that could not be parsed this time
    ranks_by_pid: dict[int, set[str]]  # the `rank` label values each pid's files carry
    device_bytes: dict[str, float]  # DEVICE_BYTES_METRIC summed over ranks, per `device` label
    device_bytes_by_rank: dict[tuple[str, str], float]  # (rank, device) -> bytes

    @property
    def pids(self) -> set[int]:
        return {f.pid for f in self.files if f.pid is not None}


def read_dir(path: str) -> DirReading:
    """List and parse every metrics file in ``path`` (blocking: run it in an executor)."""
    files, odd = list_files(path)
    bad: list[str] = []
    ranks: dict[int, set[str]] = {}
    dev: dict[str, float] = {}
    by_rank: dict[tuple[str, str], float] = {}
    cache: dict[str, tuple[str, dict[str, Any]]] = {}
    for f in files:
        try:
            values = list(_values(os.path.join(path, f.name)))
        except FileNotFoundError:
            continue  # removed since the listing (mark_process_dead by someone else)
        except Exception:
            bad.append(f.name)
            continue
        for key, value in values:
            parsed = cache.get(key)
            if parsed is None:
                try:
                    _metric, sample, labels, _help = json.loads(key)
                except ValueError:
                    continue
                parsed = cache[key] = (sample, labels if isinstance(labels, dict) else {})
            sample, labels = parsed
            rank = labels.get("rank")
            if rank is not None and f.pid is not None:
                ranks.setdefault(f.pid, set()).add(str(rank))
            if sample == DEVICE_BYTES_METRIC:
                device = str(labels.get("device", ""))
                dev[device] = dev.get(device, 0.0) + value
                k = (str(rank), device)
                by_rank[k] = by_rank.get(k, 0.0) + value
    return DirReading(files, odd, bad, ranks, dev, by_rank)


class RankCollector:
    """A collector (for a per-request registry) of every rank's multiprocess files."""

    def __init__(self, path: str):
        self.path = path

    def collect(self) -> Iterable[Metric]:
        files, _odd = list_files(self.path)
        paths = [os.path.join(self.path, f.name) for f in files]
        try:
            return MultiProcessCollector.merge(paths, accumulate=True)
        except Exception:
            pass
        # One file is unreadable (being created, or damaged): merge the ones that parse.
        good: list[str] = []
        for p in paths:
            try:
                for _ in _values(p):
                    pass
            except FileNotFoundError:
                continue
            except Exception:
                continue  # counted by the scan (tba_sidecar_metrics_files{state="unreadable"})
            good.append(p)
        return MultiProcessCollector.merge(good, accumulate=True)
