"""The Packer: what happens to a tensor autograd saves, from the pack hook to its captured bytes.

``pack`` decides in order: exclude (parameters and their views), recompute (weight casts,
NOTE [Weight-derived tensors] in tba/datapath/capture/derived.py), dedup (the same view saved
again), keep (every reason a tensor stays in memory is decided here, see tba/decide/keep.py for
their names), offload. It never waits for I/O: a capture is a memcpy into staging or the
tensor's own memory (CPU, NOTE [Direct capture] in tba/datapath/capture/staging.py) or an async copy
(CUDA), and the Writer (tba/datapath/write.py) takes it from there: the write runs on an I/O thread,
and small tensors share one write (NOTE [Coalescing] in tba/datapath/capture/coalesce.py). The one
wait a pack may do is for staging, when asked to (NOTE [Staging backpressure]). When a write fails,
or the disk refuses, the bytes stay in memory: a tensor is never lost.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from ..decide.keep import PLAIN_TYPES, Policy, is_parameter_like, unsupported
from ..errors import internal_error
from ..host.memory import align_up
from ..records.entry import DEAD, FAILED, Entry
from ..records.handle import Handle, KeptHandle, Passed, kept_alias, layout
from ..records.index import Index
from ..records.step import StepState, StorageRef
from .blocks.groups import GroupTracker
from .blocks.kept import KeptBlocks
from .blocks.selective import kept_by_selective
from .capture.derived import FrozenCasts, derived
from .capture.device import CpuAdapter
from .capture.dtensor import DTensorHandle, is_dtensor, local_of, waited
from .capture.dtensor import kind as subclass_name
from .capture.staging import DirectBlock, HostBlock, StagingPool
from .io import IO
from .write import Writer

# NOTE [Hot path]
# Autograd calls pack for every tensor it saves, on the training thread, and on a GPU whatever
# the hook does in Python is taken from the launch queue. What a tensor that is not moved (kept:
# small, in a kept or recomputed block, under TBA_POLICY=keep) costs, in order:
# 1. the hook itself is a plain function: dynamo is told to skip its code and all it calls
#    (tba/datapath/hook.py, ``eager_only``), with no wrapper per call; it times itself (two clock
#    readings, NOTE [Hook time]) only for the chooser (TBA_POLICY=auto, TBA_BLOCK_POLICY) and
#    the trace;
# 2. ``unsupported`` (attribute reads only), then parameters and their views, then the model's
#    weight and buffer storages (a frozenset found once per model, NOTE [Model storages] in
#    tba/datapath/offloader.py): those are passed through with their version (a Passed);
# 3. a weight cast is recognised from its grad_fn alone (no walk unless the node is a cast),
#    looked at only for tensors that require grad; one that does not (a frozen weight's cast)
#    is looked at only when its storage size is one of a frozen parameter's casts (a set,
#    empty unless the step's model has frozen parameters);
# 4. the fast path, while the forward is in a block (or in any window under TBA_POLICY=keep)
#    and no chooser measures what blocks save (``GroupTracker.fast_ok``): a tensor whose group
#    keeps everything (``GroupTracker.fast``: a kept block, a recomputed block's inputs) or whose
#    storage is under TBA_MIN_OFFLOAD_BYTES, on a storage that tba neither keeps nor has
#    captured yet, is kept with no key, no dedup lookup and no layout (unless it is not
#    contiguous): under the I/O lock (uncontended unless a write or read completes at the same
#    moment), the storage's KeptEntry, the step's and the group's counters, the KeptHandle.
#    Anything else takes the general path below it (dedup lookup, saved_bytes, layout, the
#    group's decision), which any storage saved a second time takes too;
# 5. unpack checks the handle's version and notes its group's backward time (one clock
#    reading), in the hook, without going through the Reader.
# 6. cheaper still, a block whose tensors all took the fast path (or were views of kept
#    storages) when it was measured runs without tba's hooks on later steps of the same
#    signature, its counts credited (NOTE [Kept blocks without hooks] in
#    tba/datapath/blocks/kept.py): no pack or unpack call at all.
# The objects a kept tensor leaves alive for the cyclic GC to track (bench_hotpath counts them),
# and what each is for: the KeptHandle (what autograd holds; its __del__ returns the storage's
# charge, NOTE [Deferred release]); the alias without grad_fn that it holds (NOTE [No cycle
# through the graph]); the KeptEntry, once per storage, which is also the storage's weak
# reference for the step (NOTE [Storage identity] in tba/records/index.py); the storage's
# Python object and the producer node's, which torch keeps for as long as the storage and the
# node once ``untyped_storage()`` and ``grad_fn`` have been read. An offloaded tensor adds its
# key (whose shape and strides it shares with other tensors', NOTE [Shared geometry]), its
# Entry, the witness of its version (NOTE [Version witness]), its weak reference and the one in
# the dedup index, and what its capture and write take.

# NOTE [Byte capture]
# A CPU tensor copied into staging (a coalesced slot, or a block of its own when direct capture
# does not apply) whose bytes are one run of memory, the whole storage or a dense view of it
# (its layout keeps its own strides, so the slot holds that run as it is), is copied with one
# ctypes.memmove from its address into the slot's: the same bytes a uint8 ``copy_`` would
# write, without the two tensor views and the dispatch that cost more than the memcpy itself
# at the sizes coalescing takes. It completes before pack returns, on the packing thread, so
# the entry keeps no (source, version) pair to recheck: no in-place update can come between.
# A view that is not dense, and every device copy, goes through the adapter's ``capture``.
_memmove = ctypes.memmove

# NOTE [Shared geometry]
# Each handle keeps its view's shape (a torch.Size, which the cyclic GC tracks for as long as it
# lives) and strides (a tuple), and its dedup key holds both. A model saves tensors of a handful
# of shapes, so the general path hands every key the first equal Size and stride tuple it saw,
# and the ones torch just made are freed at once instead of living as long as the handle: two
# objects less per saved tensor for the GC to walk. Equal values are interchangeable (both are
# immutable, and the key compares them by value). At most _SHARED_MAX of each are remembered;
# past that the table starts over, so a model of ever-new shapes costs what it did before.
_SHARED_MAX = 4096


class Packer:
    """Packs saved tensors of the current step (see the module docstring)."""

    def __init__(self, io: IO, index: Index, policy: Policy, groups: GroupTracker):
        self.io = io
        self.index = index
        self.policy = policy
        self.groups = groups
        cfg = io.config
        self.coalesce_bytes = cfg.coalesce_bytes
        self.min_offload_bytes = policy.min_offload_bytes
        self.recompute_weights = cfg.recompute_weights
        # what selective would keep of each block: weighed by the chooser (auto), and compared
        # with what it kept where blocks run selective
        self.measure_cacheable = cfg.policy in ("auto", "selective") or bool(cfg.block_policy)
        groups.fast_allowed = not self.measure_cacheable
        # NOTE [Kept blocks without hooks] in tba/datapath/blocks/kept.py
        groups.kept_blocks = KeptBlocks(io.lock, index, allowed=not cfg.trace)
        # the hooks time themselves only for the chooser and the trace (NOTE [Hook time])
        self.time_hooks = cfg.policy == "auto" or bool(cfg.block_policy) or bool(cfg.trace)
        self.writer = Writer(io, index, groups, cfg)
        self.param_storages: frozenset[int] = frozenset()  # of the model given to step()
        self.frozen = FrozenCasts()  # its frozen parameters, while a step has it
        self._seq = 0
        self._waited_out = -1  # the step in which a staging wait timed out
        self._shapes: dict[torch.Size, torch.Size] = {}  # NOTE [Shared geometry]
        self._strides: dict[tuple[int, ...], tuple[int, ...]] = {}

    # -- the pack hook ------------------------------------------------------------------------
    def pack(self, t: torch.Tensor, st: StepState) -> Any:
        """What autograd stores for ``t``: a handle, a kept handle, a recipe, or ``t`` itself
        with its version (NOTE [Passed through]). NOTE [Hot path] says what each step costs."""
        if unsupported(t):
            return self._unsupported(t, st)
        grad = t.requires_grad  # with is_leaf false: it has a grad_fn (the alias below)
        if grad and t.is_leaf:
            return Passed(t, leaf=True)  # held by the model anyway; never written, never counted
        base = t._base
        if base is not None and base.requires_grad and base.is_leaf:
            return Passed(t, leaf=True)
        storage = t.untyped_storage()
        cdata = storage._cdata
        if cdata in self.param_storages:  # a frozen weight or a buffer of the model, or a view
            return Passed(t, leaf=True)
        if grad and self.recompute_weights:
            d = derived(t, self.param_storages)
            if d is not None:  # a weight cast: rebuilt at unpack (NOTE [Weight-derived tensors])
                with self.io.lock:
                    st.packs += 1
                    st.recomputed(storage, cdata, d.nbytes)
                return d
        elif self.frozen.sizes and not grad and storage.nbytes() in self.frozen.sizes:
            d = self.frozen.derived(t, storage)  # a frozen weight's cast? (rule 5 of the NOTE)
            if d is not None:
                with self.io.lock:
                    st.packs += 1
                    st.recomputed(storage, cdata, d.nbytes)
                return d
        groups = self.groups
        index = self.index
        if groups.fast_ok and cdata not in index.kept and cdata not in index.captured:
            # NOTE [Hot path]: kept without a key, the dedup lookup or the layout
            reason = groups.fast
            snbytes = storage.nbytes()
            if reason is not None or snbytes < self.min_offload_bytes:
                nbytes = t.nbytes if t.is_contiguous() else layout(t, snbytes)[1]
                # "small" first, as Policy.keep_reason has it (snbytes under it: nbytes too)
                why = "small" if reason is None or nbytes < self.min_offload_bytes else reason
                with self.io.lock:
                    e = index.kept_entry(storage, cdata, snbytes)
                    st.packs += 1
                    st.tensors_kept += 1
                    st.kept_fast += 1
                    st.kept_reasons[why] += 1
                    if not groups.by_model:  # pack-order windows (all kept: TBA_POLICY=keep)
                        window = groups.packed // groups.group_bytes
                        groups.window = window
                        if window != groups.group:
                            groups.switch_kept(window)
                    groups.packed += nbytes
                    gs = groups.stat
                    counted = st.seen
                    if cdata not in counted:  # counted once in this step (the record is its ref)
                        counted[cdata] = e
                        st.saved_bytes += snbytes
                        gs.saved_bytes += snbytes
                        gs.sizes.append(snbytes)
                    gs.tensors += 1
                    gs.packed_bytes += nbytes
                    gs.kept_bytes += nbytes
                    if why == "group":
                        gs.keepable_bytes += nbytes
                    return KeptHandle(t.detach() if grad else t, t._version, e, gs)
        shape, stride = self._shared(t.shape, t.stride())  # NOTE [Shared geometry]
        key = (cdata, t.storage_offset(), shape, stride, t.dtype, t._version)
        with self.io.lock:
            index.bury()
            st.packs += 1
            h = index.find(key)
            if h is not None:  # the same view saved again: no new bytes, one more use
                st.dedup_hits += 1
                h.stat = groups.stat  # the last saver's backward unpacks it first
                h.packs += 1
                h.entry.saved(self._next_seq())
                return h
            kept = index.kept.get(cdata)
            if kept is not None:  # a storage kept resident already: one more kept handle on it
                st.dedup_hits += 1
                st.kept_dedup += 1
                return KeptHandle(kept_alias(t), t._version, kept, groups.stat)
            snbytes = storage.nbytes()
            seen = st.saved_bytes
            sref = st.see(storage, cdata, snbytes)
            whole, nbytes, stride, offset = layout(t, snbytes, stride)
            compiled = groups.outside_blocks() and groups.in_enclosing_region()
            reason = self.policy.keep_reason(nbytes, groups.on_pack(nbytes, compiled))
            if compiled and reason is None:
                reason = "compiled"  # NOTE [Enclosing compiled regions]
                self._warn_compiled()
            gs = groups.stat
            new = st.saved_bytes - seen  # a storage first seen now: its bytes, else 0
            if new:
                gs.saved_bytes += new
                gs.sizes.append(new)  # NOTE [Measured layout] in tba/decide/simulator/rules.py
                if self.measure_cacheable and kept_by_selective(t):  # NOTE [Selective recompute]
                    gs.cacheable_bytes += new
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
            return KeptHandle(
                kept_alias(t), t._version, index.kept_entry(storage, cdata, snbytes), gs
            )

    def _shared(
        self, shape: torch.Size, stride: tuple[int, ...]
    ) -> tuple[torch.Size, tuple[int, ...]]:
        """The first equal shape and stride seen (NOTE [Shared geometry]). No lock: the tables
        only ever map a value to an equal one, so a race would cost a duplicate, nothing more."""
        shapes, strides = self._shapes, self._strides
        s = shapes.get(shape)
        if s is None:
            if len(shapes) >= _SHARED_MAX:
                shapes.clear()
            s = shapes[shape] = shape
        d = strides.get(stride)
        if d is None:
            if len(strides) >= _SHARED_MAX:
                strides.clear()
            d = strides[stride] = stride
        return s, d

    def _warn_compiled(self) -> None:
        name = self.groups.model.name if self.groups.model is not None else "the model"
        self.io.warn_once(
            "compiled-region",
            f"tba.pack: keeping in memory what a torch.compile region saves "
            f"(stats()['kept_reasons']['compiled']): the region encloses the blocks of {name}, "
            "so everything it saves exists at once when it ends and again when its backward "
            "starts, and writing it would not lower the peak. To offload (or recompute) by "
            "block, compile each block instead and leave the model uncompiled: "
            "tba.compile_blocks(model), or `model.layers[i] = torch.compile(model.layers[i])`.",
        )

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
        return Passed(t) if reason == "unsupported" else t

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

    def count_seen(self, st: StepState, tensors: list[torch.Tensor]) -> None:
        """Mark storages as counted in ``saved_bytes`` without adding their bytes: a recomputed
        block saved them itself, in the bytes credited to it (item 5 of NOTE [Block policy])."""
        with self.io.lock:
            for t in tensors:
                if not unsupported(t):
                    storage = t.untyped_storage()
                    st.see(storage, storage._cdata, 0)

    def hold_cached(self, st: StepState, gs: Any, tensors: list[torch.Tensor]) -> list[Any]:
        """Charge the outputs a selective block keeps until its recompute (NOTE [Selective
        recompute], point 3) as kept storages, each once; the handles returned hold the charge,
        which ends when they are dropped."""
        held = []
        with self.io.lock:
            for t in tensors:
                if unsupported(t) or is_parameter_like(t, self.param_storages):
                    continue
                storage = t.untyped_storage()
                cdata, nbytes = storage._cdata, storage.nbytes()
                fresh = cdata not in self.index.kept
                h = KeptHandle(
                    kept_alias(t), t._version, self.index.kept_entry(storage, cdata, nbytes), gs
                )
                if fresh:
                    gs.cached_bytes += nbytes
                held.append(h)
        return held

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
        writer = self.writer
        refusing = writer.refusing(st)
        if refusing is not None:
            return refusing
        io = self.io
        dev = t.device
        adapter, staging = io.device(dev)
        cpu = isinstance(adapter, CpuAdapter)
        batch = extent = None
        if nbytes < self.coalesce_bytes:
            batch = writer.batch_for(dev, staging, nbytes, st)
        if batch is not None:
            block = batch.carve(nbytes)
            st.coalesced_tensors += 1
        else:
            direct = block = None
            if cpu:
                direct = self._direct_block(t, storage, whole, nbytes, stride)
            else:  # NOTE [Host capture]: into the tier itself
                block = self._host_block(dev, nbytes, staging.align)
            if block is not None:
                extent = block.extent
            elif direct is None:  # the arena holds no more than its capacity, alone or not
                get = lambda alone=False: staging.alloc(nbytes, alone)  # noqa: E731
                block = self._room(st, staging, nbytes, get, nbytes <= staging.capacity)
            else:
                held = lambda alone=False: direct if staging.hold(direct, alone) else None  # noqa: E731
                block = self._room(st, staging, direct.length, held, True)
            if block is None:
                return "staging_full"
            if extent is None:
                extent = io.allocate(block.length, dev, self.groups.stat)
            if extent is None:
                block.release()
                return writer.refused(st)
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
            if block.length > nbytes:
                block.part(nbytes, block.length).zero_()  # zero-padded tail
            at = None  # NOTE [Byte capture]: where the bytes start, when one memcpy takes them
            if cpu:
                if whole:
                    at = storage.data_ptr()
                elif stride == t.stride():  # a dense view: its bytes start at its data pointer
                    at = t.data_ptr()
            skew = 0
            if at is not None:
                _memmove(block.base.data_ptr() + block.offset, at, nbytes)
                ticket = check = None  # done here, on the packing thread: nothing to recheck
            else:
                if whole:
                    src = torch.empty(0, dtype=torch.uint8, device=dev).set_(storage)
                    dst = block.part(0, nbytes)
                else:
                    src = t
                    dst = block.part(0, nbytes).view(t.dtype).as_strided(t.shape, stride)
                ticket, check = adapter.capture(dst, src), (t, t._version)
        gs = self.groups.stat
        e = Entry(self.index.graveyard, st, ekey, sref, dev, nbytes, block, extent, gs)
        e.captured_by(ticket, check, batch, skew, span)
        self.index.charge(block.length)
        self.index.add_entry(e)
        if batch is None:
            io.count_disk(st, extent, self.groups.stat)
        if whole:
            self.index.entries[ekey] = e
        io.live.add(e)
        st.entries.append(e)  # counted offloaded once written (NOTE [Counted once])
        writer.captured_by(e, ticket)
        return e

    # NOTE [Host capture]
    # With a host tier (NOTE [Host tier] in tba/storage/hosttier.py) a device tensor's bytes are
    # copied from the device straight into the host extent that will hold them, not into
    # staging and then, on the tier's one thread, into the extent: that memcpy bounded what the
    # tier took far below what PCIe moves, and staging filled (on an H200, 232 tensors a step
    # were kept for it). The extent's pinned buffer stands where the staging block would
    # (:class:`HostBlock`): charged the same way until the copy completes, when the entry is
    # written at once, with no write to issue (Writer._write). Not so for a group the disk
    # takes first (NOTE [Tier order] in tba/decide/tiers.py), nor with the tier's checksums on
    # (NOTE [Host tier] 6: its thread hashes what it copies), nor when the tier is full: those
    # go through staging as before. The tier's write rate is then the device copies' (NOTE
    # [Copy timing] in tba/datapath/capture/device.py).
    def _host_block(self, dev, nbytes: int, align: int) -> HostBlock | None:
        """A host-tier extent's buffer for ``nbytes`` of a tensor on ``dev``, or None where
        NOTE [Host capture] sends it through staging. Lock held."""
        io = self.io
        tier = io.tier
        if tier is None or tier.host.verify_bytes or dev not in io.uploading:
            return None
        stat = self.groups.stat
        if stat is not None and stat.group < io.spill_groups:
            return None
        extent = tier.allocate_host(align_up(nbytes, align))
        if extent is None:
            return None
        return HostBlock(tier.host.view(extent), extent)

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

    def _room(self, st: StepState, staging: StagingPool, nbytes: int, get, can_go_alone: bool):
        """``get()``: a staging block (or a held DirectBlock), or None when staging is full.
        With TBA_STAGING_FULL=wait, a full staging is waited for (NOTE [Staging backpressure]),
        and a tensor over the staging's limit that ``can_go_alone`` waits to go alone,
        ``get(True)`` (NOTE [Staging within the budget]). Lock held; released while waiting."""
        seen = staging.frees
        got = get()
        cfg = self.io.config
        if got is not None or cfg.staging_full != "wait" or self._waited_out == st.index:
            return got
        if nbytes > staging.room:
            if not can_go_alone:
                return None  # could never fit: waiting would only add a stall
            get = functools.partial(get, True)  # once nothing else is in flight: now, if nothing is
            got = get()
            if got is not None:
                return got
        self.writer.seal_all()  # a batch being filled frees its staging only once written
        io = self.io
        got, waited = staging.wait_for(get, seen, cfg.staging_wait, io.lock, io.clock)
        st.stall_seconds += waited
        st.pack_stall_seconds += waited
        if self.groups.stat is not None:
            self.groups.stat.pack_stall_seconds += waited
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

    def seal_all(self) -> None:
        """Write what is still being coalesced (the forward ended). Lock held."""
        self.writer.seal_all()
