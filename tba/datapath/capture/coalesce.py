"""Small saved tensors packed together: one aligned staging block, one extent, one request.

# NOTE [Coalescing]
A tensor smaller than ``TBA_COALESCE_BYTES`` does not get its own staging block and extent: it
takes a 64-byte-aligned *slot* in the open :class:`Batch` of its device, and is captured straight
into that slot (the capture copy is the only copy). A batch belongs to one group of one step. It
is *sealed* when a tensor of another group (or step) arrives, when the next tensor does not fit,
or when the forward ends. Once sealed and every member's capture has completed, the whole filled
prefix is written with one request to one extent sized to it.

Each member stays an ordinary :class:`~tba.records.entry.Entry` with its own state, handles and
uses; its ``staging`` is a :class:`Slot` (a view into the batch block) and, once written, its
``extent`` is the batch's extent. The batch frees its staging block when no member (and no write)
needs it, and its extent when no member does: members release their share exactly where a
stand-alone entry would free its own.

Reads split members back out: a read of any member reads the whole batch extent into one aligned
buffer, and each member's bytes are a view of its slot. Members of one batch are adjacent in the
prefetch order (reverse pack order), so one read serves them all: while the read is in flight a
second member joins it, and while any member still holds its view the next one takes a view of
the same buffer without I/O. Resident-byte accounting charges each member its slot, so up to one
batch of memory per group is held beyond what the counters show.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ...records.entry import CAPTURE
from .staging import StagingBlock

SLOT_ALIGN = 64  # every slot starts on a cache line, so any dtype's view of it is aligned
MIN_BATCH_BYTES = 4 << 20  # at 4 MiB and more a request reaches the drive's large-extent rate


def batch_bytes(coalesce_bytes: int, staging_bytes: int, align: int) -> int:
    """Capacity of one batch: at least 4 MiB and 4 small tensors, at most 1/4 of staging."""
    want = max(MIN_BATCH_BYTES, 4 * coalesce_bytes)
    want = min(want, max(staging_bytes // 4, align))
    return max(align, want - want % align)


class Slot(StagingBlock):
    """A member's share of a batch's staging block, used wherever a StagingBlock is."""

    __slots__ = ("batch", "at")

    def __init__(self, batch: Batch, offset: int, length: int):
        block = batch.block
        self.offset = block.offset + offset  # in the arena, as ``base`` is
        self.length = length
        self.base = block.base
        self.pool = block.pool
        self.at = offset
        self.batch = batch

    def release(self) -> None:
        """A member is done with its slot: one reference less on the batch's block."""
        self.batch.unref_staging()


