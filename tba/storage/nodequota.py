"""The node-wide spill quota (``TBA_NODE_MAX_DISK_BYTES``): one ledger file that every tba
process spilling under the same root reads and updates under ``flock``.

NOTE [Node quota]
1. The ledger is ``<spill root>/.tba-node-quota``: a regular file, mode 0600, always opened
   relative to the root's fd with ``O_NOFOLLOW`` (a symlink there is refused, never followed).
   Its name matches no per-process directory and it is not a directory, so the sweep of stale
   directories leaves it alone (NOTE [Spill directory safety] in spilldir.py).
2. Every change is read, drop the dead entries, decide, write back, all under
   ``flock(LOCK_EX)``. :func:`read_ledger` and the give-back check of rule 6 take ``LOCK_SH``
   and change nothing.
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

       {"version": 2, "limit": <bytes or null>, "entries": [{"dir": "h-12-rank0",
        "host": "h", "pid": 12, "rank": 0, "bytes": 1073741824, "updated": <unix time>,
        "wants": <unix time of its last refusal, 0 if none>}]}

   ``limit`` is the TBA_NODE_MAX_DISK_BYTES of the last writer. A write is one ``pwrite`` at
   offset 0 and then a truncate to its length: a SIGKILL between the two leaves a whole
   document followed by stale bytes, which the parser ignores. Version 1 (before rule 6 shared
   fairly) had no ``wants``: its entries are read as never refused, and the next writer writes
   version 2 (a version-1 writer keeps the field of the others' entries). A version newer than
   2 is refused, not rewritten: growing is a :class:`ConfigError` at startup and a refusal with
   a warning later; :func:`read_ledger` still reports what it can read.
6. Fair share. A live entry *wants space* while it holds bytes or was refused within the last
   ``_WANT_SECONDS`` (its ``wants``). The share of each is ``limit`` // (the entries wanting
   space, the asker counted). A process may grow into free room up to its share at any time,
   and beyond it (room lent by the others' unused shares) only into free room not owed to an
   entry that was refused while below its share (owed: share - its bytes). Every refusal by
   the ledger records ``wants``. A process learns that it must give back whenever one of its slabs
   becomes empty (a free) and once a second (a thread, for a process that is idle holding
   empty slabs): it reads the ledger, and when it holds more than its share while another
   entry below its share was refused lately, it closes empty slabs (smallest first) until it is
   at or under its share. So each rank that wants space gets its share within one slab (slabs
   are given back whole, and only when empty: bytes in live extents are never taken), and a
   rank alone gets the whole limit. It also gives empty slabs back when it is itself short,
   and everything at close. Every process applies its own limit, so set the same
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
from .spilldir import DIR_FLAGS, dir_name_pattern, host_tag, pid_alive

__all__ = ["LEDGER_NAME", "NodeQuota", "read_ledger"]

log = logging.getLogger("tba.storage")

LEDGER_NAME = ".tba-node-quota"
_VERSION = 2
_WANT_SECONDS = 30.0  # NOTE 6: a refusal counts as wanting space for this long
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_SETTING = "TBA_NODE_MAX_DISK_BYTES"  # the setting a ledger's errors name (the host tier's differs)


def _entry_alive(root_fd: int, entry: dict[str, Any]) -> bool:
    """NOTE 4: the entry's directory exists and someone holds its lock."""
    try:
        fd = os.open(entry["dir"], DIR_FLAGS, dir_fd=root_fd)
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            return False  # a symlink or a file in its place: no tba process owns it
        if entry["host"] != host_tag():
            return True
        return pid_alive(entry["pid"])
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


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parse(data: bytes, shown: str) -> tuple[int, int | None, list[dict[str, Any]]]:
    """(version, limit, entries) of a ledger (NOTE 5); an unreadable one counts as an empty
    version-2 ledger, with a warning."""
    if not data.strip():
        return _VERSION, None, []
    try:
        doc, _ = json.JSONDecoder().raw_decode(data.decode("utf-8"))
        if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
            raise ValueError("not a tba ledger object")
        version = doc.get("version", 1)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ValueError(f"format version {version!r}")
    except ValueError as e:
        log.warning("tba.storage: node quota ledger %s is unreadable (%s); starting over", shown, e)
        return _VERSION, None, []
    limit = doc.get("limit")
    if not isinstance(limit, int) or isinstance(limit, bool):
        limit = None
    entries = [e for e in doc["entries"] if _valid_entry(e)]
    for e in entries:  # version 1 has no "wants": never refused
        if not _number(e.get("wants")) or e["wants"] < 0:
            e["wants"] = 0
    return version, limit, entries


