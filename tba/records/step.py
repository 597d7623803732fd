"""Per-step state and counters. A new `StepState` starts with every ``Offloader.step()``.

Work done during a step's backward (reloads, stalls) is credited to the step that packed the
tensor, so two graphs alive at once (gradient accumulation) never mix their numbers.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from ..host.clock import SYSTEM, Clock, Timeline

# The keys of ``stats()`` that code outside this repository relies on (docs/configuration.md,
# "stats()"), in the order that page lists them. More keys may be added; these never change.
PINNED_KEYS = (
    "saved_bytes",
    "bytes_offloaded",
    "bytes_reloaded",
    "tensors_offloaded",
    "tensors_kept",
    "dedup_hits",
    "forwarded",
    "sync_loads",
    "stall_seconds",
    "peak_resident_bytes",
    "disk_bytes_in_use",
)


_free_weak_ref = torch.UntypedStorage._free_weak_ref  # kept: ``torch`` may go first at exit


class StorageRef:
    """A weak reference to a storage's StorageImpl (NOTE [Storage identity] in
    tba/records/index.py).

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


class GroupMarks:
    """A group's points on the device timeline (NOTE [Device clock] in tba/host/clock.py): its
    forward's start and end, its first and last unpack, each recompute's start and end. None:
    not marked. The last unpack's mark is moved, not renewed, at each unpack."""

    __slots__ = ("timeline", "fwd_start", "fwd_end", "bwd_first", "bwd_last", "recompute")

    def __init__(self, timeline: Timeline):
        self.timeline = timeline
        self.fwd_start: Any = None
        self.fwd_end: Any = None
        self.bwd_first: Any = None
        self.bwd_last: Any = None
        self.recompute: list[Any] = []  # start, end, start, end ...

    def unpacked(self) -> None:
        t = self.timeline
        if self.bwd_first is None:
            self.bwd_first = t.mark()
            self.bwd_last = t.mark()
        else:
            t.mark(self.bwd_last)

    def recompute_edge(self) -> None:
        """A recompute of the block starts (even count so far) or ends (odd)."""
        self.recompute.append(self.timeline.mark())

    def all(self) -> list[Any]:
        got = [self.fwd_start, self.fwd_end, self.bwd_first, self.bwd_last, *self.recompute]
        return [m for m in got if m is not None]


class GroupStat:
    """What one group (block) of one step did: bytes, and when its compute and I/O ran.

    Times are readings of the step's clock (tba/host/clock.py); 0.0 means "did not happen". The
    backward compute of a group is taken from its unpacks (see :meth:`StepState.group_records`).
    On a device the compute's bounds are also marked on its timeline (``marks``), and become
    device times once passed (:meth:`StepState.resolve`).
    """

    __slots__ = (
        "group",
        "marks",
        "kept",
        "action",
        "input_bytes",
        "hidden_bytes",
        "recompute_seconds",
        "pack_seconds",
        "pack_stall_seconds",
        "unpack_seconds",
        "cached_bytes",
        "cacheable_bytes",
        "tensors",
        "packed_bytes",
        "saved_bytes",
        "sizes",
        "offloaded_bytes",
        "kept_bytes",
        "keepable_bytes",
        "fwd_start",
        "fwd_end",
        "bwd_first",
        "bwd_last",
        "write_first",
        "write_last",
        "written_bytes",
        "read_first",
        "read_last",
        "read_bytes",
        "stall_seconds",
        "sync_loads",
        "host_bytes",
        "ssd_bytes",
    )

    def __init__(self, group: int, marks: GroupMarks | None = None):
        self.group = group
        self.marks = marks  # None: timed by the host clock alone
        self.kept = False
        self.action = ""  # a block's action (NOTE [Block policy]); "" between blocks
        self.input_bytes = 0  # a block's tensor inputs (what recompute keeps)
        self.hidden_bytes = 0  # saved inside tba's checkpoint of the block (not packed by tba)
        self.recompute_seconds = 0.0  # backward's run of the block's forward again
        self.pack_seconds = 0.0  # in tba's pack hook, stalls excluded (NOTE [Hook time])
        # packs waiting for staging: not the block's compute, so not in its fwd_seconds
        self.pack_stall_seconds = 0.0
        self.unpack_seconds = 0.0  # in tba's unpack hook for this group's handles, less stalls
        self.cached_bytes = 0  # kept by selective recompute (NOTE [Selective recompute])
        self.cacheable_bytes = 0  # saved outputs of selective's KEPT_OPS: what it would keep
        self.tensors = 0
        self.packed_bytes = 0  # per pack: views of one storage count once each
        self.saved_bytes = 0  # storages first seen in this group, once each (what keeping costs)
        self.sizes: list[int] = []  # those storages' bytes in pack order (NOTE [Measured layout])
        self.offloaded_bytes = 0
        self.kept_bytes = 0
        self.keepable_bytes = 0  # bytes kept only because the group is kept: offloadable
        self.fwd_start = self.fwd_end = 0.0
        self.bwd_first = self.bwd_last = 0.0
        self.write_first = self.write_last = 0.0
        self.written_bytes = 0
        self.read_first = self.read_last = 0.0
        self.read_bytes = 0
        self.stall_seconds = 0.0
        self.sync_loads = 0
        self.host_bytes = 0  # extent bytes in the host tier (NOTE [Host tier])
        self.ssd_bytes = 0  # extent bytes on the spill disk

    def unpacked(self, now: float) -> None:
        if not self.bwd_first:
            self.bwd_first = now
        self.bwd_last = now
        if self.marks is not None:
            self.marks.unpacked()

    def io_started(self, write: bool, now: float) -> None:
        if write:
            if not self.write_first:
                self.write_first = now
        elif not self.read_first:
            self.read_first = now

    def io_done(self, write: bool, nbytes: int, now: float) -> None:
        if write:
            self.write_last = max(self.write_last, now)
            self.written_bytes += nbytes
        else:
            self.read_last = max(self.read_last, now)
            self.read_bytes += nbytes


