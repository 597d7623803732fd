"""What the pack hook hands autograd (handles) and what holds the bytes (entries).

No I/O, no locks, no policy: records whose state changes are their own methods, so a
newcomer reads an entry's life here and nowhere else.

# NOTE [Entries and handles]
A *handle* is what the pack hook returns to autograd: one per distinct saved view, identified by
(storage, storage offset, size, stride, dtype, version). An *entry* is what holds the bytes: one
per captured buffer. Several handles can share an entry (q, k and v split from one projection
share that projection's storage), so the bytes are written once. Autograd owns the handles; when
the last handle of an entry dies (after its last use, or when a graph is dropped without
backward) the entry frees its staging, extent and read-back memory (see NOTE [Deferred release]
in tba/records/index.py for when).

# NOTE [Entry states]
    CAPTURE --capture done, version unchanged--> WRITING --write ok--> ON_DISK
    CAPTURE --source modified before its capture completed--> FAILED
    CAPTURE --its batch's extent refused (NOTE [Coalescing])--> MEMORY
    WRITING --write failed, or the source moved (NOTE [Direct capture])--> MEMORY
    WRITING --source modified while it was written (NOTE [Direct capture])--> FAILED
    ON_DISK --read failed--> FAILED (every unpack raises the StorageError)
    ON_DISK --close() with the bytes read back for a live graph--> MEMORY
    any     --last handle died--> DEAD (resources freed once no I/O is in flight)
While ON_DISK, ``host`` holds the read-back bytes between a read and the last use of a backward
(then they are dropped, and read again if a retained graph needs them again). MEMORY entries
keep their bytes in ``host`` for good and never touch the disk again.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Any

import torch


class State(enum.Enum):
    CAPTURE = "capture"
    WRITING = "writing"
    ON_DISK = "on_disk"
    MEMORY = "memory"
    FAILED = "failed"
    DEAD = "dead"


CAPTURE, WRITING, ON_DISK, MEMORY, FAILED, DEAD = State

# -- entries -----------------------------------------------------------------------------------


class Entry:
    """The bytes behind one or more handles. See NOTE [Entry states].

    Built by the Packer once its bytes are captured (or their capture is under way). The
    fields other modules read are documented here; they change only through the methods.
    """

    __slots__ = (
        "graveyard",
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
        "settled",
        "span",
        "originals",
        "deferred",
        "upload",
        "dev_budgeted",
    )

    def __init__(
        self,
        graveyard: deque,
        step: Any,
        key: Any,
        storage_ref: Any,
        device: torch.device,
        nbytes: int,
        staging: Any,
        extent: Any,
        stat: Any,
    ):
        self.graveyard = graveyard  # where dying handles queue (NOTE [Deferred release])
        self.step = step  # the StepState that packed it: its counters and its prefetch plan
        self.key = key
        self.storage_ref = storage_ref
        self.device = device
        self.nbytes = nbytes
        self.padded = staging.length  # bytes of staging, extent and read buffer
        self.state = CAPTURE
        self.staging = staging  # StagingBlock, Slot or DirectBlock while the bytes are there
        self.extent = extent  # storage Extent (a batch member's: set when the batch is written)
        self.host: torch.Tensor | None = None  # host bytes: read back, or kept in memory
        self.upload: Any = (
            None  # the device copy of ``host`` (CUDA: tba.datapath.capture.device.Upload)
        )
        self.ticket = None  # the capture's Ticket until it is done (captured_by)
        self.check: tuple[torch.Tensor, int] | None = None  # (source, version at pack)
        self.digest: int | None = None  # the write's checksum, verified by every read
        self.error: BaseException | None = None  # raised by every unpack once FAILED
        self.seq = 0  # pack sequence number of the latest save: orders the prefetch plan
        self.handles = 0
        self.uses = 0  # saves of this entry (sum over its handles)
        self.left = 0  # uses not yet unpacked in the current backward
        self.want = False  # prefetch asked for it while it was still being written
        self.budgeted = 0  # bytes this entry holds of the prefetch budget (scheduler.py)
        self.io_busy = False  # a read or write is in flight
        self.reading = None  # the read's future while one is in flight
        self.from_disk = False  # ``host`` came from a disk read (not staging or a fallback)
        self.batch = None  # the Batch it was coalesced into (NOTE [Coalescing], coalesce.py)
        self.slot_at = 0  # its byte offset inside the batch
        self.skew = 0  # where its bytes start in a read-back buffer (NOTE [Direct capture])
        self.stat = stat  # the GroupStat of the group that packed it
        self.settled = False  # counted (NOTE [Counted once] in tba/records/reasons.py)
        self.span: tuple[int, int] | None = None  # what its checksum covers (None: all)
        # the weak reference to the saved tensor, or a list of them once a second handle is made
        # on these bytes (NOTE [Forwarding]); one entry rarely has two, and a list for one would
        # be one more object per offloaded tensor for the cyclic GC
        self.originals: Any = None
        self.deferred = False  # the plan passed it over while an original was alive
        self.dev_budgeted = 0  # bytes it holds of the device window (NOTE [Device prefetch])
        step.unsettled += 1

    def __repr__(self) -> str:
        return f"<Entry {self.state.value} {self.nbytes}B>"

    # -- uses (handles and unpacks) -------------------------------------------------------------
    def saw(self, original: Any) -> None:
        """A handle on these bytes was made for the tensor ``original`` (a weak reference)."""
        refs = self.originals
        if refs is None:
            self.originals = original
        elif type(refs) is list:
            refs.append(original)
        else:
            self.originals = [refs, original]

    def originals_alive(self) -> bool:
        """Every tensor saved onto these bytes is still alive: each unpack can be served by
        its original, so reading the bytes back would be wasted (NOTE [Forwarding])."""
        refs = self.originals
        if refs is None:
            return False
        if type(refs) is not list:
            return refs() is not None
        return all(r() is not None for r in refs)

    def saved(self, seq: int) -> None:
        """One more save of these bytes: one more unpack to expect, later in the plan."""
        self.uses += 1
        self.left += 1
        self.seq = seq

    def forget(self, packs: int) -> bool:
        """A handle with ``packs`` saves died; True when it was the last handle."""
        self.handles -= 1
        self.uses -= packs
        self.left = min(self.left, self.uses)
        return self.handles == 0

    def consumed(self) -> bool:
        """One use unpacked; True after the last use of this backward (and re-arms for a
        retained graph's next backward)."""
        self.left -= 1
        if self.left > 0:
            return False
        self.left = self.uses
        return True

    # -- counting (NOTE [Counted once] in tba/records/reasons.py) ----------------------------------
    def settle(self, kept_reason: str | None) -> None:
        """Count this entry in its step, once: offloaded (``None``: its bytes reached the disk)
        or kept for ``kept_reason``."""
        if self.settled:
            return
        self.settled = True
        st, gs = self.step, self.stat
        st.unsettled -= 1
        if kept_reason is None:
            st.offloaded(self.nbytes)
            gs.offloaded_bytes += self.nbytes
        else:
            st.keep(kept_reason)
            gs.kept_bytes += self.nbytes

    # -- capture and write ----------------------------------------------------------------------
    def captured_by(
        self,
        ticket: Any,
        check: tuple[torch.Tensor, int] | None,
        batch: Any,
        skew: int,
        span: tuple[int, int] | None,
    ) -> None:
        """How the bytes were captured: the device copy's ``ticket`` (None: done), the source
        and its version at pack, the ``batch`` of a coalesced entry, the ``skew`` of a direct
        capture, and the ``span`` of the write its checksum covers (None: all of it)."""
        self.ticket = ticket
        self.check = check
        if batch is not None:
            self.batch = batch
            self.slot_at = self.staging.at
            batch.add(self)
        self.skew = skew
        self.span = span

    def capture_done(self) -> tuple[torch.Tensor, int] | None:
        """The capture completed: returns (source, version at pack) for the caller to check,
        or None when there is nothing to check (captured on the packing thread)."""
        check = self.check
        self.check = None
        self.ticket = None
        return check

    def start_write(self, extent: Any = None) -> None:
        self.state = WRITING
        self.io_busy = True
        if extent is not None:
            self.extent = extent

    def write_ended(self) -> None:
        self.io_busy = False

    def written(self, digest: int | None) -> None:
        self.digest = digest
        self.state = ON_DISK

    def fail(self, err: BaseException) -> None:
        """Every later unpack raises ``err``."""
        self.error = err
        self.state = FAILED

    def stay_in_memory(self) -> None:
        """The bytes live in ``host`` for good (a failed write; close())."""
        self.state = MEMORY

    def die(self) -> bool:
        """The last handle died; False when it was already dead."""
        if self.state is DEAD:
            return False
        self.state = DEAD
        return True

    # -- bytes in memory -------------------------------------------------------------------------
    def hold(self, buf: torch.Tensor, from_disk: bool) -> None:
        self.host = buf
        self.from_disk = from_disk

    def drop_host(self) -> bool:
        """Let go of the bytes in memory; True when there were some."""
        if self.host is None:
            return False
        self.host = None
        self.upload = None
        return True

    # -- reads -------------------------------------------------------------------------------------
    def start_read(self, fut: Any) -> None:
        self.io_busy = True
        self.reading = fut

    def read_ended(self, fut: Any) -> bool:
        """``fut`` finished; False when it is not this entry's read (a waiter handled it)."""
        if self.reading is not fut:
            return False
        self.reading = None
        self.io_busy = False
        return True

    # -- resources ---------------------------------------------------------------------------------
    def take_staging(self) -> Any:
        """The staging block, once: its owner frees it."""
        blk, self.staging = self.staging, None
        return blk

    def take_extent(self) -> Any:
        """The extent, once: its owner frees it."""
        ext, self.extent = self.extent, None
        return ext
