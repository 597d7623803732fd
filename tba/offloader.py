"""`tba.Offloader`: owns the backend, staging, cache and scheduler, and moves the bytes.

Locking: one re-entrant lock guards the cache, the entries' states, the budgets and the
counters. I/O completions arrive on I/O threads and take it too. Waiting on I/O (stalls) and
``Ticket.wait`` happen outside it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import torch
import torch.nn as nn

from ._memory import io_buffer
from .adaptive import DepthController, KeepController
from .cache import (
    CAPTURE,
    DEAD,
    FAILED,
    MEMORY,
    ON_DISK,
    WRITING,
    Cache,
    Entry,
    Handle,
    KeptHandle,
    StorageRef,
    modified_error,
)
from .coalesce import Batch, batch_bytes
from .config import Config
from .device import DONE, CpuAdapter, DeviceAdapter, adapter_for
from .errors import StorageError, TBAError, UsageError
from .hook import OffloadHooks
from .metrics import RankMetrics
from .policy import Policy
from .scheduler import GroupTracker, Prefetcher
from .staging import DirectBlock, StagingPool
from .stats import StepState
from .trace import TraceWriter

log = logging.getLogger("tba")


class Offloader:
    """Offloads the tensors autograd saves during ``with off.step(): ...`` to local disk.

    Long-lived: it owns the spill files, the staging pool and the I/O threads. Use one per
    process (or per model) and call :meth:`close` at the end, or use it as a context manager.
    """

    def __init__(self, config: Config | None = None, **overrides: Any):
        if config is None:
            config = Config(**overrides)
        elif overrides:
            config = config.replace(**overrides)
        self.config = config
        if config.sources.get("log_level") != "default":
            log.setLevel(config.log_level)  # only when asked: the application owns logging
        self.enabled = config.enabled
        self.closed = False
        self._lock = threading.RLock()
        self._steps = 0
        self._current: StepState | None = None
        self._last: StepState | None = None
        self._active_thread: int | None = None
        self._seq = 0
        self._disk_in_use = 0
        self._disk_full_step = -1
        self._disk_full_reason = "disk_full"
        self._warned: set[str] = set()
        self._pending: set[Future] = set()
        self._live: set[Entry] = set()
        self.param_storages: frozenset[int] = frozenset()
        self.metrics: RankMetrics | None = None
        if not self.enabled:
            self.backend = None
            return
        from .storage import open_backend

        self.backend = open_backend(config)
        try:
            self.metrics = RankMetrics(config, self.backend)
        except BaseException:
            self.backend.close()
            raise
        self.align = self.backend.alignment
        self.cache = Cache(self, self._lock)
        self.policy = Policy(config.min_offload_bytes)
        self.keeper = KeepController(config.keep_last, config.prefetch_bytes)
        self.depth = DepthController(config.prefetch_bytes)
        self.groups = GroupTracker(self.keeper.k, config.group_bytes)
        self._trace: TraceWriter | None = None
        if config.trace:
            self._trace = TraceWriter(
                config.trace,
                {
                    "pid": os.getpid(),
                    "rank": config.rank,
                    "backend": self.backend.name,
                    "backend_reason": self.backend.reason,
                    "config": config.as_dict(),
                },
            )
        self.prefetcher = Prefetcher(config.prefetch_bytes, self._start_read)
        self._adapters: dict[torch.device, tuple[DeviceAdapter, StagingPool]] = {}
        self._capture_pool: Any = None
        self._batches: dict[torch.device, Batch] = {}  # the open batch per device
        self._batch_bytes = batch_bytes(config.coalesce_bytes, config.staging_bytes, self.align)
        self._direct_ok = config.checksum == "off"  # NOTE [Direct capture] rule 3

    # -- public surface -----------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, model: nn.Module | None = None) -> Iterator[Offloader]:
        """Offload what autograd saves inside this block. Backward may run after it ends.

        ``model`` lets tba take groups from its blocks (see NOTE [Groups]); without it, groups
        are pack-order windows.
        """
        if not self.enabled:
            yield self
            return
        if self.closed:
            raise UsageError("tba.offloader: step() on a closed Offloader; create a new one.")
        me = threading.get_ident()
        with self._lock:
            if self._active_thread is not None:
                raise UsageError(
                    "tba.offloader: step() is already active; steps do not nest. End the "
                    "current `with off.step():` block before starting another."
                )
            self._active_thread = me
            self.cache.bury()
            self._observe_last()
            self._publish(settle=True)
            for adapter, _ in self._adapters.values():
                adapter.trim()  # forward runs without last backward's spare read buffers
            self.groups.keep_last = self.keeper.k
            self._steps += 1
            st = StepState(self._steps)
            self._current = st
            self.metrics.track(st)
            if model is not None:
                self.param_storages = self._model_storages(model)
            self.groups.begin(st, model)
        try:
            with OffloadHooks(self, st):
                yield self
        finally:
            with self._lock:
                self.cache.bury()
                self._seal_all()
                self.groups.end()
                st.finish_forward()
                self._active_thread = None
                self.param_storages = frozenset()
                self._last = st
                self.prefetcher.arm(st)
                self._publish(settle=False)

    def stats(self) -> dict[str, Any]:
        """Counters of the last step whose forward has ended (see ARCHITECTURE.md for keys)."""
        with self._lock:
            if self.enabled:
                self.cache.bury()
                self._publish(settle=False)  # the metrics' totals now include these numbers
            st = self._last
            if st is None:
                st = StepState(0)
            out = st.snapshot(self._disk_in_use)
            if self.enabled:
                out["backend"] = self.backend.name
                out["backend_reason"] = self.backend.reason
                out["keep_last"] = self.keeper.k
                out["keep_decision"] = dict(self.keeper.decision)
                out["prefetch_decision"] = dict(self.depth.decision)
                out["resident_bytes"] = self.cache.resident
                out["prefetch_inflight_bytes"] = self.prefetcher.inflight
                out["live_entries"] = len(self._live)
            return out

    def synchronize(self) -> None:
        """Write what is still being coalesced, then wait for every write and read so far."""
        if self.enabled:
            with self._lock:
                self._seal_all()
            self._drain()
            with self._lock:
                self.cache.bury()

    def close(self) -> None:
        """Finish in-flight I/O, bring back what live graphs still need, close the files."""
        if self.closed or not self.enabled:
            self.closed = True
            return
        with self._lock:
            self.closed = True
            self.prefetcher.drop_plans()
            self._seal_all()
        self._drain()
        with self._lock:
            unread = [e for e in self._live if e.state == ON_DISK and e.host is None]
            if unread:
                log.warning(
                    "tba.offloader: closing while live graphs still need %d saved tensors on "
                    "disk; reading them back into memory",
                    len(unread),
                )
            for e in unread:
                self._start_read(e)
        self._drain()
        with self._lock:
            for e in list(self._live):  # whatever is in memory now stays there, off the disk
                if e.state == ON_DISK and e.host is not None:
                    self._free_extent(e)
                    self.prefetcher.give_back(e)
                    e.state = MEMORY
        if self._capture_pool is not None:
            self._capture_pool.shutdown(wait=True)
        with self._lock:
            self._observe_last()
            self._publish(settle=True)
            self.metrics.close()
        if self._trace is not None:
            self._trace.close()
        for adapter, _ in self._adapters.values():
            adapter.trim()
        self.backend.close()

    def __enter__(self) -> Offloader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- pack side (called by the hook) -------------------------------------------------------
    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def reuse(self, h: Handle | KeptHandle, st: StepState) -> Handle | KeptHandle:
        """The same view saved again: no new bytes, one more use."""
        st.dedup_hits += 1
        if isinstance(h, Handle):
            h.packs += 1
            self._one_more_use(h.entry)
        return h

    def _one_more_use(self, e: Entry) -> None:
        """A save of ``e``: one more unpack to expect, and it moves up the prefetch order."""
        e.uses += 1
        e.left += 1
        e.seq = self.next_seq()

    def keep(self, t: torch.Tensor, key: Any, nbytes: int, reason: str, st: StepState):
        st.keep(reason)
        ke = self.cache.kept_entry(key[0], nbytes)
        ke.handles += 1
        h = KeptHandle(t, ke, key, self.groups.stat)
        self.cache.add_handle(h)
        return h

    def offload(
        self,
        t: torch.Tensor,
        storage: Any,
        key: Any,
        whole: bool,
        nbytes: int,
        stride: tuple[int, ...],
        offset: int,
        st: StepState,
        sref: StorageRef,
    ) -> Handle | str:
        """Capture ``t`` and start its write. Returns the handle, or the reason to keep it.
        ``sref``: the storage's weak reference (from the step's ``see``)."""
        ekey = (key[0], key[5]) if whole else key
        e = self.cache.entries.get(ekey) if whole else None
        if e is not None and e.state not in (DEAD, FAILED):
            st.dedup_hits += 1
        else:
            e = self._new_entry(t, storage, ekey, whole, nbytes, stride, st, sref)
            if isinstance(e, str):
                return e
        h = Handle(e, t, stride, offset, key)
        e.handles += 1
        self._one_more_use(e)
        self.cache.add_handle(h)
        return h

    def _new_entry(
        self, t, storage, ekey, whole, nbytes, stride, st: StepState, sref: StorageRef
    ) -> Entry | str:
        if self._disk_full_step == st.index:
            return self._disk_full_reason
        adapter, staging = self._device(t.device)
        batch = None
        if nbytes < self.config.coalesce_bytes:
            batch = self._batch_for(t.device, staging, nbytes, st)
        if batch is not None:
            block = batch.carve(nbytes)
            extent = None
            st.coalesced_tensors += 1
        else:
            block = None
            if isinstance(adapter, CpuAdapter):
                block = self._direct_block(t, storage, whole, nbytes, stride, staging)
            if block is None:
                block = staging.alloc(nbytes)
            elif isinstance(block, str):
                return block
            if block is None:
                return "staging_full"
            extent = self.backend.allocate(block.length)
            if extent is None:
                staging.free(block)
                return self._disk_full(st)
            if extent.length != block.length:  # pragma: no cover - alignment mismatch is a bug
                staging.free(block)
                self.backend.free(extent)
                raise TBAError(f"tba: staging {block.length} B != extent {extent.length} B")
        e = Entry(self.cache, st, ekey, sref, t, nbytes)
        e.staging, e.extent, e.padded = block, extent, block.length
        e.stat = self.groups.stat
        self.cache.charge(block.length)
        if batch is not None:
            e.batch, e.slot_at = batch, block.at
            batch.members.append(e)
        else:
            self._count_disk(st, extent.length)
        if whole:
            self.cache.entries[ekey] = e
        if isinstance(block, DirectBlock):
            e.skew = block.skew
            e.ticket, e.check = DONE, block.check
        else:
            if whole:
                src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                dst = block.part(0, nbytes)
            else:
                src = t
                dst = block.part(0, nbytes).view(t.dtype).as_strided(t.shape, stride)
            if block.length > nbytes:
                block.part(nbytes, block.length).zero_()  # zero-padded tail
            e.ticket = adapter.capture(dst, src)
            e.check = (t, t._version)
        self._live.add(e)
        st.tensors_offloaded += 1
        st.bytes_offloaded += nbytes
        e.stat.offloaded_bytes += nbytes
        st.entries.append(e)
        if e.ticket.done():
            self._captured(e)
        else:
            fut = self._capture_executor().submit(self._await_capture, e)
            self._pending.add(fut)
            fut.add_done_callback(self._discard_pending)
        return e

    def _direct_block(
        self, t, storage, whole: bool, nbytes: int, stride, staging: StagingPool
    ) -> DirectBlock | str | None:
        """A DirectBlock for ``t``'s own bytes, "staging_full" when they do not fit the staging
        budget, or None when ``t`` must be copied into staging (NOTE [Direct capture])."""
        if not self._direct_ok:
            return None
        if whole:
            source = torch.empty(0, dtype=torch.uint8).set_(storage)
        elif tuple(stride) == t.stride():  # a dense view: its bytes start at its data pointer
            start = t.storage_offset() * t.element_size()
            source = torch.empty(0, dtype=torch.uint8).set_(storage)[start : start + nbytes]
        else:
            return None
        if source.data_ptr() % t.element_size():  # pragma: no cover - torch aligns storages
            return None
        block = DirectBlock(source, t, self.align)
        return block if staging.hold(block) else "staging_full"

    def _discard_pending(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)

    def _await_capture(self, e: Entry) -> None:
        e.ticket.wait()
        with self._lock:
            self._captured(e)

    def _captured(self, e: Entry) -> None:
        """The staging bytes are final: verify the source was not modified, then write."""
        src, version = e.check
        e.check = None
        e.ticket = None
        b = e.batch
        if b is not None:
            b.pending -= 1
        if e.state == DEAD:
            self._release_io_resources(e)
        elif src._version != version:
            e.error = modified_error(src.shape, src.dtype, src._version, version)
            e.state = FAILED
            self._release_io_resources(e)
        elif b is None:
            self._write(e)
            return
        if b is not None:
            self._write_batch(b)  # when sealed and every member is captured

    def _write(self, e: Entry) -> None:
        e.state = WRITING
        e.io_busy = True
        t0 = time.perf_counter()
        e.stat.io_started(True, t0)
        fut = self.backend.write(e.extent, e.staging.view, self.config.checksum)
        self._pending.add(fut)
        fut.add_done_callback(lambda f, e=e, t0=t0: self._write_done(e, f, t0))

    def _write_done(self, e: Entry, fut: Future, t0: float | None = None) -> None:
        """A write of ``e`` ended; ``t0``: when it was issued, for a stand-alone entry (a
        batch accounts its one write itself)."""
        with self._lock:
            self._pending.discard(fut)
            e.io_busy = False
            err = fut.exception()
            if t0 is not None and err is None:
                self._io_finished(True, e, t0, e.padded)
            if e.state == DEAD:
                self._release_io_resources(e)
                return
            blk = e.staging
            if isinstance(blk, DirectBlock):  # NOTE [Direct capture] rule 2, failed write or not
                problem = blk.modified()
                if problem is not None:
                    e.error = problem
                    e.state = FAILED
                    self._release_io_resources(e)
                    return
                if blk.moved():
                    self._warn_once(
                        "moved",
                        "tba: the storage of a saved tensor was resized while tba wrote it; "
                        "keeping that tensor in memory, as stock PyTorch would read it",
                    )
                    self._to_memory(e)
                    return
            if err is not None:
                self._write_failed(e, err)
                return
            e.digest = fut.result()
            e.state = ON_DISK
            if e.want and e.host is None:
                e.host = self._copy_out(e)  # prefetch asked while it was being written
                e.from_disk = False
            self._free_staging(e)
            self.cache.bury()

    def _write_failed(self, e: Entry, err: BaseException) -> None:
        """Keep the bytes in memory: a failed write never loses data."""
        e.step.io_errors += 1
        self.metrics.io_error("write", err)
        code = getattr(err, "errno", None)
        if code in (errno.ENOSPC, errno.EDQUOT):
            self._disk_full_step = e.step.index
            self._disk_full_reason = "disk_full"
        self._warn_once(
            f"write-{code}",
            f"tba: a spill write failed ({err}); keeping its tensor in memory, exact",
        )
        self._to_memory(e)

    def _to_memory(self, e: Entry) -> None:
        """The entry's bytes move from staging to host memory for good (state MEMORY)."""
        if e.host is None:
            e.host = self._copy_out(e)
            e.from_disk = False
        self._free_staging(e)
        self._free_extent(e)
        e.state = MEMORY

    def _disk_full(self, st: StepState) -> str:
        """The backend refused an extent: keep in memory for the rest of the step. Returns the
        kept reason: "node_quota" (TBA_NODE_MAX_DISK_BYTES) or "disk_full"."""
        reason = getattr(self.backend, "refusal", "disk_full")
        self._disk_full_step = st.index
        self._disk_full_reason = reason
        if reason == "node_quota":
            self._warn_once(
                reason,
                "tba: the node-wide spill quota (TBA_NODE_MAX_DISK_BYTES="
                f"{self.config.node_max_disk_bytes}) is used up by the tba processes of this "
                "node; keeping in memory",
            )
        else:
            self._warn_once("disk_full", "tba: no disk space within quota; keeping in memory")
        return reason

    def _count_disk(self, st: StepState, nbytes: int) -> None:
        self._disk_in_use += nbytes
        st.peak_disk_bytes = max(st.peak_disk_bytes, self._disk_in_use)

    # -- coalescing (NOTE [Coalescing] in coalesce.py) ------------------------------------------
    def _batch_for(
        self, device: torch.device, staging: StagingPool, nbytes: int, st: StepState
    ) -> Batch | None:
        """The open batch of ``device`` with room for ``nbytes`` in the current group, or None."""
        b = self._batches.get(device)
        group = self.groups.group
        if b is not None and b.step == st.index and b.group == group and b.fits(nbytes):
            return b
        if b is not None:
            self._seal(b)
        block = staging.alloc(self._batch_bytes)
        if block is None:
            return None  # a stand-alone block may still fit
        b = self._batches[device] = Batch(block, device, group, st.index)
        b.staging_refs = 1  # held by the open batch until it is sealed
        return b

    def _seal_all(self) -> None:
        for b in list(self._batches.values()):
            self._seal(b)

    def _seal(self, b: Batch) -> None:
        if self._batches.get(b.device) is b:
            del self._batches[b.device]
        b.sealed = True
        self._write_batch(b)
        self._unref_staging(b)  # the open batch's own share

    def _write_batch(self, b: Batch) -> None:
        """One write of the batch's filled prefix, once it is sealed and fully captured."""
        if not b.sealed or b.pending or b.writing or not b.members:
            return
        live = [m for m in b.members if m.state == CAPTURE]
        b.members = []  # members refer to the batch; the batch forgets them
        if not live:
            return
        st = live[0].step
        n = b.write_length(self.align)
        extent = self.backend.allocate(n)
        if extent is None:
            self._disk_full(st)
            for m in live:
                self._to_memory(m)
            return
        if n > b.fill:
            b.block.part(b.fill, n).zero_()  # zero-padded tail
        b.extent, b.extent_refs = extent, len(live)
        self._count_disk(st, extent.length)
        st.coalesced_writes += 1
        for m in live:
            m.state = WRITING
            m.io_busy = True
            m.extent = extent
        b.writing = True
        b.staging_refs += 1  # the write reads the block
        t0 = time.perf_counter()
        live[0].stat.io_started(True, t0)  # a batch holds one group
        fut = self.backend.write(extent, b.block.view[:n], self.config.checksum)
        self._pending.add(fut)
        fut.add_done_callback(lambda f, b=b, live=live, t0=t0: self._batch_written(b, live, f, t0))

    def _batch_written(self, b: Batch, members: list[Entry], fut: Future, t0: float) -> None:
        with self._lock:
            b.writing = False
            if fut.exception() is None:
                self._io_finished(True, members[0], t0, b.extent.length)  # a batch: one group
            for m in members:
                self._write_done(m, fut)
            self._unref_staging(b)

    def _io_finished(self, write: bool, e: Entry, t0: float, nbytes: int) -> None:
        """A write or read of ``nbytes`` issued at ``t0`` succeeded: the group's and the step's
        I/O times (adaptive keep, trace) and the metrics."""
        now = time.perf_counter()
        e.stat.io_done(write, nbytes, now)
        e.step.io_span(write, t0, now, nbytes)
        self.metrics.io_log.append((write, now - t0, nbytes))

    def _unref_staging(self, b: Batch) -> None:
        b.staging_refs -= 1
        if b.staging_refs == 0 and b.block is not None:
            _, staging = self._device(b.device)
            staging.free(b.block)
            b.block = None

    def _start_batch_read(self, e: Entry) -> None:
        """Join or start the whole-batch read that brings ``e`` back (lock held)."""
        b = e.batch
        buf = b.read_back()
        if buf is not None:  # another member still holds the bytes: no I/O
            self.cache.charge(e.padded)
            e.host = b.slice_of(buf, e.slot_at, e.padded)
            e.from_disk = True
            e.step.bytes_reloaded += e.nbytes
            return
        fut = b.read_fut
        new = fut is None
        if new:
            adapter, _ = self._device(e.device)
            whole = adapter.host_buffer(e.extent.length, self.align)
            t0 = time.perf_counter()
            e.stat.io_started(False, t0)
            fut = self.backend.read(e.extent, io_buffer(whole), self.config.checksum, e.digest)
            fut.tba_buffer = whole  # type: ignore[attr-defined]
            fut.tba_t0 = t0  # type: ignore[attr-defined]
            b.read_fut, b.readers = fut, []
            self._pending.add(fut)
        self.cache.charge(e.padded)
        e.io_busy = True
        e.reading = fut
        b.readers.append(e)
        if new:  # after joining: a read that is already done serves ``e`` (and its views) now
            fut.add_done_callback(lambda f, b=b: self._batch_read_done(b, f))

    def _batch_read_done(self, b: Batch, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)
            if b.read_fut is fut:
                b.read_fut = None
            readers, b.readers = b.readers, []
            if readers and fut.exception() is None:
                t0, n = fut.tba_t0, len(fut.tba_buffer)  # type: ignore[attr-defined]
                self._io_finished(False, readers[0], t0, n)  # a batch: one group
            for e in readers:
                self._read_done(e, fut)

    def _copy_out(self, e: Entry) -> torch.Tensor:
        if isinstance(e.staging, DirectBlock):  # the source itself: no copy
            self.cache.charge(e.padded)
            return e.staging.tensor
        adapter, _ = self._device(e.device)
        host = adapter.host_buffer(e.padded, self.align)
        adapter.copy_staged(host, e.staging.tensor)
        self.cache.charge(e.padded)
        return host

    # -- unpack side --------------------------------------------------------------------------
    def unpack(self, h: Handle | KeptHandle) -> torch.Tensor:
        if isinstance(h, KeptHandle):
            if h.stat is not None:
                h.stat.unpacked(time.perf_counter())
            return h.unpack()
        e = h.entry
        e.stat.unpacked(time.perf_counter())
        if not e.step.backward_started:
            with self._lock:
                self.prefetcher.started(e.step, self._drop_read_back)
                self.prefetcher.pump()
        t = h.live_original()
        if t is not None:
            with self._lock:
                self.cache.bury()
                e.step.forwarded += 1
                self._consume(e)
            return t
        with self._lock:
            self.cache.bury()
            buf, _ = self._bytes_for(e)
            out = h.view_of(buf)
            if not e.from_disk:
                e.step.forwarded += 1
            self._consume(e)
        return out

    def _bytes_for(self, e: Entry) -> tuple[torch.Tensor, float]:
        """The entry's bytes on its device, reading or waiting as needed. Lock held."""
        if e.error is not None:
            raise e.error
        st = e.step
        if e.host is None and e.staging is not None:
            if e.ticket is not None:  # CUDA capture still running: wait for the copy
                self._lock.release()
                try:
                    e.ticket.wait()
                finally:
                    self._lock.acquire()
                if e.error is not None:
                    raise e.error
            if e.host is None and e.staging is not None:
                e.host = self._copy_out(e)
                e.from_disk = False
        elif e.host is None and e.state == ON_DISK and not e.io_busy:
            st.sync_loads += 1
            e.stat.sync_loads += 1
            if not e.budgeted:
                self.prefetcher.take(e)
            self._start_read(e)
        waited = 0.0
        while e.host is None and e.error is None:
            fut = e.reading
            if fut is None:  # pragma: no cover - a state the machine cannot reach
                raise TBAError(f"tba: entry {e!r} has no bytes and no read in flight")
            self._lock.release()
            t0 = time.perf_counter()
            try:
                wait_futures([fut])
            finally:
                waited += time.perf_counter() - t0
                self._lock.acquire()
            self._read_done(e, fut)
        st.stall_seconds += waited
        e.stat.stall_seconds += waited
        if e.error is not None:
            raise e.error
        if e.device.type != "cpu":
            if e.dev_buf is None:
                adapter, _ = self._device(e.device)
                e.dev_buf = adapter.to_device(e.host, e.device)
            return e.dev_buf, waited
        return e.host, waited

    def _consume(self, e: Entry) -> None:
        """One use unpacked. After the last use of this backward, drop the read-back bytes."""
        e.left -= 1
        if e.left > 0:
            return
        e.left = e.uses
        self._drop_read_back(e)
        self.prefetcher.pump()

    def _drop_read_back(self, e: Entry) -> None:
        """Let go of ``e``'s read-back bytes and its prefetch budget; the bytes stay on disk and
        are read again when wanted (after its last use, or NOTE [Plan order]). Lock held."""
        if e.state == ON_DISK and e.host is not None:
            self.cache.uncharge(e.padded)
            e.host = None
            e.dev_buf = None
        self.prefetcher.give_back(e)

    def _start_read(self, e: Entry) -> None:
        if e.batch is not None:
            self._start_batch_read(e)
            return
        adapter, _ = self._device(e.device)
        buf = adapter.host_buffer(e.padded, self.align)
        self.cache.charge(e.padded)
        e.io_busy = True
        t0 = time.perf_counter()
        e.stat.io_started(False, t0)
        fut = self.backend.read(e.extent, io_buffer(buf), self.config.checksum, e.digest)
        e.reading = fut
        fut.tba_buffer = buf  # type: ignore[attr-defined]
        fut.tba_t0 = t0  # type: ignore[attr-defined]
        self._pending.add(fut)
        fut.add_done_callback(lambda f, e=e: self._read_done(e, f))

    def _read_done(self, e: Entry, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)
            if e.reading is not fut:
                return  # the waiter already handled it
            e.reading = None
            e.io_busy = False
            buf = fut.tba_buffer  # type: ignore[attr-defined]
            if e.batch is not None and fut.exception() is None:
                buf = e.batch.slice_of(buf, e.slot_at, e.padded)
            err = fut.exception()
            if err is not None or e.state == DEAD:
                self.cache.uncharge(e.padded)
                if err is not None:
                    e.step.io_errors += 1
                    self.metrics.io_error("read", err)
                    if e.state != DEAD:  # a dead entry's extent is freed below, not kept FAILED
                        e.error = err if isinstance(err, StorageError) else _as_error(err, e)
                        e.state = FAILED
                if e.state == DEAD:
                    self._release_io_resources(e)
                return
            e.host = buf[e.skew :] if e.skew else buf  # NOTE [Direct capture]
            e.from_disk = True
            e.step.bytes_reloaded += e.nbytes
            if e.batch is None:
                self._io_finished(False, e, fut.tba_t0, e.padded)  # type: ignore[attr-defined]
            self.cache.bury()

    # -- lifetimes ----------------------------------------------------------------------------
    def retire(self, e: Entry) -> None:
        """The last handle of ``e`` died (called by the cache with the lock held)."""
        if e.state == DEAD:
            return
        e.state = DEAD
        self._live.discard(e)
        self.prefetcher.give_back(e)
        if e.host is not None:
            self.cache.uncharge(e.padded)
            e.host = None
            e.dev_buf = None
        if not e.io_busy and e.ticket is None:
            self._release_io_resources(e)

    def _release_io_resources(self, e: Entry) -> None:
        self._free_staging(e)
        self._free_extent(e)

    def _free_staging(self, e: Entry) -> None:
        if e.staging is not None:
            if e.batch is not None:
                self._unref_staging(e.batch)
            else:
                _, staging = self._device(e.device)
                staging.free(e.staging)
            self.cache.uncharge(e.padded)
            e.staging = None

    def _free_extent(self, e: Entry) -> None:
        ext = e.extent
        if ext is None:
            return
        e.extent = None
        b = e.batch
        if b is not None:
            b.extent_refs -= 1
            if b.extent_refs:
                return  # other members' bytes are still on it
        self.backend.free(ext)
        self._disk_in_use -= ext.length

    def _drain(self) -> None:
        while True:
            with self._lock:
                self.cache.bury()
                pending = list(self._pending)
            if not pending:
                return
            wait_futures(pending)

    # -- measurements (NOTE [Adaptive keep], tba/trace.py) -----------------------------------
    def _observe_last(self) -> None:
        """Feed the last step to the keep controller and the trace once its backward has run."""
        st = self._last
        if st is None or st.observed or not st.backward_end():
            return
        st.observed = True
        records = st.group_records()
        w, r = st.bandwidth(True), st.bandwidth(False)
        n = len(records)
        self.keeper.observe(
            st.index,
            records,
            w,
            r,
            lambda k: self.groups.kept_from(k, n),
            self.groups.max_keep(n),
        )
        self.depth.observe(st.index, records, r, st.largest_read())
        self.prefetcher.budget = self.keeper.prefetch = self.depth.depth
        if self._trace is not None:
            backward = max(0.0, st.backward_end() - st.forward_end)
            self._trace.step(
                st.index,
                records,
                {
                    "forward_seconds": st.forward_seconds,
                    "backward_seconds": backward,
                    "step_seconds": st.forward_seconds + backward,
                    "saved_bytes": st.saved_bytes,
                    "peak_resident_bytes": st.peak_resident_bytes,
                    "bytes_offloaded": st.bytes_offloaded,
                    "bytes_reloaded": st.bytes_reloaded,
                    "stall_seconds": st.stall_seconds,
                    "sync_loads": st.sync_loads,
                    "write_bps": w,
                    "read_bps": r,
                    "keep_last": st.keep_last,
                    "keep_decision": self.keeper.decision,
                },
            )

    # -- helpers ------------------------------------------------------------------------------
    def _publish(self, settle: bool) -> None:
        """Push counters and gauges to the metrics (NOTE [Metrics] in tba/metrics.py). With
        ``settle``, the steps that can no longer count are pushed one last time and forgotten:
        after its forward, only a step's live entries change its numbers. Lock held."""
        busy = {e.step for e in self._live} if settle else None
        staging = sum(pool.in_use for _, pool in self._adapters.values())
        self.metrics.publish(busy, self.cache.resident, staging, self._disk_in_use, self.keeper.k)

    def note_resident(self, value: int) -> None:
        st = self._current
        if st is not None and value > st.peak_resident_bytes:
            st.peak_resident_bytes = value

    def _device(self, device: torch.device) -> tuple[DeviceAdapter, StagingPool]:
        got = self._adapters.get(device)
        if got is None:
            if device.type == "cpu":
                adapter: DeviceAdapter = CpuAdapter(2 * self.config.prefetch_bytes)
            else:  # device memory straight to disk when the backend can (kvikio with GDS)
                adapter = adapter_for(device, direct=getattr(self.backend, "device_direct", False))
            arena = adapter.staging_arena(self.config.staging_bytes, self.align)
            register = getattr(self.backend, "register", None)
            # Registering pins (and so faults in) the whole arena. With direct capture the CPU
            # arena serves only coalesced small tensors, and its untouched pages should cost
            # nothing (NOTE [Direct capture]).
            if register is not None and not (isinstance(adapter, CpuAdapter) and self._direct_ok):
                register(arena)  # long-lived: the engine may pin/map it once (False: it cannot)
            got = self._adapters[device] = (adapter, StagingPool(arena, self.align))
        return got

    def _capture_executor(self) -> Any:
        if self._capture_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._capture_pool = ThreadPoolExecutor(1, thread_name_prefix="tba-capture")
        return self._capture_pool

    @staticmethod
    def _model_storages(model: nn.Module) -> frozenset[int]:
        return frozenset(
            p.untyped_storage()._cdata
            for p in (*model.parameters(), *model.buffers())
            if p.layout is torch.strided
        )

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg)


def _as_error(err: BaseException, e: Entry) -> StorageError:
    ext = e.extent
    code = getattr(err, "errno", None) or errno.EIO
    return StorageError("read", "spill file", ext.offset if ext else -1, e.padded, code, str(err))