class StepState:
    """Counters and the prefetch plan of one step."""

    def __init__(self, index: int, clock: Clock = SYSTEM, timeline: Timeline | None = None):
        self.index = index
        self.clock = clock  # the Offloader's (tba/host/clock.py): every time of this step
        self.started = clock()
        # the device's, where the step runs on one (NOTE [Device clock]); its marks: the step's
        # start and forward end, and each group's (GroupMarks)
        self.timeline = timeline
        self.base: Any = timeline.mark() if timeline is not None else None
        self.forward_mark: Any = None
        self.resolved = timeline is None  # times final: host readings, or device marks read
        self.forward_seconds = 0.0
        self.saved_bytes = 0
        self.bytes_offloaded = 0
        self.bytes_reloaded = 0
        self.tensors_offloaded = 0
        self.tensors_kept = 0
        self.kept_fast = 0  # of tensors_kept: by the pack hook's fast path (NOTE [Hot path])
        self.kept_dedup = 0  # of dedup_hits: views of a storage tba keeps
        self.kept_credited = 0  # of packs: credited to blocks run without tba's hooks
        self.kept_reasons: Counter[str] = Counter()
        self.dedup_hits = 0
        self.forwarded = 0
        self.sync_loads = 0
        self.stall_seconds = 0.0
        self.pack_stall_seconds = 0.0  # packs waiting for staging (NOTE [Staging backpressure])
        self.uploads_ahead = 0  # H2D copies issued ahead of their unpack (NOTE [Device prefetch])
        self.uploads_at_unpack = 0
        self.peak_resident_bytes = 0
        self.peak_with_recompute_bytes = 0  # NOTE [Block policy]: resident + a recomputed block
        self.peak_disk_bytes = 0
        # NOTE [Host tier] in tba/storage/hosttier.py: extent bytes per tier, the tier's peak,
        # and the leading groups sent to the disk first (NOTE [Tier order])
        self.host_tier_bytes = 0
        self.ssd_tier_bytes = 0
        self.host_tier_peak_bytes = 0
        self.spill_groups = 0
        self.host_spans: tuple[list[tuple[float, float, int]], list[tuple[float, float, int]]] = (
            [],
            [],
        )
        self.io_errors = 0
        self.groups = 0
        self.kept_groups = 0
        self.group_policy: list[str] = []  # per block: keep, offload, recompute or user
        self.recomputed_groups = 0  # blocks tba ran under checkpointing (recomputed in backward)
        self.packs = 0
        self.coalesced_tensors = 0  # offloaded tensors that went into a batch (NOTE [Coalescing])
        self.coalesced_writes = 0  # batch writes issued
        self.recomputed_tensors = (
            0  # NOTE [Weight-derived tensors] in tba/datapath/capture/derived.py
        )
        self.recomputed_bytes = 0
        self.unsettled = (
            0  # entries not yet counted (NOTE [Counted once] in tba/records/reasons.py)
        )
        self.seen: dict[int, StorageRef] = {}  # storages counted in saved_bytes
        self.entries: list[Any] = []  # offloaded entries, for the prefetch plan
        self.plan: list[Any] | None = None
        self.cursor = 0
        self.deferred: list[Any] = []  # entries passed over while forwardable (NOTE [Forwarding])
        self.backward_started = False  # an entry of this step was unpacked (NOTE [Plan order])
        self.forward_end = 0.0
        self.observed = False  # fed to the keep controller and the trace
        self.keep_last = 0  # K used for this step
        self.by_group: dict[int, GroupStat] = {}
        # Write and read intervals (start, end, bytes): the achieved bandwidth of this step.
        self.io_spans: tuple[list[tuple[float, float, int]], list[tuple[float, float, int]]] = (
            [],
            [],
        )

    def group(self, g: int) -> GroupStat:
        gs = self.by_group.get(g)
        if gs is None:
            tl = self.timeline
            gs = self.by_group[g] = GroupStat(g, GroupMarks(tl) if tl is not None else None)
        return gs

    def edge(self, ending: GroupStat | None, starting: GroupStat | None) -> None:
        """The forward leaves ``ending`` for ``starting`` (either None: the step's first or last
        edge): one device mark ends the one and starts the other. Only with a timeline."""
        m = self.timeline.mark()  # type: ignore[union-attr]
        if ending is not None and ending.marks is not None:
            ending.marks.fwd_end = m
        if starting is not None and starting.marks is not None:
            starting.marks.fwd_start = m

    def resolve(self, wait: bool = False) -> bool:
        """Turn the step's compute times into device times once every mark has passed (with
        ``wait``: after waiting for them, only where no step runs), and free the marks. Returns
        whether its times are final; always True without a timeline (NOTE [Device clock])."""
        tl = self.timeline
        if self.resolved or tl is None:
            return True
        groups = list(self.by_group.values())
        marks = [self.base] + ([self.forward_mark] if self.forward_mark is not None else [])
        for gs in groups:
            if gs.marks is not None:
                marks += gs.marks.all()
        marks = list({id(m): m for m in marks}.values())  # an edge ends one group, starts one
        if not tl.passed(marks):
            if not wait:
                return False
            tl.wait(marks)
        base, t0 = self.base, self.started

        def at(m: Any) -> float:  # on the device timeline, from where the host's started
            return 0.0 if m is None else t0 + tl.elapsed(base, m)

        for gs in groups:
            gm = gs.marks
            if gm is None:
                continue
            gs.fwd_start, gs.fwd_end = at(gm.fwd_start), at(gm.fwd_end)
            gs.bwd_first, gs.bwd_last = at(gm.bwd_first), at(gm.bwd_last)
            r = gm.recompute
            if r:
                gs.recompute_seconds = sum(tl.elapsed(a, b) for a, b in zip(r[::2], r[1::2]))
            gs.marks = None
        if self.forward_mark is not None:
            self.forward_end = at(self.forward_mark)
            self.forward_seconds = self.forward_end - t0
        tl.release(marks)
        self.base = self.forward_mark = None
        self.resolved = True
        return True

    def io_span(self, write: bool, start: float, end: float, nbytes: int) -> None:
        self.io_spans[0 if write else 1].append((start, end, nbytes))

    def host_span(self, write: bool, start: float, end: float, nbytes: int) -> None:
        self.host_spans[0 if write else 1].append((start, end, nbytes))

    def host_bandwidth(self, write: bool) -> float | None:
        """Bytes per second of the host tier's copies (writes or reads), or None."""
        return _rate(self.host_spans[0 if write else 1])

    def bandwidth(self, write: bool) -> float | None:
        """Bytes per second while this step's writes (or reads) were in flight, or None."""
        return _rate(self.io_spans[0 if write else 1])

    def largest_read(self) -> int:
        """Bytes of the largest single read of this step (0 when nothing was read)."""
        return max((n for _, _, n in self.io_spans[1]), default=0)

    def group_records(self) -> list[dict[str, Any]]:
        """One dict per group, in forward order, with compute and I/O times in seconds.

        NOTE [Backward timing]
        Backward compute of a group is the time from its first unpack to the first unpack of the
        group backward reaches next (the last group: to its own last unpack), less its stalls.
        An unpack times the group that saved the tensor *last*: a tensor every block saves
        (a rotary table, a mask) is packed once and its handle handed to each later block
        again, and backward unpacks it first in the last of them. Timed by the first saver
        instead, that group's backward would seem to start with the whole backward (and the
        group after it to take no time), and adaptive keep, seeing a block whose bytes were
        needed at once, would predict stalls for every K but the largest.
        """
        out = []
        reached_next = None  # the closest lower group with unpacks: backward reaches it next
        for g in sorted(self.by_group):
            gs = self.by_group[g]
            if gs.bwd_first:
                until = reached_next.bwd_first if reached_next is not None else gs.bwd_last
                bwd = max(0.0, until - gs.bwd_first - gs.stall_seconds)
                reached_next = gs
            else:
                bwd = 0.0
            out.append(
                {
                    "group": g,
                    "kept": gs.kept,
                    "action": gs.action,
                    "input_bytes": gs.input_bytes,
                    "hidden_bytes": gs.hidden_bytes,
                    "recompute_seconds": gs.recompute_seconds,
                    "pack_seconds": gs.pack_seconds,
                    "pack_stall_seconds": gs.pack_stall_seconds,
                    "unpack_seconds": gs.unpack_seconds,
                    "cached_bytes": gs.cached_bytes,
                    "cacheable_bytes": gs.cacheable_bytes,
                    "tensors": gs.tensors,
                    "packed_bytes": gs.packed_bytes,
                    "saved_bytes": gs.saved_bytes,
                    "sizes": list(gs.sizes),
                    "offloaded_bytes": gs.offloaded_bytes,
                    "kept_bytes": gs.kept_bytes,
                    "keepable_bytes": gs.keepable_bytes,
                    "fwd_seconds": max(0.0, gs.fwd_end - gs.fwd_start - gs.pack_stall_seconds),
                    "bwd_seconds": bwd,
                    "write_seconds": max(0.0, gs.write_last - gs.write_first)
                    if gs.write_first
                    else 0.0,
                    "read_seconds": max(0.0, gs.read_last - gs.read_first)
                    if gs.read_first
                    else 0.0,
                    "stall_seconds": gs.stall_seconds,
                    "sync_loads": gs.sync_loads,
                    "host_bytes": gs.host_bytes,
                    "ssd_bytes": gs.ssd_bytes,
                }
            )
        return out

    def backward_end(self) -> float:
        return max((gs.bwd_last for gs in self.by_group.values()), default=0.0)

    def see(self, storage: Any, cdata: int, nbytes: int) -> StorageRef:
        """Count a storage once per step in ``saved_bytes`` (the baseline's residency). Returns
        its weak reference, which an entry of this storage shares (NOTE [Storage identity])."""
        ref = self.seen.get(cdata)
        if ref is None:
            ref = self.seen[cdata] = StorageRef(storage)
            self.saved_bytes += nbytes
        return ref

    def keep(self, reason: str) -> None:
        self.tensors_kept += 1
        self.kept_reasons[reason] += 1

    def recomputed(self, storage: Any, cdata: int, nbytes: int) -> None:
        """A weight-derived tensor: rebuilt at unpack, never held (its bytes counted once)."""
        self.recomputed_tensors += 1
        if cdata not in self.seen:
            self.recomputed_bytes += nbytes
        self.see(storage, cdata, nbytes)

    def offloaded(self, nbytes: int) -> None:
        self.tensors_offloaded += 1
        self.bytes_offloaded += nbytes

    def snapshot(self, disk_bytes_in_use: int) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in PINNED_KEYS[:-1]}
        out["disk_bytes_in_use"] = disk_bytes_in_use
        out.update(
            step=self.index,
            packs=self.packs,
            kept_reasons=dict(self.kept_reasons),
            kept_fast=self.kept_fast,
            kept_credited=self.kept_credited,
            peak_disk_bytes=self.peak_disk_bytes,
            io_errors=self.io_errors,
            groups=self.groups,
            kept_groups=self.kept_groups,
            group_policy=list(self.group_policy),
            recomputed_groups=self.recomputed_groups,
            user_checkpointed_groups=self.group_policy.count("user"),
            peak_with_recompute_bytes=max(self.peak_resident_bytes, self.peak_with_recompute_bytes),
            coalesced_tensors=self.coalesced_tensors,
            coalesced_writes=self.coalesced_writes,
            recomputed_tensors=self.recomputed_tensors,
            recomputed_bytes=self.recomputed_bytes,
            tensors_in_flight=self.unsettled,
            uploads_ahead=self.uploads_ahead,
            pack_stall_seconds=self.pack_stall_seconds,
            uploads_at_unpack=self.uploads_at_unpack,
            forward_seconds=self.forward_seconds,
            host_tier_bytes=self.host_tier_bytes,
            ssd_tier_bytes=self.ssd_tier_bytes,
            host_tier_peak_bytes=self.host_tier_peak_bytes,
            host_tier_spill_groups=self.spill_groups,
        )
        return out

    def finish_forward(self) -> None:
        self.forward_end = self.clock()
        if self.timeline is not None:
            self.forward_mark = self.timeline.mark()
        self.forward_seconds = self.forward_end - self.started
        self.seen.clear()  # release the weak references; saved_bytes is final


def _rate(spans: list[tuple[float, float, int]]) -> float | None:
    """Bytes per second over the union of the transfers' intervals, or None."""
    if not spans:
        return None
    busy, end = 0.0, float("-inf")
    for a, b, _ in sorted(spans):  # length of the union of the intervals
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    total = sum(n for _, _, n in spans)
    return total / busy if busy > 0 else None
