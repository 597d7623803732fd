"""The node-wide spill quota (``TBA_NODE_MAX_DISK_BYTES``): one ledger file that every tba
process spilling under the same root reads and updates under ``flock``.

NOTE [Node quota]
1. The ledger is ``<spill root>/.tba-node-quota``: a regular file, mode 0600, always opened
   relative to the root's fd with ``O_NOFOLLOW`` (a symlink there is refused, never followed).
   Its name matches no per-process directory and it is not a directory, so the sweep of stale
   directories leaves it alone (NOTE [Spill directory safety] in spilldir.py).
2. Every change is read, drop the dead entries, decide, write back, all under
   ``flock(LOCK_EX)``. :func:`read_ledger` takes ``LOCK_SH`` and changes nothing.
3. An entry is the slab set of one backend: its per-process directory name (``dir``, the key),
   ``host``, ``pid``, ``rank`` and ``bytes``, the sum of its slab sizes (fallocated space, what
   the quota limits). Growth is recorded *before* the fallocate, shrinkage *after* the slabs
   are closed, so the live entries never sum to less than what is allocated on disk.
4. An entry is live while its per-process directory exists and is locked: its owner holds
   ``flock(LOCK_EX)`` on it for as long as it lives (NOTE [Spill directory safety] 3). That test
   needs no pid and survives pid reuse and pid namespaces. When the directory cannot be
   opened (EACCES: a reader running as another user), an entry of this host is live while its
   pid is; an entry of another host is always counted. Readers ignore dead entries and the
   next writer drops them, so a SIGKILLed process's reservation is freed at the next change.
5. Format: one JSON object and a newline::

       {"version": 1, "limit": <bytes or null>, "entries": [{"dir": "h-12-rank0",
        "host": "h", "pid": 12, "rank": 0, "bytes": 1073741824, "updated": <unix time>}]}

   ``limit`` is the TBA_NODE_MAX_DISK_BYTES of the last writer. A write is one ``pwrite`` at
   offset 0 and then a truncate to its length: a SIGKILL between the two leaves a whole
   document followed by stale bytes, which the parser ignores.
6. Room to grow = limit - the other live entries - our own bytes. First come, first served: a
   process keeps its slabs (freed extents are reused) and gives empty slabs back when it is
   itself short of room and at close. Every process applies its own limit, so set the same
   TBA_NODE_MAX_DISK_BYTES on every rank. The ``memory`` backend writes nothing and takes no
   part.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import time
from collections.abc import Iterator
from typing import Any

from ..config import format_size
from ..errors import ConfigError, TBAError
from .spilldir import _pid_alive, dir_name_pattern, host_tag

__all__ = ["LEDGER_NAME", "NodeQuota", "read_ledger"]

log = logging.getLogger("tba.storage")

LEDGER_NAME = ".tba-node-quota"
_VERSION = 1
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _entry_alive(root_fd: int, entry: dict[str, Any]) -> bool:
    """NOTE 4: the entry's directory exists and someone holds its lock."""
    try:
        fd = os.open(entry["dir"], _DIR_FLAGS, dir_fd=root_fd)
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            return False  # a symlink or a file in its place: no tba process owns it
        if entry["host"] != host_tag():
            return True
        return _pid_alive(entry["pid"])
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True  # its owner holds it (or a sweep looks at it right now: count it)
    finally:
        os.close(fd)  # also drops our shared lock
    return False


def _valid_entry(item: Any) -> bool:
    if not isinstance(item, dict):
        return False
    name = item.get("dir")
    ints = all(
        isinstance(item.get(k), int) and not isinstance(item.get(k), bool)
        for k in ("pid", "rank", "bytes")
    )
    return (
        isinstance(name, str)
        and "/" not in name
        and dir_name_pattern().match(name) is not None
        and isinstance(item.get("host"), str)
        and ints
        and item["bytes"] >= 0
    )


def _parse(data: bytes, shown: str) -> tuple[int | None, list[dict[str, Any]]]:
    """(limit, entries) of a ledger; an unreadable one counts as empty, with a warning."""
    if not data.strip():
        return None, []
    try:
        doc, _ = json.JSONDecoder().raw_decode(data.decode("utf-8"))
        if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
            raise ValueError("not a tba ledger object")
    except ValueError as e:
        log.warning("tba.storage: node quota ledger %s is unreadable (%s); starting over", shown, e)
        return None, []
    limit = doc.get("limit")
    if not isinstance(limit, int) or isinstance(limit, bool):
        limit = None
    return limit, [e for e in doc["entries"] if _valid_entry(e)]


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    chunks, at = [], 0
    while at < size:
        chunk = os.pread(fd, size - at, at)
        if not chunk:
            break
        chunks.append(chunk)
        at += len(chunk)
    return b"".join(chunks)


def _check_regular(fd: int, shown: str) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(
            f"TBA_NODE_MAX_DISK_BYTES: the node quota ledger {shown} is not a regular file. "
            "Remove it; tba recreates it."
        )


def _open_error(shown: str, e: OSError) -> ConfigError:
    if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR):
        what = "is a symbolic link or a directory; tba never follows links there. Remove it"
    else:
        what = (
            f"cannot be opened: {os.strerror(e.errno or 0)}. Make the spill root writable by "
            "every rank (run them as one user) or unset TBA_NODE_MAX_DISK_BYTES"
        )
    return ConfigError(f"TBA_NODE_MAX_DISK_BYTES: the node quota ledger {shown} {what}.")


