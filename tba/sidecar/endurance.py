"""SSD endurance: which block devices hold the spill roots, what they wrote, and how long the
drive's rated endurance (TBW) lasts at the current write rate.

NOTE [Endurance arithmetic]
1. Bytes written per device come from ``/sys/block/<disk>/stat``, field 7 (sectors written;
   the kernel's sectors are always 512 bytes, whatever the drive's block size). They count
   every writer on the drive, not only tba, which is what wears it. tba's own share comes from
   the ranks' ``tba_device_bytes_written_total{rank,device}``, summed over ranks.
2. The write rate is the increase over a sliding window (``--rate-window``, default one hour)
   divided by its span. A counter that goes down (a reboot resets /sys; a rank's counter file
   goes away with a new metrics dir) is a reset: the increase counts from zero, as in
   Prometheus' ``rate()``.
3. /sys counts from boot: a drive's lifetime writes before this boot are unknown to the
   kernel (NVMe keeps them in its SMART log, "Data Units Written", which only ``nvme
   smart-log`` with device access reads). The projection therefore assumes the drive had
   written nothing before this boot::

       days_left = (TBW * 1e12 - written_since_boot) / (bytes_per_second * 86400)

   It is an upper bound: the true figure is lower by the lifetime writes before boot divided
   by the same daily rate. With no writes in the window, days_left is +Inf. TBW is per drive;
   ``--ssd-tbw`` applies the same rating to every device found under the spill roots.
4. A partition is charged to its disk, and a device-mapper or md device to the disks beneath
   it (``slaves/``): endurance belongs to the physical drive. Which device holds a spill root
   is decided as the ranks decide their ``device`` label (NOTE [Block device of a path] in
   tba/storage/blockdev.py); a stacked device's tba bytes are split evenly over its disks.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os

from ..storage.blockdev import SYS, block_device, disk_of, nearest_existing, physical_disks

__all__ = [
    "RateWindow",
    "charge_by_disk",
    "disks_for_path",
    "disk_of",
    "days_left",
    "sectors_written_bytes",
    "SECTOR_BYTES",
]

SECTOR_BYTES = 512
SECONDS_PER_DAY = 86400.0


def disks_for_path(path: str) -> tuple[list[str], str]:
    """The physical disks under ``path`` (or its nearest existing parent: a spill root may not
    be made yet), and, when none are found, why (tmpfs, overlay, no /sys). The device is found
    as the ranks' metrics find it (NOTE [Block device of a path] in tba/storage/blockdev.py),
    so the ``device`` labels of their byte counters join onto these disks
    (:func:`charge_by_disk`)."""
    found = block_device(nearest_existing(path))
    return list(found.disks), found.why


def charge_by_disk(by_label: dict[str, float]) -> dict[str, float]:
    """The ranks' bytes per ``device`` label, charged to the physical disks beneath each label.

    A label is a whole disk or a stacked device (``dm-0``, ``md0``); a stacked device's bytes
    are split evenly over its disks, as striping spreads them (a mirror writes each disk in
    full, so there tba's share is a lower bound). "unknown" or empty labels stay as they are.
    """
    out: dict[str, float] = {}
    for label, value in by_label.items():
        disks = physical_disks(disk_of(label)) if label and label != "unknown" else [label]
        for d in disks:
            out[d] = out.get(d, 0.0) + value / len(disks)
    return out


def sectors_written_bytes(disk: str) -> int:
    """Bytes written to ``disk`` since boot (``/sys/block/<disk>/stat`` field 7 x 512)."""
    with open(os.path.join(SYS, "block", disk, "stat")) as f:
        fields = f.read().split()
    return int(fields[6]) * SECTOR_BYTES


def days_left(tbw_tb: float, written_bytes: float, bytes_per_second: float) -> float:
    """Days until ``tbw_tb`` terabytes are written, at ``bytes_per_second`` (see the NOTE)."""
    remaining = max(tbw_tb * 1e12 - written_bytes, 0.0)
    if bytes_per_second <= 0:
        return math.inf
    return remaining / (bytes_per_second * SECONDS_PER_DAY)


@dataclasses.dataclass
class RateWindow:
    """Samples of a counter over the last ``window`` seconds; :meth:`rate` is bytes/second."""

    window: float
    samples: collections.deque = dataclasses.field(default_factory=collections.deque)

    def add(self, t: float, value: float) -> None:
        self.samples.append((t, value))
        # Keep one sample at or before the window's start, so the span covers the window.
        while len(self.samples) > 2 and self.samples[1][0] <= t - self.window:
            self.samples.popleft()

    def span(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        return self.samples[-1][0] - self.samples[0][0]

    def increase(self) -> float:
        total = 0.0
        prev = None
        for _t, v in self.samples:
            if prev is not None:
                total += v - prev if v >= prev else v  # a drop is a reset to zero
            prev = v
        return total

    def rate(self) -> float | None:
        span = self.span()
        return self.increase() / span if span > 0 else None
