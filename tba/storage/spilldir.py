"""The spill directory: a root shared by every process, and one 0700 directory per process.

NOTE [Spill directory safety]
1. The root (``TBA_SPILL_DIR``) is created with mode 0700 when missing, parents included. An
   existing root is never chmod-ed. The root and every component we create must not be a
   symbolic link: we ``lstat`` it and open it with ``O_DIRECTORY | O_NOFOLLOW``.
2. Each process makes ``<host>-<pid>-rank<r>`` (``.<n>`` appended for a second backend in the
   same process) with ``mkdir`` relative to the root's fd, then checks it with ``fstat``: a
   directory, owned by us, mode 0700. Every later file operation is relative to its fd, so a
   rename of the path cannot redirect our files.
3. The process holds ``flock(LOCK_EX)`` on its directory while it lives. The sweep of stale
   directories removes an entry only when its name is ours (this host), its pid is dead (or is
   our own pid but not one of our directories), it is a real directory, its lock is free, and it
   is empty: ``rmdir`` cannot delete anything else. Nothing else in the root is touched.
4. Slab files have no name (O_TMPFILE, or unlinked right after open), so the directory stays
   empty and even SIGKILL leaves no bytes behind; at worst an empty directory for the sweep.
5. The root may also hold ``.tba-node-quota``, the node quota ledger (NOTE [Node quota] in
   nodequota.py). It is a file and matches no per-process name: the sweep never touches it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import socket
import stat
import threading

from ..errors import ConfigError

__all__ = ["DIR_FLAGS", "SpillDir", "dir_name_pattern", "host_tag", "pid_alive", "sweep_stale"]

log = logging.getLogger("tba.storage")

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # no symlink, no FIFO
_NAME_RE = re.compile(r"^(?P<host>.+)-(?P<pid>\d+)-rank(?P<rank>\d+)(?:\.(?P<seq>\d+))?$")

# Per-process directories this process made and still holds, as (root dev, root ino, name).
_ours: set[tuple[int, int, str]] = set()
_ours_lock = threading.Lock()


def host_tag() -> str:
    """The host name as it appears in directory names (path-safe characters only)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"


def dir_name_pattern() -> re.Pattern[str]:
    return _NAME_RE


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # never "dead": os.kill(0, ...) would mean our process group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _symlink_error(path: str) -> ConfigError:
    try:
        target = os.readlink(path)
        where = f" (it points to {target})"
    except OSError:
        where = ""
    return ConfigError(
        f"TBA_SPILL_DIR: {path} is a symbolic link{where}; tba does not follow symbolic links in "
        "its spill directory, so that nobody can redirect the spill files. Set TBA_SPILL_DIR to "
        "a real directory on a local disk."
    )


def _open_dir(path: str, dir_fd: int | None = None, shown: str | None = None) -> int:
    shown = shown or path
    try:
        return os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        is_link = e.errno == errno.ELOOP
        if e.errno == errno.ENOTDIR:  # O_NOFOLLOW | O_DIRECTORY on a symlink gives ENOTDIR
            try:
                st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
                is_link = stat.S_ISLNK(st.st_mode)
            except OSError:
                pass
        if is_link:
            raise _symlink_error(shown) from None
        if e.errno == errno.ENOTDIR:
            raise ConfigError(
                f"TBA_SPILL_DIR: {shown} is not a directory. Set TBA_SPILL_DIR to a directory on "
                "a local disk."
            ) from None
        raise ConfigError(
            f"TBA_SPILL_DIR: cannot open {shown}: {os.strerror(e.errno or 0)}. Set TBA_SPILL_DIR "
            "to a writable directory on a local disk."
        ) from None


def _make_root(root: str) -> int:
    """Create ``root`` (0700 for every component we create) and return an fd on it."""
    missing: list[str] = []
    path = root
    while True:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            missing.append(path)
            parent = os.path.dirname(path)
            if parent == path:  # pragma: no cover - "/" always exists
                break
            path = parent
            continue
        except OSError as e:
            raise ConfigError(
                f"TBA_SPILL_DIR: cannot inspect {path}: {os.strerror(e.errno or 0)}. Set "
                "TBA_SPILL_DIR to a writable directory on a local disk."
            ) from None
        if stat.S_ISLNK(st.st_mode) and path == root:
            raise _symlink_error(path)
        break
    for comp in reversed(missing):
        try:
            os.mkdir(comp, 0o700)
            created = True
        except FileExistsError:
            created = False  # another rank made it first: check it, but leave its mode alone
        except OSError as e:
            raise ConfigError(
                f"TBA_SPILL_DIR: cannot create {comp}: {os.strerror(e.errno or 0)}. Set "
                "TBA_SPILL_DIR to a writable directory on a local disk."
            ) from None
        fd = _open_dir(comp)  # O_NOFOLLOW: refuses a symlink swapped in after the mkdir
        try:
            if created:
                os.fchmod(fd, 0o700)  # mkdir's mode went through the umask
        finally:
            os.close(fd)
    return _open_dir(root)


