"""Which block device holds a path: one answer for the metrics' ``device`` label, the sidecar's
endurance figures and ``tba doctor``'s filesystem row (the sidecar joins the first two on it).

# NOTE [Block device of a path]
:func:`block_device` follows one rule:

1. ``os.stat(path).st_dev`` names the filesystem. A path that does not exist has no device
   (callers that want the nearest existing parent, like the sidecar for a spill root not yet
   made, walk up first: :func:`nearest_existing`).
2. The mount: the ``/proc/self/mountinfo`` line with that device number whose mount point is
   the longest one containing the path; when no line has that number (a btrfs subvolume's
   anonymous number), the longest containing mount point. It gives the source (``/dev/vda2``,
   ``tmpfs``) and the mount point.
3. The device: ``/sys/dev/block/<major>:<minor>`` of ``st_dev`` when it exists; else (tmpfs,
   overlay, btrfs: anonymous numbers with major 0) that of the mount source's ``st_rdev`` when
   the source is a ``/dev`` block node. None otherwise: the path is on no block device.
4. A partition is named by its disk (``nvme0n1p2`` -> ``nvme0n1``); a stacked device
   (device-mapper, md) by its own name (``dm-0``), whose physical disks, found through
   ``slaves/`` recursively, are :attr:`BlockDevice.disks` (endurance belongs to the drive).

Only the standard library: the sidecar imports this and must not load torch.
"""

from __future__ import annotations

import dataclasses
import os
import stat

__all__ = ["BlockDevice", "block_device", "disk_of", "physical_disks", "nearest_existing"]

SYS = "/sys"
MOUNTINFO = "/proc/self/mountinfo"
_MAX_DEPTH = 8  # slaves/ nesting followed at most (dm on md on partitions is 3)


@dataclasses.dataclass(frozen=True)
class BlockDevice:
    path: str  # the path asked about, absolute
    device: str | None  # as /sys/block names it: "nvme0n1", "vda", "dm-0"; None: no block device
    disks: tuple[str, ...]  # the physical disks beneath ``device`` (itself when not stacked)
    source: str | None  # the mount's source as mountinfo names it: "/dev/vda2", "tmpfs"
    mount_point: str | None
    why: str  # when ``device`` is None: why, with the fix

    @property
    def label(self) -> str:
        """The metrics' ``device`` label: the device, or "unknown"."""
        return self.device or "unknown"


def block_device(path: str) -> BlockDevice:
    """The block device holding ``path`` (NOTE [Block device of a path])."""
    path = os.path.abspath(path)
    try:
        dev = os.stat(path).st_dev
    except OSError as e:
        why = f"cannot stat {path}: {os.strerror(e.errno or 0)}"
        return BlockDevice(path, None, (), None, None, why)
    source, mount_point = _mount_of(os.path.realpath(path), dev)
    name = _sysfs_disk(dev)
    if name is None and source is not None and source.startswith("/dev/"):
        try:
            st = os.stat(source)
        except OSError:
            st = None
        if st is not None and stat.S_ISBLK(st.st_mode):
            name = _sysfs_disk(st.st_rdev)
    if name is None:
        if os.major(dev) == 0:
            why = (
                f"{path} is not on a block device (tmpfs, overlay or a network filesystem?); "
                "spill to a local NVMe drive"
            )
        else:
            node = os.path.join(SYS, "dev", "block", f"{os.major(dev)}:{os.minor(dev)}")
            why = f"{node} does not exist (is /sys mounted?)"
        return BlockDevice(path, None, (), source, mount_point, why)
    return BlockDevice(path, name, tuple(physical_disks(name)), source, mount_point, "")


def nearest_existing(path: str) -> str:
    """``path`` made absolute, or its nearest parent that exists."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return probe


def disk_of(name: str) -> str:
    """The whole disk a block device belongs to: ``nvme0n1p2`` -> ``nvme0n1``; ``/dev/`` is
    stripped. Unknown names come back as they are."""
    name = os.path.basename(name.strip())
    base = os.path.join(SYS, "class", "block", name)
    if os.path.exists(os.path.join(base, "partition")):
        return os.path.basename(os.path.dirname(os.path.realpath(base)))
    return name


def physical_disks(name: str, depth: int = 0) -> list[str]:
    """The disks beneath block device ``name`` through ``slaves/`` (itself when it has none)."""
    slaves_dir = os.path.join(SYS, "class", "block", name, "slaves")
    try:
        slaves = sorted(os.listdir(slaves_dir))
    except OSError:
        slaves = []
    if not slaves or depth > _MAX_DEPTH:
        return [name]
    out: list[str] = []
    for s in slaves:
        for d in physical_disks(disk_of(s), depth + 1):
            if d not in out:
                out.append(d)
    return out


def _sysfs_disk(dev: int) -> str | None:
    """The disk (not the partition) behind device number ``dev``, as /sys/block names it."""
    try:
        real = os.path.realpath(
            os.path.join(SYS, "dev", "block", f"{os.major(dev)}:{os.minor(dev)}"), strict=True
        )
    except OSError:
        return None
    if os.path.exists(os.path.join(real, "partition")):
        real = os.path.dirname(real)
    return os.path.basename(real)


def _mount_of(real: str, dev: int) -> tuple[str | None, str | None]:
    """(source, mount point) of the mount holding ``real`` (rule 2 of the NOTE)."""
    try:
        with open(MOUNTINFO) as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    want = f"{os.major(dev)}:{os.minor(dev)}"
    by_dev: tuple[int, str | None, str | None] = (-1, None, None)
    by_path: tuple[int, str | None, str | None] = (-1, None, None)
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 2:
            continue
        mp = fields[4].replace("\\040", " ")
        if not (real == mp or real.startswith(mp.rstrip("/") + "/")):
            continue
        # >=: of mounts stacked on one point, the last listed is the one visible
        if fields[2] == want and len(mp) >= by_dev[0]:
            by_dev = (len(mp), rest[1], mp)
        if len(mp) >= by_path[0]:
            by_path = (len(mp), rest[1], mp)
    best = by_dev if by_dev[0] >= 0 else by_path
    return best[1], best[2]
