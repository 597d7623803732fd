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
   it (``slaves/``): endurance belongs to the physical drive.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os

__all__ = [
    "RateWindow",
    "disks_for_path",
    "disk_of",
    "days_left",
    "sectors_written_bytes",
    "SECTOR_BYTES",
]

SECTOR_BYTES = 512
SYS = "/sys"
SECONDS_PER_DAY = 86400.0


def disk_of(name: str) -> str:
    """The whole disk a block device belongs to: ``nvme0n1p2`` -> ``nvme0n1``; ``/dev/`` is
    stripped. Unknown names come back as they are."""
    name = os.path.basename(name.strip())
    base = os.path.join(SYS, "class", "block", name)
    if os.path.exists(os.path.join(base, "partition")):
        return os.path.basename(os.path.dirname(os.path.realpath(base)))
    return name


def _physical(disk: str, depth: int = 0) -> list[str]:
    slaves_dir = os.path.join(SYS, "class", "block", disk, "slaves")
    try:
        slaves = sorted(os.listdir(slaves_dir))
    except OSError:
        slaves = []
    if not slaves or depth > 8:
        return [disk]
    out: list[str] = []
    for s in slaves:
        for d in _physical(disk_of(s), depth + 1):
            if d not in out:
                out.append(d)
    return out


def _mount_source_dev(path: str) -> int | None:
    """st_rdev of the /dev node mounted at the longest mount point containing ``path``."""
    best, source = "", None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                parts, rparts = left.split(), right.split()
                if len(parts) < 5 or len(rparts) < 2:
                    continue
                mnt = parts[4].replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, source = mnt, rparts[1]
    except OSError:
        return None
    if not source or not source.startswith("/dev/"):
        return None
    try:
        return os.stat(source).st_rdev
    except OSError:
        return None


def disks_for_path(path: str) -> tuple[list[str], str]:
    """The physical disks under ``path`` (or its nearest existing parent), and, when none are
    found, why (tmpfs, overlay, no /sys)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        dev = os.stat(probe).st_dev
    except OSError as e:
        return [], f"cannot stat {probe}: {os.strerror(e.errno or 0)}"
    if os.major(dev) == 0:  # tmpfs, overlay, btrfs subvolumes: anonymous device numbers
        rdev = _mount_source_dev(os.path.realpath(probe))
        if rdev is None:
            return [], (
                f"{probe} is not on a block device (tmpfs, overlay or a network filesystem?); "
                "spill to a local NVMe drive"
            )
        dev = rdev
    node = os.path.join(SYS, "dev", "block", f"{os.major(dev)}:{os.minor(dev)}")
    if not os.path.exists(node):
        return [], f"{node} does not exist (is /sys mounted?)"
    real = os.path.realpath(node)
    disk = os.path.basename(real)
    if os.path.exists(os.path.join(real, "partition")):
        disk = os.path.basename(os.path.dirname(real))
    return _physical(disk), ""


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
