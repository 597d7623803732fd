"""The Writer: a captured tensor's way to disk, from the end of its capture to its bytes on disk
or, when a write fails or the disk refuses space, back in memory for good: a tensor is never
lost. It also fills and writes the batches that small tensors share (NOTE [Coalescing] in
tba/datapath/capture/coalesce.py). The Packer (tba/datapath/pack.py) decides and captures, and hands
each entry here (:meth:`Writer.captured_by`). Every method but the completion callbacks runs with
the I/O lock held.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from ..config import Config
from ..errors import modified_error
from ..records.entry import DEAD, Entry
from ..records.index import Index
from ..records.reasons import KEPT_REASONS, kept_reason_for
from ..records.step import StepState
from .blocks.groups import GroupTracker
from .capture.coalesce import Batch, batch_bytes
from .capture.device import Ticket
from .capture.staging import DirectBlock, HostBlock, StagingPool
from .io import IO


class Writer:
    """Writes captured entries and coalesced batches; keeps what the disk refuses."""

    def __init__(self, io: IO, index: Index, groups: GroupTracker, cfg: Config):
        self.io = io
        self.index = index
        self.groups = groups
        self.batch_bytes = batch_bytes(cfg.coalesce_bytes, cfg.staging_bytes, io.align)
        self._batches: dict[torch.device, Batch] = {}  # the open batch per device
        self.refused_step = -1  # the step in which the disk refused (space, or a failed write)
        self.refused_reason = "disk_full"

    def refusing(self, st: StepState) -> str | None:
        """The reason the disk refused earlier in ``st`` (kept for the rest of it), or None."""
        return self.refused_reason if self.refused_step == st.index else None

    def refused(self, st: StepState) -> str:
        """The backend refused an extent: returns the kept reason it names
        (tba/records/reasons.py)."""
        backend = self.io.backend
        return self.stop(st, backend.refusal, backend.refusal_detail)

    def stop(self, st: StepState, reason: str, detail: str) -> str:
        """The disk cannot take more for now: keep in memory for the rest of the step, and
        say why once per reason, with the errno or the numbers and the fix."""
        self.refused_step = st.index
        self.refused_reason = reason
        self.io.warn_once(
            f"refused-{reason}",
            f"tba.pack: keeping saved tensors in memory for the rest of step {st.index} "
            f"({reason}): {detail or KEPT_REASONS.get(reason, reason)}",
        )
        return reason

    def captured_by(self, e: Entry, ticket: Ticket | None) -> None:
        """``e`` was captured by ``ticket`` (None: from its own memory, done): write it once
        the capture is complete, on this thread when it is already, else from a thread that
        waits for the device copy."""
        if ticket is None or ticket.done():
            self._captured(e)
            return
        io = self.io
        fut = io.capture_executor().submit(self._await_capture, e)
        io.pending.add(fut)
        fut.add_done_callback(self._capture_waited)

    def _capture_waited(self, fut: Future) -> None:
        with self.io.lock:
            self.io.settled(fut)

    def _await_capture(self, e: Entry) -> None:
        e.ticket.wait()
        with self.io.lock:
            self._captured(e)

    def _captured(self, e: Entry) -> None:
        """The captured bytes are final: check the source was not modified (a capture done on
        the packing thread has nothing to check, NOTE [Byte capture] in pack.py), then write."""
        check = e.capture_done()
        b = e.batch
        if b is not None:
            b.captured()
        if e.state is DEAD:
            e.settle("dropped")
            self.io.release(e)
        elif check is not None and check[0]._version != check[1]:
            src, version = check
            e.fail(modified_error(src.shape, src.dtype, src._version, version))
            e.settle("modified")
            self.io.release(e)
        elif b is None:
            self._write(e)
            return
        if b is not None:
            self._write_batch(b)  # when sealed and every member is captured

    # -- writes -------------------------------------------------------------------------------
    def _write(self, e: Entry) -> None:
        e.start_write()
        if isinstance(e.staging, HostBlock):  # NOTE [Host capture]: the bytes are there
            now = self.io.clock()
            e.stat.io_started(True, now)
            self.io.finished(True, e, now, e.padded)  # timed by the device copy, not here
            self._ended(e, None, None)
            self.index.bury()
            return
        fut, t0 = self.io.write(e.extent, e.staging.view, e.stat, e.span)
        fut.add_done_callback(lambda f, e=e, t0=t0: self._write_done(e, f, t0))

    def _write_done(self, e: Entry, fut: Future, t0: float | None = None) -> None:
        """A write of ``e`` ended; ``t0``: when it was issued, for a stand-alone entry (a
        batch accounts its one write itself)."""
        io = self.io
        with io.lock:
            io.settled(fut)
            err = fut.exception()
            if t0 is not None and err is None:
                io.finished(True, e, t0, e.padded)
            self._ended(e, err, None if err is not None else fut.result())
            self.index.bury()

    def _ended(self, e: Entry, err: BaseException | None, digest: int | None) -> None:
        """``e``'s write ended with ``err`` (None: written, checksummed ``digest``). Lock held;
        the caller buries dead handles afterwards (once for a whole batch)."""
        io = self.io
        e.write_ended()
        if e.state is DEAD:
            e.settle(None if err is None else kept_reason_for(getattr(err, "errno", None)))
            io.release(e)
            return
        blk = e.staging
        if isinstance(blk, DirectBlock):  # NOTE [Direct capture] rule 2, failed write or not
            problem = blk.modified()
            if problem is not None:
                e.fail(problem)
                e.settle("modified")
                io.release(e)
                return
            if blk.moved():
                io.warn_once(
                    "moved",
                    "tba.pack: the storage of a saved tensor was resized while tba wrote "
                    "it; keeping that tensor in memory, as stock PyTorch would read it",
                )
                self._to_memory(e, "resized")
                return
        if err is not None:
            self._write_failed(e, err)
            return
        e.written(digest)
        e.settle(None)
        if e.want and e.host is None:  # prefetch asked while it was being written
            io.staged_to_host(e)
        else:
            io.free_staging(e)
        if e.want:
            io.on_host()  # NOTE [Device prefetch]

    def _write_failed(self, e: Entry, err: BaseException) -> None:
        """Keep the bytes in memory: a failed write never loses data. A full, removed,
        read-only or forbidden spill directory stops offloading for the rest of the step."""
        io = self.io
        io.failed("write", err, e.step)
        reason = kept_reason_for(getattr(err, "errno", None))
        if reason != "io_error":
            self.stop(e.step, reason, str(err))
        else:
            io.warn_once(
                f"write-{getattr(err, 'errno', None)}",
                f"tba.pack: a spill write failed ({err}); keeping its tensor in memory, exact",
            )
        self._to_memory(e, reason)

    def _to_memory(self, e: Entry, reason: str) -> None:
        """The entry's bytes move from staging to host memory for good (state MEMORY), kept
        for ``reason``."""
        io = self.io
        if e.host is None:
            e.hold(io.copy_out(e), from_disk=False)
        io.release(e)
        e.stay_in_memory()
        e.settle(reason)

    # -- coalescing (NOTE [Coalescing] in coalesce.py) ------------------------------------------
    def batch_for(self, device, staging: StagingPool, nbytes: int, st: StepState):
        """The open batch of ``device`` with room for ``nbytes`` in the current group, or None."""
        b = self._batches.get(device)
        group = self.groups.group
        if b is not None and b.accepts(st.index, group, nbytes):
            return b
        if b is not None:
            self._seal(b)
        block = staging.alloc(self.batch_bytes)
        if block is None:
            return None  # a stand-alone block may still fit
        b = self._batches[device] = Batch(block, device, group, st.index)
        return b

    def seal_all(self) -> None:
        """Write what is still being coalesced (the forward ended). Lock held."""
        for b in list(self._batches.values()):
            self._seal(b)

    def _seal(self, b: Batch) -> None:
        if self._batches.get(b.device) is b:
            del self._batches[b.device]
        b.seal()
        self._write_batch(b)
        b.unref_staging()  # the open batch's own share

    def _write_batch(self, b: Batch) -> None:
        """One write of the batch's filled prefix, once it is sealed and fully captured."""
        live = b.writable()
        if not live:
            return
        io = self.io
        st = live[0].step
        n = b.write_length(io.align)
        extent = io.allocate(n, b.device, live[0].stat)
        if extent is None:
            reason = self.refused(st)
            for m in live:
                self._to_memory(m, reason)
            return
        if n > b.fill:
            b.block.part(b.fill, n).zero_()  # zero-padded tail
        b.start_write(extent, len(live))
        io.count_disk(st, extent, live[0].stat)
        st.coalesced_writes += 1
        for m in live:
            m.start_write(extent)
        fut, t0 = io.write(extent, b.block.view[:n], live[0].stat)  # a batch holds one group
        fut.add_done_callback(lambda f, b=b, live=live, t0=t0: self._batch_written(b, live, f, t0))

    def _batch_written(self, b: Batch, members: list[Entry], fut: Future, t0: float) -> None:
        """The batch's one write ended: its outcome (and checksum) read once, for every member."""
        io = self.io
        with io.lock:
            io.settled(fut)
            err = fut.exception()
            digest = None
            if err is None:
                digest = fut.result()
                io.finished(True, members[0], t0, b.extent.length)  # a batch: one group
            for m in members:
                self._ended(m, err, digest)
            b.write_ended()
            self.index.bury()
