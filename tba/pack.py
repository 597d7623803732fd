"""The Packer: what happens to a tensor autograd saves, from the pack hook to its bytes on disk.

``pack`` decides in order: exclude (parameters and their views), recompute (weight casts,
NOTE [Weight-derived tensors] in tba/derived.py), dedup (the same view saved again), keep
(every reason a tensor stays in memory is decided here, see tba/policy.py for their names),
offload. It never waits for I/O: a capture is a memcpy into staging or the
tensor's own memory (CPU, NOTE [Direct capture] in tba/staging.py) or an async copy (CUDA), and
the write runs on an I/O thread. Small tensors share one write (NOTE [Coalescing] in
tba/coalesce.py). The one wait it may do is for staging, when asked to (NOTE [Staging
backpressure]). When a write fails, or the disk refuses, the bytes stay in memory: a tensor
is never lost.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from .coalesce import Batch, batch_bytes
from .derived import derived
from .device import CpuAdapter
from .entry import DEAD, FAILED, Entry
from .errors import internal_error, modified_error
from .handle import Handle, KeptHandle, layout
from .index import Index
from .io import IO
from .policy import PLAIN_TYPES, Policy, is_parameter_like, unsupported
from .reasons import KEPT_REASONS, kept_reason_for
from .scheduler import GroupTracker
from .staging import DirectBlock, StagingPool
from .step import StepState, StorageRef
from .subclass import DTensorHandle, is_dtensor, local_of, waited
from .subclass import kind as subclass_name


class Packer:
    """Packs saved tensors of the current step (see the module docstring)."""

    def __init__(self, io: IO, index: Index, policy: Policy, groups: GroupTracker):
        self.io = io
        self.index = index
        self.policy = policy
        self.groups = groups
        cfg = io.config
        self.coalesce_bytes = cfg.coalesce_bytes
        self.recompute_weights = cfg.recompute_weights
        self.batch_bytes = batch_bytes(cfg.coalesce_bytes, cfg.staging_bytes, io.align)
        self.param_storages: frozenset[int] = frozenset()  # of the model given to step()
        self._seq = 0
        self._batches: dict[torch.device, Batch] = {}  # the open batch per device
        self._refused_step = -1  # the step in which the backend refused an extent
        self._refused_reason = "disk_full"
        self._waited_out = -1  # the step in which a staging wait timed out

    # -- the pack hook ------------------------------------------------------------------------
    def pack(self, t: torch.Tensor, st: StepState) -> Any:
        """What autograd stores for ``t``: a handle, a kept handle, or ``t`` itself."""
        if unsupported(t):
            return self._unsupported(t, st)
        if is_parameter_like(t, self.param_storages):
            return t  # held by the model anyway; never written, never counted
        if self.recompute_weights:
            d = derived(t, self.param_storages)
            if d is not None:  # a weight cast: rebuilt at unpack (NOTE [Weight-derived tensors])
                storage = t.untyped_storage()
                with self.io.lock:
                    st.packs += 1
                    st.recomputed(storage, storage._cdata, d.nbytes)
                return d
        storage = t.untyped_storage()
        key = (storage._cdata, t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
        index = self.index
        with self.io.lock:
            index.bury()
            st.packs += 1
            h = index.find(key)
            if h is not None:  # the same view saved again: no new bytes, one more use
                st.dedup_hits += 1
                h.stat = self.groups.stat  # the last saver's backward unpacks it first
                if isinstance(h, Handle):
                    h.packs += 1
                    h.entry.saved(self._next_seq())
                return h
            snbytes = storage.nbytes()
            seen = st.saved_bytes
            sref = st.see(storage, key[0], snbytes)
            whole, nbytes, stride, offset = layout(t, snbytes, key[3])
            reason = self.policy.keep_reason(nbytes, self.groups.on_pack(nbytes))
            gs = self.groups.stat
            gs.saved_bytes += st.saved_bytes - seen
            gs.tensors += 1
            gs.packed_bytes += nbytes
            if reason is None:
                got = self.offload(t, storage, key, whole, nbytes, stride, offset, st, sref)
                if not isinstance(got, str):
                    return got
                reason = got
            gs.kept_bytes += nbytes
            if reason == "group":
                gs.keepable_bytes += nbytes
            st.keep(reason)
            h = KeptHandle(t, index.kept_entry(key[0], snbytes), key, gs)
            index.add_handle(h)
            return h

    def _unsupported(self, t: torch.Tensor, st: StepState) -> Any:
        """A DTensor goes through its local shard (NOTE [DTensor]); anything else stays."""
        if is_dtensor(t):
            if t.requires_grad and t.is_leaf:
                return t  # a DTensor parameter: held by the model anyway
            return DTensorHandle(self.pack(local_of(t), st), t)
        inner = waited(t)  # an AsyncCollectiveTensor: its plain tensor
        if inner is not None:
            return self.pack(inner, st)
        reason = "unsupported" if type(t) in PLAIN_TYPES else "subclass"
        with self.io.lock:  # I/O threads count into the same step (NOTE [Counted once])
            st.packs += 1
            st.keep(reason)
            if reason == "subclass":
                name = subclass_name(t)
                self.io.warn_once(
                    f"subclass-{name}",
                    f"tba.pack: keeping saved tensors of type {name} in memory "
                    f"(stats()['kept_reasons']['subclass']): tba offloads plain tensors, and "
                    f"DTensor through its local shard, but cannot capture this subclass's "
                    f"bytes; the memory they take is not saved.",
                )
        return t

    def count_hidden(self, t: torch.Tensor, st: StepState) -> int:
        """Count a tensor a recomputed block saves inside its checkpoint (tba never holds it)
        in ``saved_bytes``, once per storage; returns the bytes added (NOTE [Block policy])."""
        if unsupported(t) or is_parameter_like(t, self.param_storages):
            return 0
        storage = t.untyped_storage()
        cdata = storage._cdata
        with self.io.lock:
            ref = st.seen.get(cdata)
            if ref is not None and ref.expired():  # freed, and a new storage at its address
                del st.seen[cdata]
            before = st.saved_bytes
            st.see(storage, cdata, storage.nbytes())
            return st.saved_bytes - before

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def offload(
        self, t, storage, key, whole: bool, nbytes: int, stride, offset: int, st, sref
    ) -> Handle | str:
        """A handle on ``t``'s captured bytes, or the reason to keep it."""
        ekey = (key[0], key[5]) if whole else key
        e = self.index.entries.get(ekey) if whole else None
        if e is not None and e.state is not DEAD and e.state is not FAILED:
            st.dedup_hits += 1  # another view of a storage already captured whole
        else:
            e = self._capture(t, storage, ekey, whole, nbytes, stride, st, sref)
            if isinstance(e, str):
                return e
        h = Handle(e, t, stride, offset, key, self.groups.stat)
        e.saw(h.ref)
        e.saved(self._next_seq())
        self.index.add_handle(h)
        return h

    # -- capture ------------------------------------------------------------------------------
    def _capture(self, t, storage, ekey, whole, nbytes, stride, st: StepState, sref: StorageRef):
        """A new entry whose bytes are captured (or being captured), or the reason to keep."""
        if self._refused_step == st.index:
            return self._refused_reason
        io = self.io
        adapter, staging = io.device(t.device)
        batch = extent = None
        if nbytes < self.coalesce_bytes:
            batch = self._batch_for(t.device, staging, nbytes, st)
        if batch is not None:
            block = batch.carve(nbytes)
            st.coalesced_tensors += 1
        else:
            direct = None
            if isinstance(adapter, CpuAdapter):
                direct = self._direct_block(t, storage, whole, nbytes, stride)
            if direct is None:
                block = self._room(st, staging, nbytes, lambda: staging.alloc(nbytes))
            else:
                held = lambda: direct if staging.hold(direct) else None  # noqa: E731
                block = self._room(st, staging, direct.length, held)
            if block is None:
                return "staging_full"
            extent = io.backend.allocate(block.length)
            if extent is None:
                block.release()
                return self._refused(st)
            if extent.length != block.length:
                block.release()
                io.backend.free(extent)
                raise internal_error(
                    "pack", f"staging of {block.length} B got an extent of {extent.length} B"
                )
        span = None
        if isinstance(block, DirectBlock):
            ticket, check, skew = None, block.check, block.skew
            span = (skew, skew + nbytes)  # only its own bytes (NOTE [Direct capture] rule 3)
        else:
            if whole:
                src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                dst = block.part(0, nbytes)
            else:
                src = t
                dst = block.part(0, nbytes).view(t.dtype).as_strided(t.shape, stride)
            if block.length > nbytes:
                block.part(nbytes, block.length).zero_()  # zero-padded tail
            ticket, check, skew = adapter.capture(dst, src), (t, t._version), 0
        gs = self.groups.stat
        e = Entry(self.index.graveyard, st, ekey, sref, t.device, nbytes, block, extent, gs)
        e.captured_by(ticket, check, batch, skew, span)
        self.index.charge(block.length)
        if batch is None:
            io.count_disk(st, extent.length)
        if whole:
            self.index.entries[ekey] = e
        io.live.add(e)
        st.entries.append(e)  # counted offloaded once written (NOTE [Counted once])
        if ticket is None or ticket.done():
            self._captured(e)
        else:  # a device copy still running: a thread waits for it, then writes
            fut = io.capture_executor().submit(self._await_capture, e)
            io.pending.add(fut)
            fut.add_done_callback(self._capture_waited)
        return e

    def _direct_block(self, t, storage, whole: bool, nbytes: int, stride):
        """A DirectBlock for ``t``'s own bytes (not yet counted against the staging budget), or
        None when ``t`` must be copied into staging (NOTE [Direct capture])."""
        if whole:
            source = torch.empty(0, dtype=torch.uint8).set_(storage)
        elif tuple(stride) == t.stride():  # a dense view: its bytes start at its data pointer
            start = t.storage_offset() * t.element_size()
            source = torch.empty(0, dtype=torch.uint8).set_(storage)[start : start + nbytes]
        else:
            return None
        if source.data_ptr() % t.element_size():  # pragma: no cover - torch aligns storages
            return None
        return DirectBlock(source, t, self.io.align)

    def _room(self, st: StepState, staging: StagingPool, nbytes: int, get):
        """``get()``: a staging block (or a held DirectBlock), or None when staging is full.
        With TBA_STAGING_FULL=wait, a full staging is waited for (NOTE [Staging backpressure]).
        Lock held; released while waiting."""
        seen = staging.frees
        got = get()
        cfg = self.io.config
        if got is not None or cfg.staging_full != "wait" or self._waited_out == st.index:
            return got
        if nbytes > staging.capacity:
            return None  # could never fit: waiting would only add a stall
        self.seal_all()  # a batch being filled frees its staging only once written
        io = self.io
        got, waited = staging.wait_for(get, seen, cfg.staging_wait, io.lock, io.clock)
        st.stall_seconds += waited
        st.pack_stall_seconds += waited
        if got is None:
            self._waited_out = st.index
            io.warn_once(
                "staging-wait",
                f"tba.pack: staging stayed full for TBA_STAGING_WAIT={cfg.staging_wait:g} s "
                f"(writes are not keeping up); keeping saved tensors in memory for the rest of "
                f"step {st.index} (kept_reasons['staging_full']). Raise TBA_STAGING_BYTES or "
                f"TBA_STAGING_WAIT, or check the spill drive.",
            )
        return got

    def _refused(self, st: StepState) -> str:
        """The backend refused an extent: returns the kept reason it names (tba/reasons.py)."""
        backend = self.io.backend
        return self._stop(st, backend.refusal, backend.refusal_detail)

    def _stop(self, st: StepState, reason: str, detail: str) -> str:
        """The disk cannot take more for now: keep in memory for the rest of the step, and
        say why once per reason, with the errno or the numbers and the fix."""
        self._refused_step = st.index
        self._refused_reason = reason
        self.io.warn_once(
            f"refused-{reason}",
            f"tba.pack: keeping saved tensors in memory for the rest of step {st.index} "
            f"({reason}): {detail or KEPT_REASONS.get(reason, reason)}",
        )
        return reason

    def _capture_waited(self, fut: Future) -> None:
        with self.io.lock:
            self.io.settled(fut)

    def _await_capture(self, e: Entry) -> None:
        e.ticket.wait()
        with self.io.lock:
            self._captured(e)

    def _captured(self, e: Entry) -> None:
        """The captured bytes are final: check the source was not modified, then write."""
        src, version = e.capture_done()
        b = e.batch
        if b is not None:
            b.captured()
        if e.state is DEAD:
            e.settle("dropped")
            self.io.release(e)
        elif src._version != version:
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
        fut, t0 = self.io.write(e.extent, e.staging.view, e.stat, e.span)
        fut.add_done_callback(lambda f, e=e, t0=t0: self._write_done(e, f, t0))

    def _write_done(self, e: Entry, fut: Future, t0: float | None = None) -> None:
        """A write of ``e`` ended; ``t0``: when it was issued, for a stand-alone entry (a
        batch accounts its one write itself)."""
        io = self.io
        with io.lock:
            io.settled(fut)
            e.write_ended()
            err = fut.exception()
            if t0 is not None and err is None:
                io.finished(True, e, t0, e.padded)
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
            e.written(fut.result())
            e.settle(None)
            if e.want and e.host is None:  # prefetch asked while it was being written
                io.staged_to_host(e)
            else:
                io.free_staging(e)
            self.index.bury()
            if e.want:
                io.on_host()  # NOTE [Device prefetch]

    def _write_failed(self, e: Entry, err: BaseException) -> None:
        """Keep the bytes in memory: a failed write never loses data. A full, removed,
        read-only or forbidden spill directory stops offloading for the rest of the step."""
        io = self.io
        io.failed("write", err, e.step)
        reason = kept_reason_for(getattr(err, "errno", None))
        if reason != "io_error":
            self._stop(e.step, reason, str(err))
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
    def _batch_for(self, device, staging: StagingPool, nbytes: int, st: StepState):
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
        extent = io.backend.allocate(n)
        if extent is None:
            reason = self._refused(st)
            for m in live:
                self._to_memory(m, reason)
            return
        if n > b.fill:
            b.block.part(b.fill, n).zero_()  # zero-padded tail
        b.start_write(extent, len(live))
        io.count_disk(st, extent.length)
        st.coalesced_writes += 1
        for m in live:
            m.start_write(extent)
        fut, t0 = io.write(extent, b.block.view[:n], live[0].stat)  # a batch holds one group
        fut.add_done_callback(lambda f, b=b, live=live, t0=t0: self._batch_written(b, live, f, t0))

    def _batch_written(self, b: Batch, members: list[Entry], fut: Future, t0: float) -> None:
        with self.io.lock:
            if fut.exception() is None:
                self.io.finished(True, members[0], t0, b.extent.length)  # a batch: one group
            for m in members:
                self._write_done(m, fut)
            b.write_ended()
