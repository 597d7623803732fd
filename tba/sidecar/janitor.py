"""The janitor: reclaims what dead ranks leave behind, and nothing else.

NOTE [Janitor safety]
1. Metrics files. A dead process's ``gauge_live*_<pid>.db`` files are removed by
   prometheus-client's ``mark_process_dead(pid, path)``, so its live gauges (resident bytes,
   staging, disk in use) stop being reported. Counter, histogram and non-live gauge files stay:
   a rank's totals must not drop when it exits. A pid is dead when ``kill(pid, 0)`` says so,
   it is not the sidecar's own, and no spill directory of that pid is locked (a lock means a
   live owner, whatever we see of its pid). Its files must also be held by nobody: the janitor
   takes and at once drops a write lease on each (``F_SETLEASE``), which the kernel grants
   only when no other process has the file open or mapped, in any pid namespace; a file in use
   waits for a later pass. (Someone opening the file during those microseconds breaks the
   lease: the kernel then signals SIGIO, which ``tba sidecar`` ignores.) Each candidate is
   ``lstat``-ed right before the call; a name that is not a regular file (a symlink) is
   refused, never removed or followed.
2. Spill directories. :func:`tba.storage.spilldir.sweep_stale` does the removal, with the
   rules of NOTE [Spill directory safety]: this host's name, dead pid, a real directory, its
   flock free, and empty (``rmdir``). A dead owner's directory that still holds files, and a
   symlink or a non-directory carrying a rank's name, are refused and reported, once each.
3. Pid namespaces. Liveness by pid only works when the sidecar sees the ranks' pids. When a
   spill directory is locked by a process whose pid the sidecar cannot see, the sidecar runs in
   another pid namespace (a Kubernetes pod without ``shareProcessNamespace: true``): the
   janitor then removes nothing at all until that changes, and says why in ``/status``.
4. Only the configured metrics directory and spill roots are ever listed; every removal is
   logged (event ``janitor_removed``) and counted in ``tba_janitor_removed_total{kind}``.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import stat

from prometheus_client.multiprocess import mark_process_dead

from ..storage.spilldir import DIR_FLAGS, pid_alive, sweep_stale
from .jsonlog import event
from .rankfiles import LIVE_GAUGE_MODES, DirReading, parse_name
from .spill import RootScan

__all__ = ["Janitor", "JanitorReport", "KINDS", "REFUSALS", "pid_namespace_problem"]

KINDS = ("metrics_file", "spill_dir")
# (kind, reason) of every refusal; each series exists from the start, at 0.
REFUSALS = (
    ("metrics_file", "not_regular"),
    ("spill_dir", "symlink"),
    ("spill_dir", "not_directory"),
    ("spill_dir", "not_empty"),
)


@dataclasses.dataclass
class JanitorReport:
    removed: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (kind, path)
    refused: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # kind, why, path
    paused: str = ""


def pid_namespace_problem(roots: list[RootScan]) -> str:
    """Why pid liveness cannot be trusted from here, or "" (NOTE [Janitor safety] rule 3)."""
    for r in roots:
        for e in r.entries:
            if e.ours and e.locked and (e.pid_alive is False or e.lock_pid == 0):
                return (
                    f"{os.path.join(r.root, e.name)} is locked by a process this sidecar cannot "
                    f"see (pid {e.pid} is not visible here): run the sidecar in the ranks' pid "
                    "namespace (Kubernetes: shareProcessNamespace: true in the pod spec). "
                    "Reclaiming is paused so that no live rank loses files."
                )
    return ""


class Janitor:
    """Counters and the reclaim pass. :meth:`run` blocks: call it from an executor."""

    def __init__(self, metrics_dir: str, enabled: bool = True):
        self.metrics_dir = metrics_dir
        self.enabled = enabled
        self.runs = 0
        self.removed = dict.fromkeys(KINDS, 0)
        self.refused: dict[tuple[str, str], int] = dict.fromkeys(REFUSALS, 0)
        self.paused = ""
        self._refused_seen: set[tuple[str, str]] = set()
        self._lease_warned = False

    def run(self, reading: DirReading | None, roots: list[RootScan]) -> JanitorReport:
        report = JanitorReport()
        self.runs += 1
        if not self.enabled:
            report.paused = "disabled (--no-janitor)"
            self.paused = report.paused
            return report
        report.paused = pid_namespace_problem(roots)
        if report.paused != self.paused and report.paused:
            event(logging.WARNING, "janitor_paused", reason=report.paused)
        elif self.paused and not report.paused:
            event(logging.INFO, "janitor_resumed")
        self.paused = report.paused
        if report.paused:
            return report
        locked = {e.pid for r in roots for e in r.entries if e.ours and e.locked}
        if reading is not None:
            self._metrics(reading, locked, report)
        for r in roots:
            if not r.problem:
                self._spill(r, report)
        # Forget what is no longer there, so that it is logged again if it comes back.
        self._refused_seen &= {(k, p) for k, _, p in report.refused}
        return report

    # -- NOTE rule 1 -----------------------------------------------------------------------------
    def _metrics(self, reading: DirReading, locked: set[int], report: JanitorReport) -> None:
        me = os.getpid()
        pids = {f.pid for f in reading.files if f.live_gauge and f.pid is not None}
        for n in reading.odd:  # a symlink named like a live gauge: refused below
            parsed = parse_name(n)
            if parsed and parsed[0] == "gauge" and parsed[1] in LIVE_GAUGE_MODES and parsed[2]:
                pids.add(parsed[2])
        for pid in sorted(pids):
            if pid == me or pid in locked or pid_alive(pid):
                continue
            names = [f.name for f in reading.files if f.pid == pid and f.live_gauge]
            odd = [
                n for n in reading.odd if n.startswith("gauge_live") and n.endswith(f"_{pid}.db")
            ]
            odd += [n for n in names if not self._regular(n)]
            if odd:
                for n in odd:
                    self._refuse(
                        report,
                        "metrics_file",
                        "not_regular",
                        os.path.join(self.metrics_dir, n),
                        "not a regular file (a symlink is never followed or removed)",
                    )
                continue
            busy = [n for n in names if self._in_use(n)]
            if busy:
                event(logging.DEBUG, "janitor_in_use", pid=pid, files=busy)
                continue  # a process that we cannot see still maps it: rule 1
            mark_process_dead(pid, self.metrics_dir)
            for n in names:
                path = os.path.join(self.metrics_dir, n)
                if not os.path.lexists(path):
                    self._removed(report, "metrics_file", path, pid=pid)

    def _in_use(self, name: str) -> bool:
        """Whether any process has the file open or mapped: a write lease is granted only on a
        file nobody else holds (fcntl(2), F_SETLEASE), whatever pid namespace they are in."""
        try:
            fd = os.open(
                os.path.join(self.metrics_dir, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
            )
        except FileNotFoundError:
            return False
        except OSError:
            return True  # a symlink (ELOOP) or unreadable: not ours to judge
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EBUSY):
                return True
            if not self._lease_warned:  # leases disabled (fs.leases-enable=0) or unsupported
                self._lease_warned = True
                event(logging.WARNING, "janitor_no_leases", error=os.strerror(e.errno or 0))
            return False  # fall back to the pid test alone
        else:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            return False
        finally:
            os.close(fd)

    def _regular(self, name: str) -> bool:
        try:
            st = os.lstat(os.path.join(self.metrics_dir, name))
        except FileNotFoundError:
            return True  # already gone: nothing to refuse
        return stat.S_ISREG(st.st_mode)

    # -- NOTE rule 2 -----------------------------------------------------------------------------
    def _spill(self, scan: RootScan, report: JanitorReport) -> None:
        try:
            root_fd = os.open(scan.root, DIR_FLAGS)
        except OSError:
            return  # gone or replaced since the scan: the next scan reports it
        try:
            st = os.fstat(root_fd)
            removed = sweep_stale(root_fd, scan.root, (st.st_dev, st.st_ino))
        finally:
            os.close(root_fd)
        gone = set(removed)
        for name in removed:
            self._removed(report, "spill_dir", os.path.join(scan.root, name))
        for e in scan.entries:
            if not e.ours or e.name in gone or e.locked or e.pid_alive is not False:
                continue
            path = os.path.join(scan.root, e.name)
            if e.kind == "symlink":
                self._refuse(
                    report, "spill_dir", "symlink", path, "a symbolic link: never followed"
                )
            elif e.kind != "dir":
                self._refuse(report, "spill_dir", "not_directory", path, "not a directory")
            elif e.empty is False:
                self._refuse(
                    report,
                    "spill_dir",
                    "not_empty",
                    path,
                    "its owner is dead but it holds files (tba's slab files have no names): "
                    "check them and remove the directory by hand",
                )

    # -- bookkeeping -----------------------------------------------------------------------------
    def _removed(self, report: JanitorReport, kind: str, path: str, **fields) -> None:
        self.removed[kind] += 1
        report.removed.append((kind, path))
        event(logging.INFO, "janitor_removed", kind=kind, path=path, **fields)

    def _refuse(self, report: JanitorReport, kind: str, reason: str, path: str, why: str) -> None:
        """Report ``path``; count and log it the first time it is seen (while it stays)."""
        report.refused.append((kind, why, path))
        if (kind, path) in self._refused_seen:
            return
        self._refused_seen.add((kind, path))
        self.refused[(kind, reason)] = self.refused.get((kind, reason), 0) + 1
        event(logging.WARNING, "janitor_refused", kind=kind, path=path, reason=reason, why=why)