class Batch:
    """The open or sealed batch of small tensors; see NOTE [Coalescing].

    Its life: open (members carve slots and are captured) -> sealed -> written once every
    member's capture is done (:meth:`writable`, :meth:`start_write`, :meth:`write_ended`) ->
    read back whole (:meth:`join_read`, :meth:`read_ended`). Two counts free its resources:
    ``staging_refs`` (the open batch itself, each member still in staging, an in-flight
    write) frees the block; ``extent_refs`` (members whose bytes are on the extent) the extent.
    """

    __slots__ = (
        "block",
        "device",
        "group",
        "step",
        "fill",
        "members",
        "sealed",
        "pending",
        "writing",
        "extent",
        "staging_refs",
        "extent_refs",
        "read_fut",
        "readers",
        "hosts",
        "base",
    )

    def __init__(self, block: StagingBlock, device: torch.device, group: int, step: int):
        self.block: StagingBlock | None = block
        self.device = device
        self.group = group
        self.step = step
        self.fill = 0
        self.members: list[Any] = []
        self.sealed = False
        self.pending = 0  # members whose capture has not completed
        self.writing = False
        self.extent = None
        self.staging_refs = 1  # held by the open batch until it is sealed
        self.extent_refs = 0  # members whose bytes are on the extent
        self.read_fut = None  # the whole-batch read in flight
        self.readers: list[Any] = []  # members waiting on ``read_fut``
        self.hosts: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()  # members' read-back views
        self.base = 0  # storage offset of the read-back buffer (aligned inside its storage)

    # -- filling -------------------------------------------------------------------------------
    def accepts(self, step: int, group: int, nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` packed in ``group`` of ``step`` joins this batch."""
        return self.step == step and self.group == group and self.fits(nbytes)

    def fits(self, nbytes: int) -> bool:
        return _round(self.fill, SLOT_ALIGN) + nbytes <= self.block.length

    def carve(self, nbytes: int) -> Slot:
        """A slot for ``nbytes`` (call :meth:`fits` first)."""
        off = _round(self.fill, SLOT_ALIGN)
        self.fill = off + nbytes
        self.staging_refs += 1
        self.pending += 1
        return Slot(self, off, _round(nbytes, SLOT_ALIGN))

    def add(self, entry: Any) -> None:
        self.members.append(entry)

    def captured(self) -> None:
        """One member's capture completed."""
        self.pending -= 1

    def seal(self) -> None:
        """No more members: the write may start once every capture is done."""
        self.sealed = True

    # -- the one write -----------------------------------------------------------------------------
    def writable(self) -> list[Any]:
        """The members to write now, once (sealed, every capture done, nothing written yet);
        the batch forgets its members then (they refer to it, not it to them)."""
        if not self.sealed or self.pending or self.writing or not self.members:
            return []
        live = [m for m in self.members if m.state is CAPTURE]
        self.members = []
        return live

    def write_length(self, align: int) -> int:
        return _round(self.fill, align)

    def start_write(self, extent: Any, members: int) -> None:
        self.extent, self.extent_refs = extent, members
        self.writing = True
        self.staging_refs += 1  # the write reads the block

    def write_ended(self) -> None:
        self.writing = False
        self.unref_staging()

    # -- releasing ---------------------------------------------------------------------------------
    def unref_staging(self) -> None:
        """One user of the staging block less; the last one frees it."""
        self.staging_refs -= 1
        if self.staging_refs == 0 and self.block is not None:
            self.block.release()
            self.block = None

    def release_extent(self) -> Any:
        """One member's bytes leave the extent; returns the extent when it was the last."""
        self.extent_refs -= 1
        return None if self.extent_refs else self.extent

    # -- reads -------------------------------------------------------------------------------------
    def join_read(self, entry: Any) -> Any:
        """``entry`` waits for the whole-batch read; returns the read in flight (None: start
        one with :meth:`start_read`)."""
        self.readers.append(entry)
        return self.read_fut

    def start_read(self, fut: Any) -> None:
        self.read_fut = fut

    def read_ended(self, fut: Any) -> list[Any]:
        """``fut`` finished: the members that waited on it."""
        if self.read_fut is fut:
            self.read_fut = None
        readers, self.readers = self.readers, []
        return readers

    def read_back(self) -> torch.Tensor | None:
        """The whole-batch buffer of the last read, while some member still holds a view."""
        if not self.hosts:  # asked at each member's read: no iteration (and its guard) for none
            return None
        for view in self.hosts:
            return torch.empty(0, dtype=torch.uint8, device=view.device).set_(
                view.untyped_storage(), self.base, (self.extent.length,)
            )
        return None

    def slice_of(self, buf: torch.Tensor, offset: int, length: int) -> torch.Tensor:
        """A member's bytes as a view of the whole-batch buffer ``buf``; remembered weakly."""
        self.base = buf.storage_offset()
        view = buf[offset : offset + length]
        self.hosts.add(view)
        return view

    def __repr__(self) -> str:
        state = "sealed" if self.sealed else "open"
        return f"<Batch {state} group {self.group} {len(self.members)} members {self.fill}B>"


def _round(n: int, a: int) -> int:
    return -(-n // a) * a
