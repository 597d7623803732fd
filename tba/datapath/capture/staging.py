"""A bounded arena of page-aligned (pinned on CUDA) staging memory.

Offloaded tensors are copied here before their write, so a write never races with later
in-place updates of the source. The arena is one allocation carved by an
:class:`~tba.storage.alloc.ExtentAllocator`; when it is full, :meth:`StagingPool.alloc`
returns None and the caller keeps the tensor resident instead of blocking the forward.

Large CPU tensors skip the copy: see NOTE [Direct capture] and :class:`DirectBlock`.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

from ...errors import modified_error
from ...host.memory import align_up, io_buffer
from ...storage.alloc import ExtentAllocator


class StagingBlock:
    """One carved piece of an arena: bytes ``[offset, offset + length)`` of ``base``.

    ``tensor`` (a uint8 view) and ``view`` (a memoryview) are made when asked for, not kept:
    the hot path slices ``base`` once itself (:meth:`part`), and an entry that lives until its
    write completes then holds no tensor object of its own for the cyclic GC to walk.
    """

    __slots__ = ("offset", "length", "base", "pool")

    def __init__(self, offset: int, length: int, base: torch.Tensor, pool: StagingPool):
        self.offset = offset
        self.length = length
        self.base = base
        self.pool = pool

    def release(self) -> None:
        """Give the block back to its pool (once)."""
        self.pool.free(self)

    def part(self, start: int, stop: int) -> torch.Tensor:
        """Bytes ``[start, stop)`` of the block as a uint8 view."""
        return self.base[self.offset + start : self.offset + stop]

    @property
    def tensor(self) -> torch.Tensor:
        return self.part(0, self.length)

    @property
    def view(self) -> memoryview:
        """The block as a backend I/O buffer (a memoryview; the tensor itself on a device)."""
        return io_buffer(self.tensor)


class HostBlock(StagingBlock):
    """A host-tier extent's own pinned buffer, standing where a staging block would: the device
    copy lands in the tier at once, and there is no write after it (NOTE [Host capture] in
    tba/datapath/pack.py). Releasing it drops this reference only: the tier holds the buffer
    until the extent is freed."""

    __slots__ = ("extent",)

    def __init__(self, buf: torch.Tensor, extent: Any):
        super().__init__(0, buf.numel(), buf, None)  # type: ignore[arg-type]
        self.extent = extent

    def release(self) -> None:
        self.base = None  # type: ignore[assignment]


class StagingPool:
    """``capacity`` bytes of aligned host memory, handed out in ``align`` multiples."""

    def __init__(self, arena: torch.Tensor, align: int):
        self.arena = arena
        self.align = align
        self._alloc = ExtentAllocator(arena.numel(), align)
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self.frees = 0  # blocks given back so far: what a waiting pack watches (wait_freed)
        self.peak = 0  # most bytes of the arena in use
        self.refusals = 0
        self.held = 0  # bytes of DirectBlocks: sources held for their writes (rule 4)
        self.limit: int | None = None  # NOTE [Staging within the budget]; None: the capacity

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def room(self) -> int:
        """The most bytes in flight at once: the capacity, or less under a budget."""
        cap = self._alloc.capacity
        return cap if self.limit is None else min(cap, self.limit)

    @property
    def in_use(self) -> int:
        """Bytes of the budget in use: the arena's and the held sources'."""
        return self._alloc.used + self.held

    def alloc(self, nbytes: int, alone: bool = False) -> StagingBlock | None:
        """A block of the arena, or None when it does not fit (``alone``: it may pass the
        limit when nothing else is in flight, NOTE [Staging within the budget])."""
        with self._lock:
            off = None
            used = self._alloc.used + self.held
            if used + nbytes <= self.room or (alone and used == 0):
                off = self._alloc.alloc(nbytes)
            if off is None:
                self.refusals += 1
                return None
            length = self._alloc.size_of(off)
            self.peak = max(self.peak, self._alloc.used)
        return StagingBlock(off, length, self.arena, self)

    def hold(self, block: DirectBlock, alone: bool = False) -> bool:
        """Count a direct capture against the budget; False (a refusal) when it does not fit
        (``alone``: it may pass the limit when nothing else is in flight, NOTE [Staging within
        the budget]; its source is held while it is written either way)."""
        with self._lock:
            used = self._alloc.used + self.held
            if used + block.length > self.room and not (alone and used == 0):
                self.refusals += 1
                return False
            self.held += block.length
        block.pool = self
        return True

    def free(self, block: StagingBlock | DirectBlock) -> None:
        with self._lock:
            self.frees += 1
            self._freed.notify_all()
            if isinstance(block, DirectBlock):
                self.held -= block.length
                return
            self._alloc.free(block.offset)
        block.base = None  # type: ignore[assignment]

    def wait_freed(self, seen: int, timeout: float) -> bool:
        """Wait until a block is given back after :attr:`frees` read ``seen``; False when
        ``timeout`` seconds passed first (TBA_STAGING_FULL=wait)."""
        with self._lock:
            return self._freed.wait_for(lambda: self.frees != seen, timeout)

    def wait_for(self, get, seen: int, timeout: float, lock, clock) -> tuple[Any, float]:
        """Retry ``get()`` (a block, or None) each time a block is given back, for at most
        ``timeout`` seconds, with ``lock`` (held once by the caller) released while waiting.
        Returns what ``get`` gave (None: timed out) and the seconds waited. ``clock`` (the
        Offloader's) measures both the wait and the deadline (NOTE [Staging backpressure])."""
        deadline = clock() + timeout
        got, waited = None, 0.0
        while got is None:
            left = deadline - clock()
            if left <= 0:
                break
            lock.release()
            t0 = clock()
            try:
                freed = self.wait_freed(seen, left)
            finally:
                waited += clock() - t0
                lock.acquire()
            seen = self.frees
            got = get()
            if not freed:
                break  # the wait took all that was left
        return got, waited


# NOTE [Staging backpressure]
# Staging (TBA_STAGING_BYTES: the pinned pool on CUDA; on the CPU also the tensors held for
# their direct write) fills when writes do not keep up. By default (TBA_STAGING_FULL=keep) a
# tensor that finds it full stays resident: the forward never waits, and memory grows by what
# is kept (kept_reasons["staging_full"]). With TBA_STAGING_FULL=wait the pack waits, with the
# lock released so that write completions can free staging, until a block is given back and
# its bytes fit, at most TBA_STAGING_WAIT seconds per pack: the memory cap holds at the cost
# of a stall, counted in ``stall_seconds`` and ``pack_stall_seconds``. Batches being filled
# are sealed and written first (they free staging only once written). A tensor larger than
# the staging (or its limit under a budget) waits until nothing else is in flight and goes alone
# (NOTE [Staging within the budget]). After one timeout the rest of the step keeps without waiting,
# so a drive that stopped does not cost a timeout per tensor.
# With TBA_MEMORY_BUDGET set, 'wait' is the default (an explicit TBA_STAGING_FULL stands): a
# tensor kept for a full staging stays resident for the rest of the forward, which no budget
# can allow for, while a wait holds it only until one write completes. When a block's largest
# tensors do not all fit the staging at once, 'keep' leaves some of them resident in every block
# for the rest of the forward, so the peak grows with the model's depth and can pass a memory cap
# that 'wait' holds (BENCHMARKS.md, "Batch headroom"). The Offloader's config reports the value
# in use (with_budget_backpressure in tba/datapath/io.py).
# NOTE [Staging within the budget]
# Staging is part of what TBA_MEMORY_BUDGET bounds: the bytes held while their writes run count
# in ``peak_resident_bytes``. A 256 MiB staging under a 52 MiB budget is a budget no plan can
# keep, and how much of it fills depends on how fast the disk is at the moment: in a batch-size
# search (BENCHMARKS.md, "Batch headroom") step 1, writing to fresh slab extents, held 100 MB more
# than the steps after it, and a batch that fitted in one trial was OOM-killed in step 1 of the
# next. So under a budget (with TBA_STAGING_FULL=wait, its default there) each step's staging
# limit is the budget's allowed bytes for it (``StagingPool.limit``; the last step's saved bytes
# for a fraction, nothing in step 1 for one), and a tensor larger than the limit waits until
# nothing else is in flight and then goes alone, instead of being kept for the whole forward as
# one larger than the whole staging was: in flight at once is then the limit or one tensor,
# whichever is more, whatever the disk's speed.
# NOTE [Direct capture]
# On the CPU a capture into staging is a memcpy on the training thread, time paid for every byte
# offloaded, and the pool it fills is host memory the process keeps. So a large CPU tensor is
# written from its own memory instead: the entry holds the source tensor until the write
# completes, then lets it go. O_DIRECT needs the buffer address and length to be multiples
# of the backend's alignment (a page), which a torch allocation (64-byte aligned) rarely is, so
# the write covers the whole pages around the tensor: ``skew`` bytes before it and the rest of
# its last page after it. Those bytes are mapped (same pages) but not ours; they go to the spill
# file and are never read back as data: a read-back's tensor starts ``skew`` bytes into its
# buffer. Rules that keep this exact:
# 1. The source is held (strong reference) until the write's future completes, dead entry or
#    not, so its memory cannot be freed and reused while the device reads it.
# 2. The source's version is checked again when the write completes. An in-place update while
#    the write ran (which stock PyTorch would also reject at backward) fails the entry with the
#    same error instead of leaving torn bytes on disk. A moved data pointer is checked too: a
#    storage resized (``untyped_storage().resize_``, as FSDP does with its flat parameters)
#    frees the memory being written without a version bump. Stock PyTorch's backward would read
#    that storage as it is by then, so the entry does the same: it keeps a view of the live
#    storage (state MEMORY) and drops what it wrote.
# 3. The checksum covers only the tensor's own bytes, ``[skew, skew + nbytes)`` of the write
#    (the entry's ``span``): the bytes around them belong to other tensors and may change at
#    any time, while the tensor's own are guarded by rule 2 (a change fails the entry, so a
#    digest taken over changing bytes is never trusted). Reads verify the same span.
# 4. Bytes held this way count against TBA_STAGING_BYTES together with the pool's, so the
#    staging_full rule (keep resident rather than block the forward) still bounds them.
class DirectBlock:
    """A CPU tensor's own bytes as a write buffer (NOTE [Direct capture]).

    ``length`` is the padded write length (whole pages), ``skew`` where the tensor's bytes start
    in it, ``source`` a uint8 view of exactly the captured bytes, and ``check`` the packed tensor
    with its version at pack time.
    """

    __slots__ = ("length", "skew", "source", "check", "ptr", "pool")

    def __init__(self, source: torch.Tensor, check: torch.Tensor, align: int):
        addr = self.ptr = source.data_ptr()
        self.skew = addr % align
        self.length = align_up(self.skew + source.numel(), align)
        self.source = source
        self.check = (check, check._version)
        self.pool: StagingPool | None = None  # set by StagingPool.hold

    def release(self) -> None:
        """Give the held bytes back to the staging budget (once the write has completed)."""
        self.pool.free(self)

    @property
    def tensor(self) -> torch.Tensor:
        """The captured bytes (uint8, unpadded): a zero-copy stand-in for staging's copy."""
        return self.source

    @property
    def view(self) -> memoryview:
        """The whole pages around the tensor as a memoryview that keeps the source alive."""
        start = self.source.data_ptr() - self.skew
        raw = (ctypes.c_ubyte * self.length).from_address(start)
        raw._tba_source = self.source  # type: ignore[attr-defined]  # rule 1, via the view
        return memoryview(raw).cast("B")

    def modified(self) -> Exception | None:
        """The in-place error when the source changed since the pack (rule 2), or None."""
        t, version = self.check
        return (
            None if t._version == version else modified_error(t.shape, t.dtype, t._version, version)
        )

    def moved(self) -> bool:
        """The source's storage was resized or reallocated since the pack (rule 2)."""
        return self.source.data_ptr() != self.ptr