class SpillDir:
    """The per-process directory under ``root``. :meth:`close` removes it."""

    def __init__(self, root: str, rank: int):
        self.root = os.path.abspath(root)
        self._root_fd = _make_root(self.root)
        try:
            rst = os.fstat(self._root_fd)
            if rst.st_uid != os.geteuid() and rst.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                log.warning(
                    "tba.storage: spill root %s is writable by other users and not ours; our "
                    "per-process directory inside it is 0700",
                    self.root,
                )
            self._root_key = (rst.st_dev, rst.st_ino)
            sweep_stale(self._root_fd, self.root, self._root_key)
            self.name, self.fd = self._make_own(rank)
        except BaseException:
            os.close(self._root_fd)
            raise
        self.path = os.path.join(self.root, self.name)
        self._closed = False

    @property
    def root_fd(self) -> int:
        """An fd on the root, open while this lives (for files next to the per-process dirs)."""
        return self._root_fd

    def _make_own(self, rank: int) -> tuple[str, int]:
        base = f"{host_tag()}-{os.getpid()}-rank{rank}"
        for seq in range(10_000):
            name = base if seq == 0 else f"{base}.{seq}"
            try:
                os.mkdir(name, 0o700, dir_fd=self._root_fd)
            except FileExistsError:
                continue  # another backend of this process, or a leftover with our pid
            except OSError as e:
                raise ConfigError(
                    f"TBA_SPILL_DIR: cannot create {os.path.join(self.root, name)}: "
                    f"{os.strerror(e.errno or 0)}. Set TBA_SPILL_DIR to a writable directory on "
                    "a local disk."
                ) from None
            shown = os.path.join(self.root, name)
            fd = _open_dir(name, dir_fd=self._root_fd, shown=shown)
            try:
                st = os.fstat(fd)
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                    raise ConfigError(
                        f"TBA_SPILL_DIR: {shown} was replaced by something that is not our "
                        "directory right after we made it. Use a spill directory that only you "
                        "can write to."
                    )
                os.fchmod(fd, 0o700)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BaseException:
                os.close(fd)
                raise
            with _ours_lock:
                _ours.add((*self._root_key, name))
            return name, fd
        raise ConfigError(  # pragma: no cover - needs 10,000 live backends in one process
            f"TBA_SPILL_DIR: too many per-process directories named {base}.* in {self.root}."
        )

    def close(self) -> None:
        """Remove the per-process directory (it is empty: slab files have no names)."""
        if self._closed:
            return
        self._closed = True
        try:
            os.rmdir(self.name, dir_fd=self._root_fd)
        except OSError as e:
            # ENOENT: removed from outside while tba ran (rm -rf of TBA_SPILL_DIR): nothing is
            # left behind, and a refusal it caused has had its one warning (NOTE [Slabs] 5).
            level = logging.DEBUG if e.errno == errno.ENOENT else logging.WARNING
            log.log(level, "tba.storage: could not remove %s: %s", self.path, os.strerror(e.errno))
        finally:
            with _ours_lock:
                _ours.discard((*self._root_key, self.name))
            os.close(self.fd)
            os.close(self._root_fd)


def sweep_stale(root_fd: int, root: str, root_key: tuple[int, int]) -> list[str]:
    """Remove the empty per-process directories of dead processes of this host. See the NOTE."""
    removed: list[str] = []
    host = host_tag()
    me = os.getpid()
    try:
        names = os.listdir(root_fd)
    except OSError:
        return removed
    for name in names:
        m = _NAME_RE.match(name)
        if m is None or m.group("host") != host:
            continue
        pid = int(m.group("pid"))
        if pid == me:
            with _ours_lock:
                if (*root_key, name) in _ours:
                    continue
        elif pid_alive(pid):
            continue
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=root_fd)
        except OSError:
            continue  # a symlink (ELOOP), not a directory, or gone: not ours to touch
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live process holds it (e.g. another pid namespace)
            try:
                os.rmdir(name, dir_fd=root_fd)  # fails unless empty; never follows symlinks
            except OSError:
                continue
            removed.append(name)
            log.info("tba.storage: removed stale empty spill directory %s", f"{root}/{name}")
        finally:
            os.close(fd)
    return removed