class NodeQuota:
    """This backend's entry in the node ledger of ``root`` (see the NOTE).

    ``root_fd`` is an open fd on the spill root (the caller keeps it open while this lives),
    ``name`` the per-process directory in it. Constructing registers the entry with 0 bytes,
    so a bad ledger is a :class:`ConfigError` at startup rather than a refusal later.
    """

    def __init__(self, root_fd: int, root: str, name: str, limit: int, rank: int):
        self.root_fd = root_fd
        self.shown = os.path.join(root, LEDGER_NAME)
        self.name = name
        self.limit = limit
        self.rank = rank
        self.bytes = 0
        self.refusals = 0
        self.failure: OSError | TBAError | None = None  # why the last grow() could not ask
        self._closed = False
        try:
            with self._locked() as (_, entries):
                self._put(entries, 0)
        except OSError as e:
            raise _open_error(self.shown, e) from None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """The ledger under LOCK_EX, with its live entries; whatever the body leaves in the
        list is written back."""
        fd = os.open(LEDGER_NAME, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, 0o600, dir_fd=self.root_fd)
        try:
            _check_regular(fd, self.shown)
            fcntl.flock(fd, fcntl.LOCK_EX)
            _, entries = _parse(_read_all(fd), self.shown)
            entries = [e for e in entries if e["dir"] == self.name or _entry_alive(self.root_fd, e)]
            yield fd, entries
            doc = {"version": _VERSION, "limit": self.limit, "entries": entries}
            data = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], done)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)  # releases the lock

    def _put(self, entries: list[dict[str, Any]], nbytes: int) -> None:
        entries[:] = [e for e in entries if e["dir"] != self.name]
        if not self._closed:
            entries.append(
                {
                    "dir": self.name,
                    "host": host_tag(),
                    "pid": os.getpid(),
                    "rank": self.rank,
                    "bytes": nbytes,
                    "updated": round(time.time(), 3),
                }
            )
        self.bytes = nbytes

    def grow(self, have: int, need: int, want: int, align: int) -> int:
        """Reserve more room on top of ``have`` (this backend's slab bytes): ``want`` bytes, or
        less but at least ``need`` (a multiple of ``align``). Returns the bytes granted and
        records ``have`` + them, or 0 when the node lacks ``need`` (counted in ``refusals``)
        or when the ledger itself failed (``failure`` says why: the filesystem's fault, not
        the quota's)."""
        self.failure = None
        try:
            with self._locked() as (_, entries):
                others = sum(e["bytes"] for e in entries if e["dir"] != self.name)
                room = (self.limit - others - have) // align * align
                grant = min(want, room) if room >= need else 0
                self._put(entries, have + grant)
        except (OSError, TBAError) as e:  # allocate never raises: refuse instead
            log.warning("tba.storage: node quota ledger %s: %s; not growing", self.shown, e)
            self.failure = e
            return 0
        if grant == 0:
            self.refusals += 1
            log.debug(
                "tba.storage: node quota %s refuses %d bytes (%d held here)",
                format_size(self.limit),
                need,
                have,
            )
        return grant

    def set(self, nbytes: int) -> None:
        """Record that this backend now holds ``nbytes`` of slabs (after slabs closed or a
        reservation went unused)."""
        try:
            with self._locked() as (_, entries):
                self._put(entries, nbytes)
        except (OSError, TBAError) as e:  # the entry overstates us until the next change: safe
            log.warning("tba.storage: node quota ledger %s: %s", self.shown, e)

    def close(self) -> None:
        """Remove this backend's entry (its slabs are closed)."""
        if self._closed:
            return
        self._closed = True
        self.set(0)


def read_ledger(root: str) -> dict[str, Any] | None:
    """What the node quota ledger under the spill root ``root`` says, read-only; None when
    there is no ledger (TBA_NODE_MAX_DISK_BYTES never used there).

    Returns ``{"path", "limit", "used_bytes", "entries"}``: ``limit`` is the last writer's
    TBA_NODE_MAX_DISK_BYTES (None if unknown), ``used_bytes`` the sum over live entries, and
    ``entries`` every recorded entry as ``{"dir", "host", "pid", "rank", "bytes", "updated",
    "alive"}`` (see NOTE [Node quota] 4 for ``alive``; dead entries hold no space). Never writes,
    never follows a symlink (ConfigError for a symlinked root or ledger).
    """
    root = os.path.abspath(root)
    shown = os.path.join(root, LEDGER_NAME)
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _open_error(root, e) from None
    try:
        try:
            fd = os.open(LEDGER_NAME, os.O_RDONLY | _OPEN_FLAGS, dir_fd=root_fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _open_error(shown, e) from None
        try:
            _check_regular(fd, shown)
            fcntl.flock(fd, fcntl.LOCK_SH)
            limit, entries = _parse(_read_all(fd), shown)
        finally:
            os.close(fd)
        out = []
        for e in entries:
            e = dict(e, alive=_entry_alive(root_fd, e))
            out.append(e)
    finally:
        os.close(root_fd)
    used = sum(e["bytes"] for e in out if e["alive"])
    return {"path": shown, "limit": limit, "used_bytes": used, "entries": out}
