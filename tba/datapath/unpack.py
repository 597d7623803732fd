"""The Reader: how a saved tensor comes back when backward asks for it.

``unpack`` hands autograd the tensor: the original itself when it is still alive and unchanged
(forwarded), else a view of read-back bytes (prefetched, or read now: a synchronous load,
counted), or of bytes still in staging. Reads are issued by the Prefetcher
(tba/datapath/prefetch.py) in reverse forward order, within the read-ahead budget; the Reader starts
them, completes them, and gives their bytes and budget back after each entry's last use. It also
retires entries whose last handle died (:meth:`Reader.retire`, called by the index).
"""

from __future__ import annotations

import errno
import logging
from concurrent.futures import Future

import torch

from ..config import format_size
from ..errors import StorageError, internal_error
from ..records.entry import CAPTURE, DEAD, ON_DISK, Entry
from ..records.handle import Handle, KeptHandle
from ..records.index import Index
from .capture.coalesce import Batch
from .capture.derived import Derived
from .io import IO
from .prefetch import DeviceWindow, Prefetcher

log = logging.getLogger("tba")


class Reader:
    """Serves unpacks and drives the Prefetcher, whose ``start`` is :meth:`start_read`."""

    def __init__(self, io: IO, index: Index, prefetcher: Prefetcher):
        self.io = io
        self.index = index
        self.prefetcher = prefetcher
        budget = io.config.device_prefetch_bytes  # NOTE [Device prefetch]
        uploading = io.uploading
        window = DeviceWindow(budget, lambda e: e.device in uploading, self._upload_ahead)
        prefetcher.device = window
        io.on_host = window.pump

    # -- the unpack hook ----------------------------------------------------------------------
    def unpack(self, h: Handle | KeptHandle | Derived) -> torch.Tensor:
        if type(h) is Derived:
            return h.rebuild()  # NOTE [Weight-derived tensors]
        now = self.io.clock()
        if isinstance(h, KeptHandle):
            if h.stat is not None:
                h.stat.unpacked(now)
            return h.unpack()
        h.check_version()  # NOTE [Version witness]
        e = h.entry
        h.stat.unpacked(now)
        lock = self.io.lock
        if not e.step.backward_started:  # NOTE [Plan order]
            with lock:
                self.prefetcher.started(e.step, self.drop_read_back)
                self.prefetcher.pump()
        t = h.live_original()
        if t is not None:
            with lock:
                self.index.bury()
                e.step.forwarded += 1
                self._consume(e)
            return t
        with lock:
            self.index.bury()
            out = h.view_of(self._bytes_for(e))
            if not e.from_disk:
                e.step.forwarded += 1
            self._consume(e)
        return out

    def _bytes_for(self, e: Entry) -> torch.Tensor:
        """The entry's bytes on its device, reading or waiting as needed. Lock held."""
        if e.error is not None:
            raise e.error
        io, lock, st = self.io, self.io.lock, e.step
        if e.host is None and e.staging is not None:
            if e.ticket is not None:  # a device capture still running: wait for the copy
                lock.release()
                try:
                    e.ticket.wait()
                finally:
                    lock.acquire()
                if e.error is not None:
                    raise e.error
            if e.host is None and e.staging is not None:
                e.hold(io.copy_out(e), from_disk=False)
        elif e.host is None and e.state is ON_DISK and not e.io_busy:
            st.sync_loads += 1
            e.stat.sync_loads += 1
            if not e.budgeted:
                self.prefetcher.take(e)
            self.start_read(e)
        waited = 0.0
        while e.host is None and e.error is None:
            fut = e.reading
            if fut is None:  # pragma: no cover - a state the machine cannot reach
                raise internal_error("unpack", f"entry {e!r} has no bytes and no read in flight")
            lock.release()
            t0 = io.clock()
            try:
                io.wait([fut], f"to read back a saved tensor of {format_size(e.nbytes)}")
            finally:
                waited += io.clock() - t0
                lock.acquire()
            self._read_done(e, fut)
        st.stall_seconds += waited
        e.stat.stall_seconds += waited
        if e.error is not None:
            raise e.error
        adapter, _ = io.device(e.device)
        if adapter.uploads:
            if e.upload is None:
                e.upload = adapter.upload(e.host, e.device)
                st.uploads_at_unpack += 1
            return adapter.hand_out(e.upload)
        return adapter.hand_out(e.host)

    def _upload_ahead(self, e: Entry) -> bool:
        """The device window's turn for ``e`` (NOTE [Device prefetch]); lock held, any thread."""
        adapter, _ = self.io.device(e.device)
        try:
            e.upload = adapter.upload(e.host, e.device)
        except RuntimeError as err:  # device memory short now: the unpack copies it later
            self.io.warn_once(
                "upload",
                f"tba.unpack: could not copy a read-back tensor to {e.device} ahead of its use "
                f"({err}); copying at unpack instead. Lower TBA_DEVICE_PREFETCH_BYTES.",
            )
            return False
        e.step.uploads_ahead += 1
        return True

    def _consume(self, e: Entry) -> None:
        """One use unpacked. After the last use of this backward, drop the read-back bytes."""
        if e.consumed():
            e.deferred = False  # used: the plan need not read it (NOTE [Forwarding])
            self.drop_read_back(e)
            self.prefetcher.pump()

    def drop_read_back(self, e: Entry) -> None:
        """Let go of ``e``'s read-back bytes and its prefetch budget; the bytes stay on disk and
        are read again when wanted (after its last use, or NOTE [Plan order]). Lock held."""
        if e.state is ON_DISK and e.drop_host():
            self.index.uncharge(e.padded)
        self.prefetcher.give_back(e)

    # -- reads ----------------------------------------------------------------------------------
    def start_read(self, e: Entry) -> None:
        """Bring ``e``'s bytes back from disk (the Prefetcher's, or a sync load). Lock held."""
        if e.batch is not None:
            self._start_batch_read(e)
            return
        self.index.charge(e.padded)
        fut = self.io.read(e.extent, e.device, e)
        e.start_read(fut)
        fut.add_done_callback(lambda f, e=e: self._read_done(e, f))

    def _start_batch_read(self, e: Entry) -> None:
        """Join or start the whole-batch read that brings ``e`` back (lock held)."""
        b = e.batch
        buf = b.read_back()
        if buf is not None:  # another member still holds the bytes: no I/O
            self.index.charge(e.padded)
            e.hold(b.slice_of(buf, e.slot_at, e.padded), from_disk=True)
            e.step.bytes_reloaded += e.nbytes
            return
        fut = b.join_read(e)
        new = fut is None
        if new:
            fut = self.io.read(e.extent, e.device, e)
            b.start_read(fut)
        self.index.charge(e.padded)
        e.start_read(fut)
        if new:  # after joining: a read that is already done serves ``e`` (and its views) now
            fut.add_done_callback(lambda f, b=b: self._batch_read_done(b, f))

    def _batch_read_done(self, b: Batch, fut: Future) -> None:
        """The whole-batch read ended: its outcome read once, for every member waiting on it."""
        io = self.io
        with io.lock:
            io.settled(fut)
            readers = b.read_ended(fut)
            err = fut.exception()
            if readers and err is None:
                t0, n = fut.tba_t0, len(fut.tba_buffer)  # type: ignore[attr-defined]
                io.finished(False, readers[0], t0, n)  # a batch: one group
            for e in readers:
                self._read_ended(e, fut, err)
            self.index.bury()
            io.on_host()

    def _read_done(self, e: Entry, fut: Future) -> None:
        io = self.io
        with io.lock:
            io.settled(fut)
            if self._read_ended(e, fut, fut.exception()):
                self.index.bury()
                io.on_host()

    def _read_ended(self, e: Entry, fut: Future, err: BaseException | None) -> bool:
        """``e``'s read ``fut`` ended with ``err``; True when it brought ``e``'s bytes (the
        caller then buries dead handles and pumps the device window). Lock held."""
        if not e.read_ended(fut):
            return False  # the waiter already handled it
        io = self.io
        if err is not None or e.state is DEAD:
            self.index.uncharge(e.padded)
            if err is not None:
                io.failed("read", err, e.step)
                if e.state is not DEAD:  # a dead entry's extent is freed below
                    e.fail(err if isinstance(err, StorageError) else _as_error(err, e))
            if e.state is DEAD:
                io.release(e)
            return False
        buf = fut.tba_buffer  # type: ignore[attr-defined]
        if e.batch is not None:
            buf = e.batch.slice_of(buf, e.slot_at, e.padded)
        e.hold(buf[e.skew :] if e.skew else buf, from_disk=True)  # NOTE [Direct capture]
        e.step.bytes_reloaded += e.nbytes
        if e.batch is None:
            io.finished(False, e, fut.tba_t0, e.padded)  # type: ignore[attr-defined]
        return True

    # -- lifetimes ------------------------------------------------------------------------------
    def retire(self, e: Entry) -> None:
        """The last handle of ``e`` died (the index calls this, lock held)."""
        was = e.state
        if not e.die():
            return
        if was is CAPTURE:
            e.settle("dropped")  # never written; a write in flight settles it when it ends
        self.io.live.discard(e)
        self.prefetcher.give_back(e)
        if e.drop_host():
            self.index.uncharge(e.padded)
        if not e.io_busy and e.ticket is None:
            self.io.release(e)

    def read_back_live(self) -> None:
        """Before close: start reading back every live entry still only on disk. Lock held."""
        unread = [e for e in self.io.live if e.state is ON_DISK and e.host is None]
        if unread:
            log.warning(
                "tba.offloader: closing while live graphs still need %d saved tensors on "
                "disk; reading them back into memory",
                len(unread),
            )
        for e in unread:
            self.start_read(e)

    def keep_live_in_memory(self) -> None:
        """After those reads: whatever is in memory stays there, off the disk. Lock held."""
        for e in list(self.io.live):
            if e.state is ON_DISK and e.host is not None:
                self.io.free_extent(e)
                self.prefetcher.give_back(e)
                e.stay_in_memory()


def _as_error(err: BaseException, e: Entry) -> StorageError:
    ext = e.extent
    code = getattr(err, "errno", None) or errno.EIO
    return StorageError("read", "spill file", ext.offset if ext else -1, e.padded, code, str(err))
