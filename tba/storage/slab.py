"""Slab files: nameless, preallocated spill files carved into extents.

NOTE [Slabs]
1. A slab is a file with no name: ``O_TMPFILE`` in the per-process directory, or, where the
   filesystem refuses ``O_TMPFILE``, a uniquely named file that is unlinked right after open.
   Its blocks are released when the fd closes, so nothing survives even SIGKILL.
2. Slabs are created lazily, when no existing slab has room, with ``posix_fallocate`` of
   ``slab_bytes`` (or the request's rounded size when it is larger). Growth is refused, and
   ``allocate`` returns ``None``, when the quota (sum of slab sizes) or the free-space floor
   (``statvfs`` free minus ``min_free_bytes``) would be crossed, or when fallocate fails with
   ENOSPC/EDQUOT. The last slab may be made smaller to fit. Entirely free slabs are closed to
   make room before refusing.
3. Each slab has an :class:`ExtentAllocator`; freed extents are reused (an overwrite is the
   cheapest write).
4. With a node quota (``TBA_NODE_MAX_DISK_BYTES``, NOTE [Node quota] in nodequota.py), growth
   that passed the checks of 2 also asks the node ledger, which may grant less (at least the
   request) or refuse; empty slabs are released to retry once. Every change of the slab bytes
   (growth before the fallocate, release after the close) is recorded in the ledger.
5. A refusal records its cause as the kept reason the offloader counts (``last_refusal``):
   "quota" (TBA_MAX_DISK_BYTES), "disk_full" (the free-space floor, ENOSPC, EDQUOT),
   "node_quota", or, from the errno of a failed statvfs, open, fallocate or node ledger
   update, ``reasons.kept_reason_for``: "spill_dir_gone" (ENOENT: the directory was removed),
   "permission", "read_only" or "io_error"; ``refusal_detail`` says what refused, with the
   numbers or the errno, and the fix. A refusal is logged here at debug level only: the one
   warning a user sees per cause is the caller's (the offloader's Writer.stop in
   tba/datapath/write.py, once per reason, quoting ``refusal_detail``; the relay raises
   CapacityError). A warning here too would say the same thing twice, and again at every refused
   growth.
6. Giving back (NOTE [Node quota] 6): when a free empties a slab, and once a second from the
   ``tba-node-quota`` thread, a slab set holding empty slabs asks the ledger how much it holds
   over its share while a rank below its share wants space, and closes that much of its empty
   slabs (smallest first). Whoever closes slabs calls the backend's :meth:`SlabSet.on_release`
   method (it forgets its engine handles or CuFiles for them) before the ledger records it.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import secrets
import threading
import weakref
from collections.abc import Callable

from ..errors import StorageError, hint_for, internal_error
from ..records.reasons import kept_reason_for
from .alloc import ExtentAllocator
from .base import Extent
from .nodequota import NodeQuota

__all__ = ["Slab", "SlabSet", "open_unnamed"]

log = logging.getLogger("tba.storage")

# errno values meaning "this filesystem (or kernel) has no O_TMPFILE".
_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# errno values meaning "fallocate is not supported here" (glibc's emulation may report EINVAL
# on O_DIRECT files): fall back to a sparse ftruncate.
_NO_FALLOCATE = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_GIVE_BACK_SECONDS = 1.0  # rule 5: how often an idle slab set looks whether it owes space


def open_unnamed(dir_fd: int, dir_path: str, direct: bool, tag: str) -> int:
    """Open a new nameless file in the directory ``dir_fd``, read-write, O_DIRECT if ``direct``.

    Raises :class:`StorageError` (op "open") when neither way works.
    """
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    shown = f"{dir_path}/{tag} (unlinked)"
    try:
        return os.open(".", flags | os.O_TMPFILE, 0o600, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in _NO_TMPFILE:
            code = e.errno or errno.EIO
            raise StorageError("open", shown, 0, 0, code, hint_for(code)) from None
        log.debug("tba.storage: O_TMPFILE refused in %s (%s); using unlinked files", dir_path, e)
    name = f".{tag}-{secrets.token_hex(8)}"
    try:
        fd = os.open(name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    except OSError as e:
        if e.errno != errno.EEXIST:
            # Linux creates the file before it checks O_DIRECT: do not leave the name behind.
            try:
                os.unlink(name, dir_fd=dir_fd)
            except OSError:
                pass
        raise StorageError(
            "open", shown, 0, 0, e.errno or errno.EIO, hint_for(e.errno or 0)
        ) from None
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError as e:
        os.close(fd)
        raise StorageError(
            "unlink", shown, 0, 0, e.errno or errno.EIO, hint_for(e.errno or 0)
        ) from None
    return fd


@dataclasses.dataclass(eq=False)
class Slab:
    index: int
    fd: int
    size: int
    alloc: ExtentAllocator
    display: str
    # Buffered backend: bytes written since the last fdatasync, and their range.
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    dirty: int = 0
    dirty_lo: int = 0
    dirty_hi: int = 0


class SlabSet:
    """The slabs of one backend, with quota and free-space checks. Thread-safe."""

    def __init__(
        self,
        dir_fd: int,
        dir_path: str,
        direct: bool,
        align: int,
        slab_bytes: int,
        max_disk_bytes: int | None,
        min_free_bytes: int,
        node: NodeQuota | None = None,
    ):
        self.dir_fd = dir_fd
        self.dir_path = dir_path
        self.direct = direct
        self.align = align
        self.slab_bytes = max(align, slab_bytes // align * align)
        self.max_disk_bytes = max_disk_bytes
        self.min_free_bytes = min_free_bytes
        self.slabs: dict[int, Slab] = {}
        self.reserved = 0
        self.refused_quota = 0
        self.refused_space = 0
        self.refused_error = 0
        self.refused_node = 0
        self.last_refusal = ""  # the kept reason of the last refusal (NOTE [Slabs] 5)
        self.refusal_detail = ""  # what refused, with the numbers or errno, and the fix
        self.node = node
        self._on_release: weakref.WeakMethod | None = None
        self._next = 0
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None  # rule 5, from the first slab on

    # -- allocation -------------------------------------------------------------------------
    def allocate(
        self,
        nbytes: int,
        fallocate: Callable[[int, int, int], None],
        statvfs: Callable[[str], os.statvfs_result],
    ) -> Extent | None:
        if nbytes < 0:
            raise ValueError(f"tba.storage: cannot allocate {nbytes} bytes")
        with self._lock:
            if self._closed:
                raise ValueError("tba.storage: allocate() on a closed backend")
            for slab in self.slabs.values():
                off = slab.alloc.alloc(nbytes)
                if off is not None:
                    return Extent(slab.index, off, slab.alloc.size_of(off))
            slab = self._grow(nbytes, fallocate, statvfs)
            if slab is None:
                return None
            off = slab.alloc.alloc(nbytes)
            if off is None:  # pragma: no cover - the slab was sized for this request
                return None
            return Extent(slab.index, off, slab.alloc.size_of(off))

    def _room(self, statvfs: Callable[[str], os.statvfs_result]) -> tuple[int | None, int]:
        quota_room = None if self.max_disk_bytes is None else self.max_disk_bytes - self.reserved
        st = statvfs(self.dir_path)
        space_room = st.f_bavail * st.f_frsize - self.min_free_bytes
        return quota_room, space_room

    def _empty(self) -> list[Slab]:
        return [s for s in self.slabs.values() if s.alloc.live_extents == 0]

    def _release(self, slabs: list[Slab]) -> None:
        """Close ``slabs`` (their blocks go back to the filesystem), then record it (rule 5)."""
        for s in slabs:
            del self.slabs[s.index]
            self.reserved -= s.size
            os.close(s.fd)
        on_release = self._on_release() if self._on_release is not None else None
        if slabs and on_release is not None:
            on_release()
        if slabs and self.node is not None:
            self.node.set(self.reserved)  # after the close: the ledger never under-counts

    def on_release(self, method: Callable[[], None]) -> None:
        """Call ``method`` whenever slabs are closed, before the ledger records it (rule 5). A
        bound method of the backend, held weakly: the backend owns this slab set, and a cycle
        would keep a dropped backend (and its files) alive until a garbage collection."""
        self._on_release = weakref.WeakMethod(method)

    def _release_empty(self) -> bool:
        """Close slabs with no live extent."""
        empty = self._empty()
        self._release(empty)
        return bool(empty)

    def _give_back(self) -> None:
        """Rule 5 (NOTE [Node quota] 6): close empty slabs worth what we hold over our share
        while a rank below its share wants space. Lock held."""
        empty = self._empty()
        if not empty or self.node is None:
            return
        owe = self.node.excess(self.reserved)
        closing = []
        for s in sorted(empty, key=lambda s: s.size):
            if owe <= 0:
                break
            closing.append(s)
            owe -= s.size
        if closing:
            log.debug("tba.storage: giving back %d empty slabs to the node quota", len(closing))
            self._release(closing)

    def _watch(self) -> None:
        """Rule 5, for a process that holds empty slabs and frees nothing more."""
        while not self._stop.wait(_GIVE_BACK_SECONDS):
            try:
                with self._lock:
                    if self._closed:
                        return
                    self._give_back()
            except Exception as e:  # never let the thread die with a traceback; retry later
                log.warning("tba.storage: giving back space to the node quota failed: %s", e)

    def _grow(
        self,
        nbytes: int,
        fallocate: Callable[[int, int, int], None],
        statvfs: Callable[[str], os.statvfs_result],
    ) -> Slab | None:
        a = self.align
        need = max(a, (nbytes + a - 1) // a * a)
        try:
            quota_room, space_room = self._room(statvfs)
            short = (quota_room is not None and quota_room < need) or space_room < need
            if short and self._release_empty():
                quota_room, space_room = self._room(statvfs)
        except OSError as e:
            self.refused_error += 1
            code = e.errno or errno.EIO
            err = StorageError("statvfs", self.dir_path, 0, 0, code, hint_for(code))
            return self._refuse(kept_reason_for(code), str(err))
        if quota_room is not None and quota_room < need:
            self.refused_quota += 1
            return self._refuse(
                "quota",
                f"the per-process quota TBA_MAX_DISK_BYTES={self.max_disk_bytes} is used "
                f"({self.reserved} bytes in slabs) and {need} more were asked. Raise "
                "TBA_MAX_DISK_BYTES, or offload less (TBA_KEEP_LAST, TBA_MIN_OFFLOAD_BYTES).",
            )
        if space_room < need:
            self.refused_space += 1
            return self._refuse(
                "disk_full",
                f"{self.dir_path} has {max(0, space_room)} bytes free above the "
                f"TBA_MIN_FREE_BYTES floor of {self.min_free_bytes}; {need} were asked. Free "
                "space on that filesystem, or lower TBA_MIN_FREE_BYTES.",
            )
        size = max(need, self.slab_bytes)
        if quota_room is not None:
            size = min(size, quota_room // a * a)
        size = min(size, space_room // a * a)
        if self.node is not None:
            granted = self.node.grow(self.reserved, need, size, a)
            if not granted and self.node.failure is None and self._release_empty():
                granted = self.node.grow(self.reserved, need, size, a)
            failure = self.node.failure
            if not granted and isinstance(failure, OSError):  # the ledger's filesystem failed
                code = failure.errno or errno.EIO
                if code in _NO_SPACE:
                    self.refused_space += 1
                else:
                    self.refused_error += 1
                err = StorageError("update", self.node.shown, 0, 0, code, hint_for(code))
                return self._refuse(kept_reason_for(code), str(err))
            if not granted:
                self.refused_node += 1
                return self._refuse(
                    "node_quota",
                    f"the node-wide quota TBA_NODE_MAX_DISK_BYTES={self.node.limit} is used "
                    "up by the tba processes of this node. Raise it, or run fewer ranks per "
                    "node with offload.",
                )
            size = granted
        index = self._next
        self._next += 1
        display = f"{self.dir_path}/slab-{index} (unlinked)"
        try:
            fd = open_unnamed(self.dir_fd, self.dir_path, self.direct, f"slab-{index}")
        except StorageError as e:
            self.refused_error += 1
            self._unreserve()
            return self._refuse(kept_reason_for(e.errno), str(e))
        try:
            try:
                fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in _NO_FALLOCATE:
                    raise
                os.ftruncate(fd, size)  # sparse: space is not reserved, but I/O works
        except OSError as e:
            os.close(fd)
            self._unreserve()
            code = e.errno or errno.EIO
            err = StorageError("fallocate", display, 0, size, code, hint_for(code))
            if code in _NO_SPACE:
                self.refused_space += 1
                return self._refuse("disk_full", str(err))
            self.refused_error += 1
            return self._refuse(kept_reason_for(code), str(err))
        slab = Slab(index, fd, size, ExtentAllocator(size, a), display)
        self.slabs[index] = slab
        self.reserved += size
        if self.node is not None and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="tba-node-quota", daemon=True)
            self._watcher.start()
        log.debug("tba.storage: new slab %s of %d bytes", display, size)
        return slab

    def _refuse(self, reason: str, detail: str) -> None:
        """Record why growth was refused (NOTE [Slabs] 5: logged at debug level, the caller
        warns); returns None for ``_grow``."""
        self.last_refusal = reason
        self.refusal_detail = detail
        log.debug("tba.storage: no new slab (%s): %s", reason, detail)
        return None

    def _unreserve(self) -> None:
        """Growth failed after the node ledger granted it: give the grant back."""
        if self.node is not None:
            self.node.set(self.reserved)

    def free(self, extent: Extent) -> None:
        with self._lock:
            if self._closed:
                return  # teardown order: handles may be released after the backend closed
            slab = self.slabs.get(extent.slab)
            if slab is None:
                raise internal_error(
                    "storage",
                    f"free of an unknown extent (slab {extent.slab}, offset {extent.offset}): "
                    "double free, or an extent of another backend",
                )
            slab.alloc.free(extent.offset)
            if slab.alloc.live_extents == 0 and self.node is not None:
                self._give_back()  # rule 5

    def slab_for(self, extent: Extent, nbytes: int) -> Slab:
        """The slab of a live extent; ValueError if ``extent`` is not allocated or too small."""
        slab = self.slabs.get(extent.slab)
        try:
            size = slab.alloc.size_of(extent.offset) if slab is not None else -1
        except KeyError:
            size = -1
        if slab is None or size < 0:
            raise ValueError(
                f"tba.storage: I/O on an extent that is not allocated (slab {extent.slab}, "
                f"offset {extent.offset}); it was freed or belongs to another backend"
            )
        if nbytes != extent.length or nbytes > size:
            raise ValueError(
                f"tba.storage: buffer of {nbytes} bytes for an extent of {extent.length} bytes; "
                "the buffer must be exactly extent.length bytes"
            )
        return slab

    # -- accounting -------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return sum(s.alloc.used for s in list(self.slabs.values()))

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._closed = True
            for s in self.slabs.values():
                os.close(s.fd)
            self.slabs.clear()
            self.reserved = 0
            if self.node is not None:
                self.node.close()  # after the slabs: the ledger never under-counts
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(5)  # it sees _stop at once; not from itself (a finalizer run by GC)