def _newer(shown: str, version: int, setting: str = _SETTING) -> ConfigError:
    return ConfigError(
        f"{setting}: the node quota ledger {shown} has format version {version}; "
        f"this tba reads versions 1 to {_VERSION}. A newer tba spills under the same root: run "
        "one tba version on the node, or give each its own TBA_SPILL_DIR."
    )


def _wanting(entry: dict[str, Any], now: float) -> bool:
    """NOTE 6: refused within the last ``_WANT_SECONDS`` (either way: clocks of other hosts)."""
    return entry["wants"] > 0 and abs(now - entry["wants"]) < _WANT_SECONDS


def _fair_share(limit: int, others: list[dict[str, Any]], now: float) -> int:
    """NOTE 6: ``limit`` over the entries that want space, the asker counted with ``others``."""
    return limit // (1 + sum(1 for e in others if e["bytes"] > 0 or _wanting(e, now)))


def _owed(share: int, others: list[dict[str, Any]], now: float) -> int:
    """NOTE 6: the room kept for entries refused while below their share."""
    return sum(max(0, share - e["bytes"]) for e in others if _wanting(e, now))


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


def _check_regular(fd: int, shown: str, setting: str = _SETTING) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(
            f"{setting}: the node quota ledger {shown} is not a regular file. "
            "Remove it; tba recreates it."
        )


def _open_error(shown: str, e: OSError, setting: str = _SETTING) -> ConfigError:
    if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR):
        what = "is a symbolic link or a directory; tba never follows links there. Remove it"
    else:
        what = (
            f"cannot be opened: {os.strerror(e.errno or 0)}. Make the spill root writable by "
            f"every rank (run them as one user) or unset {setting}"
        )
    return ConfigError(f"{setting}: the node quota ledger {shown} {what}.")


