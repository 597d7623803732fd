"""What the sidecar sees under a spill root: the per-process directories, whether their
owners live, the filesystem's free space, and the node quota ledger.

Directory names, the liveness test and the open flags come from :mod:`tba.storage.spilldir`
(NOTE [Spill directory safety]); nothing here creates, locks or removes anything.

A rank holds ``flock`` on its directory while it lives. The sidecar learns which directories
are locked from ``/proc/locks`` instead of trying the lock itself: a lock attempt, however
brief, could make a rank that is just starting fail its own ``flock``.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
from typing import Any

from ..storage import nodequota
from ..storage.spilldir import DIR_FLAGS, dir_name_pattern, host_tag, pid_alive

__all__ = ["RootScan", "SpillEntry", "flock_holders", "ledger_status", "scan_root"]


def flock_holders(path: str = "/proc/locks") -> dict[tuple[int, int], int]:
    """``{(st_dev, st_ino): pid}`` for every FLOCK lock on the system. The pid is as this
    process's pid namespace sees it, 0 when the holder is not visible from here."""
    out: dict[tuple[int, int], int] = {}
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 12388 fe:00:15343662 0 EOF"; "->" marks a blocked waiter
        if len(parts) < 6 or parts[1] != "FLOCK":
            continue
        try:
            pid = int(parts[4])
            major, minor, ino = parts[5].split(":")
            dev = os.makedev(int(major, 16), int(minor, 16))
            out[(dev, int(ino))] = pid
        except ValueError:
            continue
    return out


@dataclasses.dataclass
class SpillEntry:
    name: str
    host: str
    pid: int
    rank: int
    kind: str  # "dir", "symlink" or "other" (never opened unless "dir")
    locked: bool  # a process holds flock on it (so it lives, in whatever pid namespace)
    lock_pid: int | None  # the holder's pid as we see it (0: not visible from here)
    pid_alive: bool | None  # kill(pid, 0) from here; None for another host's directory
    empty: bool | None  # only checked for directories whose owner is gone

    @property
    def ours(self) -> bool:
        return self.host == host_tag()

    @property
    def alive(self) -> bool | None:
        if self.locked:
            return True
        return self.pid_alive


@dataclasses.dataclass
class RootScan:
    root: str
    problem: str  # "" when the root is a usable directory
    entries: list[SpillEntry]
    size_bytes: int | None = None
    free_bytes: int | None = None  # available to unprivileged users (f_bavail)
    used_bytes: int | None = None
    ledger: Any = None


def _empty(root_fd: int, name: str) -> bool | None:
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=root_fd)
    except OSError:
        return None
    try:
        return not os.listdir(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def scan_root(root: str, locks: dict[tuple[int, int], int]) -> RootScan:
    """Blocking: run it in an executor."""
    try:
        root_fd = os.open(root, DIR_FLAGS)
    except OSError as e:
        if e.errno == errno.ENOENT:
            why = "does not exist yet (the first rank creates it)"
        elif e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(root):
            why = (
                "is a symbolic link; tba never follows symlinks in spill roots: point "
                "--spill-dir/TBA_SPILL_DIR at the real directory"
            )
        else:
            why = f"cannot be opened: {os.strerror(e.errno or 0)}"
        return RootScan(root, f"{root} {why}", [])
    try:
        vfs = os.fstatvfs(root_fd)
        scan = RootScan(
            root,
            "",
            [],
            size_bytes=vfs.f_blocks * vfs.f_frsize,
            free_bytes=vfs.f_bavail * vfs.f_frsize,
            used_bytes=(vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize,
        )
        me = host_tag()
        pattern = dir_name_pattern()
        for name in sorted(os.listdir(root_fd)):
            m = pattern.match(name)
            if m is None:
                continue
            try:
                st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            except OSError:
                continue
            kind = (
                "dir"
                if stat.S_ISDIR(st.st_mode)
                else "symlink"
                if stat.S_ISLNK(st.st_mode)
                else "other"
            )
            lock_pid = locks.get((st.st_dev, st.st_ino)) if kind == "dir" else None
            pid = int(m.group("pid"))
            host = m.group("host")
            entry = SpillEntry(
                name=name,
                host=host,
                pid=pid,
                rank=int(m.group("rank")),
                kind=kind,
                locked=lock_pid is not None,
                lock_pid=lock_pid,
                pid_alive=pid_alive(pid) if host == me else None,
                empty=None,
            )
            if kind == "dir" and not entry.locked and entry.pid_alive is False:
                entry.empty = _empty(root_fd, name)
            scan.entries.append(entry)
    finally:
        os.close(root_fd)
    scan.ledger = ledger_status(root)
    return scan


def ledger_status(root: str) -> dict[str, Any]:
    """The node quota ledger under ``root``, as a JSON-able dict with ``available`` and, when
    it could be read, what :func:`tba.storage.nodequota.read_ledger` returned."""
    try:
        value = nodequota.read_ledger(root)
    except Exception as e:  # the ledger is another component's file: report, never fail a scan
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}
    if value is None:
        return {"available": False, "reason": "no ledger: TBA_NODE_MAX_DISK_BYTES is not in use"}
    return {"available": True, "ledger": _plain(value)}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
