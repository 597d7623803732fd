"""Handles, entries, the dedup index and resident-memory accounting. No files, no streams.

# NOTE [Entries and handles]
A *handle* is what the pack hook returns to autograd: one per distinct saved view, identified by
(storage, storage offset, size, stride, dtype, version). An *entry* is what holds the bytes: one
per captured buffer. Several handles can share an entry (q, k and v split from one projection
share that projection's storage), so the bytes are written once. Autograd owns the handles; when
the last handle of an entry dies (after its last use, or when a graph is dropped without
backward) the entry frees its staging, extent and read-back memory.

# NOTE [Storage identity]
The dedup key uses the StorageImpl address. While an entry exists it holds a weak reference to
that storage (:class:`StorageRef`), which keeps the StorageImpl object itself allocated, so a new
storage can never be created at the same address and alias an old entry; the data memory is still
freed normally.

# NOTE [Entry states]
    CAPTURE --ticket done--> WRITING --write ok--> ON_DISK --read--> READING --ok--> LOADED
    WRITING --write failed--> MEMORY (bytes kept in host memory; exact)
    READING --read failed--> FAILED (every unpack raises the StorageError)
    LOADED  --all uses consumed--> ON_DISK (read again if a retained graph needs it again)
    any     --last handle died--> DEAD (resources freed once no I/O is in flight)
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from .errors import UnpackError

if TYPE_CHECKING:
    from .offloader import Offloader
    from .stats import StepState

CAPTURE, WRITING, ON_DISK, READING, LOADED, MEMORY, FAILED, DEAD = range(8)
STATE_NAMES = ("capture", "writing", "on_disk", "reading", "loaded", "memory", "failed", "dead")


_free_weak_ref = torch.UntypedStorage._free_weak_ref  # kept: ``torch`` may go first at exit


class StorageRef:
    """A weak reference to a storage's StorageImpl (NOTE [Storage identity]).

    What torch's ``StorageWeakRef`` does, as one object for the cyclic GC to track instead of
    two (that class keeps a bound method per instance): every pack makes one, and young
    collections run in proportion to what packs leave alive.
    """

    __slots__ = ("cdata",)

    def __init__(self, storage: Any):
        self.cdata = storage._weak_ref()

    def expired(self) -> bool:
        return torch.UntypedStorage._expired(self.cdata)

    def __del__(self) -> None:
        _free_weak_ref(self.cdata)


def is_dense(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True when the strided view covers exactly ``numel`` consecutive elements (any order)."""
    dims = sorted((st, sz) for sz, st in zip(size, stride) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def layout(
    t: torch.Tensor, storage_nbytes: int, stride: tuple[int, ...] | None = None
) -> tuple[bool, int, tuple[int, ...], int]:
    """How to capture ``t``: (whole_storage, nbytes, stride_in_buffer, offset_in_buffer).
    ``stride``: ``t.stride()`` when the caller has it (returned as is when it is kept).

    - The whole storage when ``t`` covers all of it, or is a non-dense view spanning at least
      half of it (q/k/v slices): views are rebuilt on the restored storage with their exact
      strides, and other views of the same storage share the capture.
    - Otherwise only ``t``'s elements: in memory order with the same strides when ``t`` is
      dense, else contiguously.
    """
    size, item = t.shape, t.element_size()
    if stride is None:
        stride = t.stride()
    view_bytes = t.numel() * item
    if view_bytes == storage_nbytes:
        return True, storage_nbytes, stride, t.storage_offset()
    if is_dense(size, stride):
        return False, view_bytes, stride, 0
    span = (sum((n - 1) * s for n, s in zip(size, stride)) + 1) * item
    if 2 * span >= storage_nbytes:
        return True, storage_nbytes, stride, t.storage_offset()
    return False, view_bytes, contiguous_stride(size), 0


def contiguous_stride(size: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(size):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def modified_error(t_shape: Any, dtype: torch.dtype, now: int, then: int) -> UnpackError:
    return UnpackError(
        f"tba.hook: one of the variables needed for gradient computation has been modified by "
        f"an inplace operation: a saved tensor of shape {list(t_shape)} and dtype {dtype} is at "
        f"version {now}; expected version {then} instead. Stock PyTorch raises here too: clone "
        f"the tensor before modifying it, or use the out-of-place operation."
    )


class Entry:
    """The bytes behind one or more handles. See NOTE [Entry states]."""

    __slots__ = (
        "cache",
        "step",
        "key",
        "storage_ref",
        "device",
        "nbytes",
        "padded",
        "state",
        "staging",
        "extent",
        "host",
        "dev_buf",
        "ticket",
        "check",
        "digest",
        "error",
        "seq",
        "handles",
        "uses",
        "left",
        "want",
        "budgeted",
        "io_busy",
        "reading",
        "from_disk",
        "batch",
        "slot_at",
        "skew",
        "stat",
    )

    def __init__(self, cache: Cache, step: StepState, key: Any, storage_ref: Any, t, nbytes: int):
        self.cache = cache
        self.step = step
        self.key = key
        self.storage_ref = storage_ref
        self.device = t.device
        self.nbytes = nbytes
        self.padded = 0
        self.state = CAPTURE
        self.staging = None  # StagingBlock while the bytes are in staging
        self.extent = None  # storage Extent once allocated
        self.host: torch.Tensor | None = None  # host bytes: read back, or kept after a failure
        self.dev_buf: torch.Tensor | None = None  # device copy of ``host`` (CUDA)
        self.ticket = None
        self.check: tuple[torch.Tensor, int] | None = None  # (source, version) until captured
        self.digest: int | None = None
        self.error: BaseException | None = None
        self.seq = 0  # pack sequence number of the latest save: orders the prefetch plan
        self.handles = 0
        self.uses = 0  # saves of this entry (sum over its handles)
        self.left = 0  # uses not yet unpacked in the current backward
        self.want = False  # prefetch asked for it while it was still being written
        self.budgeted = 0  # bytes this entry holds of the prefetch budget
        self.io_busy = False  # a read or write is in flight
        self.reading = None  # the read's future while one is in flight
        self.from_disk = False  # ``host`` came from a disk read (not staging or a fallback)
        self.batch = None  # the Batch this small tensor was coalesced into (NOTE [Coalescing])
        self.slot_at = 0  # its byte offset inside the batch
        self.skew = 0  # where its bytes start in a read-back buffer (NOTE [Direct capture])
        self.stat: Any = None  # the GroupStat of the group that packed it (set by offload)

    def __repr__(self) -> str:
        return f"<Entry {STATE_NAMES[self.state]} {self.nbytes}B>"


class Handle:
    """An offloaded saved tensor: geometry into its entry's bytes, plus the pack-time version."""

    __slots__ = ("entry", "dtype", "size", "stride", "offset", "version", "ref", "key", "packs")
    __slots__ += ("__weakref__",)

    def __init__(self, entry: Entry, t: torch.Tensor, stride, offset: int, key: Any):
        self.entry = entry
        self.dtype = t.dtype
        self.size = key[2]  # the key's torch.Size, shared
        self.stride = stride  # a tuple from layout()
        self.offset = offset
        self.version = t._version
        self.ref = weakref.ref(t)
        self.key = key
        self.packs = 1

    def __del__(self) -> None:
        try:
            self.entry.cache.drop_handle(self)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def live_original(self) -> torch.Tensor | None:
        """The packed tensor itself when it is still alive and unmodified (forwarding)."""
        t = self.ref()
        if t is None:
            return None
        if t._version != self.version:
            raise modified_error(t.shape, t.dtype, t._version, self.version)
        return t

    def view_of(self, buf: torch.Tensor) -> torch.Tensor:
        """This handle's tensor as a view of the uint8 buffer ``buf`` (zero-copy)."""
        base = buf.storage_offset() // self.dtype.itemsize
        out = torch.empty(0, dtype=self.dtype, device=buf.device)
        return out.set_(buf.untyped_storage(), base + self.offset, self.size, self.stride)


class KeptEntry:
    """Accounting for a storage that stays resident because kept handles reference it."""

    __slots__ = ("cache", "cdata", "nbytes", "handles", "__weakref__")

    def __init__(self, cache: Cache, cdata: int, nbytes: int):
        self.cache = cache
        self.cdata = cdata
        self.nbytes = nbytes
        self.handles = 0


class KeptHandle:
    """A saved tensor tba keeps in memory. Holds it, and checks its version on unpack."""

    __slots__ = ("tensor", "version", "entry", "key", "stat", "__weakref__")

    def __init__(self, t: torch.Tensor, entry: KeptEntry, key: Any, stat: Any = None):
        self.tensor = t
        self.version = t._version
        self.entry = entry
        self.key = key
        self.stat = stat  # the GroupStat of the group that packed it (backward timing)

    def __del__(self) -> None:
        try:
            self.entry.cache.drop_kept(self)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise modified_error(t.shape, t.dtype, t._version, self.version)
        return t


class Cache:
    """Dedup index and resident accounting. The owner holds ``lock`` around every call."""

    def __init__(self, owner: Offloader, lock: Any):
        self.owner = owner
        self.lock = lock
        self.handles: dict[Any, weakref.ref] = {}  # view key -> handle
        self.entries: dict[Any, Entry] = {}  # (storage cdata, version) -> whole-storage entry
        self.kept: dict[int, KeptEntry] = {}  # storage cdata -> kept storage
        self.resident = 0
        self.graveyard: deque = deque()  # (key, entry, packs) of dead handles; see bury()

    # -- accounting ---------------------------------------------------------------------------
    def charge(self, n: int) -> None:
        self.resident += n
        self.owner.note_resident(self.resident)

    def uncharge(self, n: int) -> None:
        self.resident -= n

    # -- lookups ------------------------------------------------------------------------------
    def find(self, key: Any) -> Handle | KeptHandle | None:
        ref = self.handles.get(key)
        return None if ref is None else ref()

    def add_handle(self, h: Handle | KeptHandle) -> None:
        self.handles[h.key] = weakref.ref(h)

    def kept_entry(self, cdata: int, nbytes: int) -> KeptEntry:
        e = self.kept.get(cdata)
        if e is None:
            e = self.kept[cdata] = KeptEntry(self, cdata, nbytes)
            self.charge(nbytes)
        return e

    # -- lifetimes ----------------------------------------------------------------------------
    # NOTE [Deferred release]
    # A handle's ``__del__`` can run anywhere: after a backward node, but also inside cyclic GC
    # triggered by any allocation, on any thread, possibly while that thread holds the staging
    # or slab lock. So ``__del__`` only appends to ``graveyard`` (an atomic deque append) and
    # the Offloader calls :meth:`bury` at safe points (pack, unpack, step edges, stats,
    # synchronize, I/O completions) with its lock held and no other tba lock taken.
    def drop_kept(self, h: KeptHandle) -> None:
        self.graveyard.append((h.key, h.entry, 0))

    def drop_handle(self, h: Handle) -> None:
        self.graveyard.append((h.key, h.entry, h.packs))

    def bury(self) -> None:
        """Account every handle that died since the last call. Lock held."""
        g = self.graveyard
        while g:
            key, e, packs = g.popleft()
            ref = self.handles.get(key)
            if ref is not None and ref() is None:
                del self.handles[key]
            e.handles -= 1
            if isinstance(e, KeptEntry):
                if e.handles == 0:
                    if self.kept.get(e.cdata) is e:
                        del self.kept[e.cdata]
                    self.uncharge(e.nbytes)
                continue
            e.uses -= packs
            e.left = min(e.left, e.uses)
            if e.handles == 0:
                if self.entries.get(e.key) is e:
                    del self.entries[e.key]
                self.owner.retire(e)