class NodeQuota:
    """This backend's entry in the node ledger of ``root`` (see the NOTE).

    ``root_fd`` is an open fd on the spill root (the caller keeps it open while this lives),
    ``name`` the per-process directory in it. Constructing registers the entry with 0 bytes,
    so a bad ledger is a :class:`ConfigError` at startup rather than a refusal later.
    ``ledger`` names the file (the host tier keeps its own, NOTE [Host tier] in hosttier.py),
    ``setting`` the variable its errors name.
    """

    def __init__(
        self,
        root_fd: int,
        root: str,
        name: str,
        limit: int,
        rank: int,
        *,
        ledger: str = LEDGER_NAME,
        setting: str = _SETTING,
    ):
        self.root_fd = root_fd
        self.ledger = ledger
        self.setting = setting
        self.shown = os.path.join(root, ledger)
        self.name = name
        self.limit = limit
        self.rank = rank
        self.bytes = 0
        self.refusals = 0
        self.wants = 0.0  # unix time of our last refusal (NOTE 6)
        self.failure: OSError | TBAError | None = None  # why the last grow() could not ask
        self._closed = False
        try:
            with self._locked() as (_, entries):
                self._put(entries, 0)
        except OSError as e:
            raise _open_error(self.shown, e, setting) from None

    def _live(self, fd: int) -> list[dict[str, Any]]:
        """The ledger's live entries (ours whatever its state); ConfigError for a newer format."""
        version, _, entries = _parse(_read_all(fd), self.shown)
        if version > _VERSION:
            raise _newer(self.shown, version, self.setting)
        return [e for e in entries if e["dir"] == self.name or _entry_alive(self.root_fd, e)]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """The ledger under LOCK_EX, with its live entries; whatever the body leaves in the
        list is written back."""
        fd = os.open(self.ledger, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, 0o600, dir_fd=self.root_fd)
        try:
            _check_regular(fd, self.shown, self.setting)
            fcntl.flock(fd, fcntl.LOCK_EX)
            entries = self._live(fd)
            yield fd, entries
            doc = {"version": _VERSION, "limit": self.limit, "entries": entries}
            data = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], done)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)  # releases the lock

    def _peek(self) -> list[dict[str, Any]]:
        """The live entries, read under LOCK_SH, changing nothing."""
        fd = os.open(self.ledger, os.O_RDONLY | _OPEN_FLAGS, dir_fd=self.root_fd)
        try:
            _check_regular(fd, self.shown, self.setting)
            fcntl.flock(fd, fcntl.LOCK_SH)
            return self._live(fd)
        finally:
            os.close(fd)

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
                    "wants": self.wants,
                }
            )
        self.bytes = nbytes

    def grow(self, have: int, need: int, want: int, align: int) -> int:
        """Reserve more room on top of ``have`` (this backend's slab bytes): ``want`` bytes, or
        less but at least ``need`` (a multiple of ``align``). Returns the bytes granted and
        records ``have`` + them, or 0 when the node lacks ``need`` or the free room is owed to
        others (NOTE 6; counted in ``refusals`` and recorded in ``wants``), or when the ledger
        itself failed (``failure`` says why: the filesystem's fault, not the quota's)."""
        self.failure = None
        try:
            with self._locked() as (_, entries):
                now = time.time()
                others = [e for e in entries if e["dir"] != self.name]
                free = self.limit - sum(e["bytes"] for e in others) - have
                share = _fair_share(self.limit, others, now)
                lent = free - _owed(share, others, now)
                room = min(free, max(share - have, lent)) // align * align
                grant = min(want, room) if room >= need else 0
                if grant == 0:
                    self.wants = round(now, 3)
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

    def excess(self, have: int) -> int:
        """NOTE 6: the bytes of ``have`` over this backend's share when another live entry below
        its share was refused lately, else 0 (also when the ledger cannot be read: keeping
        what we hold is safe, rule 3)."""
        try:
            entries = self._peek()
        except (OSError, TBAError) as e:
            log.debug("tba.storage: node quota ledger %s: %s", self.shown, e)
            return 0
        now = time.time()
        others = [e for e in entries if e["dir"] != self.name]
        share = _fair_share(self.limit, others, now)
        if have <= share or not any(_wanting(e, now) and e["bytes"] < share for e in others):
            return 0
        return have - share

    def share(self) -> int:
        """NOTE 6: this entry's fair share of the limit now (the whole limit when the ledger
        cannot be read)."""
        try:
            entries = self._peek()
        except (OSError, TBAError) as e:
            log.debug("tba.storage: node quota ledger %s: %s", self.shown, e)
            return self.limit
        others = [e for e in entries if e["dir"] != self.name]
        return _fair_share(self.limit, others, time.time())

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

    Returns ``{"path", "version", "limit", "used_bytes", "entries"}``: ``version`` is the
    ledger's format (NOTE [Node quota] 5; a newer one is read for the fields this tba knows),
    ``limit`` the last writer's TBA_NODE_MAX_DISK_BYTES (None if unknown), ``used_bytes`` the
    sum over live entries, and ``entries`` every recorded entry as ``{"dir", "host", "pid",
    "rank", "bytes", "updated", "wants", "alive"}`` (see NOTE [Node quota] 4 for ``alive``; dead
    entries hold no space; ``wants`` 0 for a version-1 entry). Never writes, never follows a
    symlink (ConfigError for a symlinked root or ledger).
    """
    root = os.path.abspath(root)
    shown = os.path.join(root, LEDGER_NAME)
    try:
        root_fd = os.open(root, DIR_FLAGS)
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
            version, limit, entries = _parse(_read_all(fd), shown)
        finally:
            os.close(fd)
        out = []
        for e in entries:
            e = dict(e, alive=_entry_alive(root_fd, e))
            out.append(e)
    finally:
        os.close(root_fd)
    used = sum(e["bytes"] for e in out if e["alive"])
    return {"path": shown, "version": version, "limit": limit, "used_bytes": used, "entries": out}
