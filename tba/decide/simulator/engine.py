"""The discrete-event simulation of one or more steps of tba's offload schedule.

# NOTE [Simulator]
One timeline runs compute; disks are FIFO servers at a fixed rate: two, or one shared by reads
and writes in submit order (``Setup.shared_disk``, e.g. a virtio disk). A step is a list of
groups in forward order, each with its forward and backward compute seconds and its saved
tensors (``Saved`` in rules.py: bytes, and when, as fractions of the group's time, it is
packed, needed by backward and released). The rules, as tba applies them:

- Keep: groups from ``first_kept`` on stay resident (the last K blocks and every group after
  the first of them: ``kept_from`` in rules.py), and so do tensors marked small (by default:
  smaller than ``min_offload_bytes``) and empty ones.
- Staging: any other tensor, at its pack time, needs a staging block of its size rounded up to
  ``align``, placed by tba's own best-fit allocator (so fragmentation counts); with
  ``staging_bytes=None`` staging is unbounded. When no block fits, the tensor stays resident
  (``staging_full``) and the forward does not wait; with ``staging_waits`` (TBA_STAGING_FULL=
  wait, what a memory budget sets) the forward waits instead until completed writes free a
  block that fits (TBA_STAGING_WAIT's timeout is not modelled). Under a memory budget the run
  also holds the bytes in flight to ``staging_limit``: past it a pack waits the same way, and a
  tensor larger than the limit goes alone once nothing else is in flight, as the run's does
  (NOTE [Staging within the budget] in tba/datapath/capture/staging.py). Then the capture
  copy runs on the compute timeline (``capture_bps``) and the write is queued. Staging frees
  when the write completes; nothing cancels a write.
- Prefetch: at the end of forward the plan is the offloaded tensors in reverse pack order.
  Reads are issued in order while the bytes issued and not yet released stay within the window
  (at least one read): ``prefetch_bytes``, or with ``size_window`` the window tba's
  DepthController would size from this step (``read_ahead``, NOTE [Prefetch depth] in
  rules.py) within that cap. A tensor still
  being written takes its budget and is copied from staging when its write completes (no
  read). Each release returns budget and issues more.
- Backward, per group in reverse: a tensor is needed at its use time. A kept one is there. An
  offloaded one waits for its read (a stall), or is copied out of staging when its write still
  runs, or is read synchronously when no read was issued (``sync_loads``). ``h2d_bps`` adds a
  host-to-device copy of each offloaded tensor to the compute timeline (tba's CUDA adapter
  orders it after the consumer's queued work). Its buffer and budget are released at the use,
  or at ``free_at`` when the tensor is held longer.
- Recompute (``actions``, NOTE [Block policy] in tba/datapath/blocks/recompute.py): a recomputed
  group keeps only its ``input_bytes`` (an attribute of the group, 0 when absent) from its forward
  start; at its backward start its forward runs again (its ``recompute`` seconds when the group has
  them, measured, else ``fwd``, on the compute timeline), then
  its saved tensors are resident, the inputs are let go, and each saved tensor is released at
  its use. Nothing of it is written or read, except with ``recompute_offload``: its inputs are
  offloaded like any tensor packed at its forward start, and backward takes them (a read, a
  stall, a copy out of staging) before it runs the forward again. ``selective`` keeps, besides
  its inputs, its ``cached_bytes`` (NOTE [Selective recompute] in tba/datapath/blocks/selective.py)
  from its forward start until its recompute, which takes its ``recompute`` seconds.
- Memory follows tba's ``peak_resident_bytes`` accounting: kept tensors from pack to release,
  staging blocks until written, read-back buffers from read issue to release, staging copies.
  The device peak counts only kept and recomputed tensors, the host peak staging and
  read-back buffers.
- Tiers (``host_bytes`` > 0; NOTE [Host tier] in tba/storage/hosttier.py): an offloaded tensor
  goes to the host tier, a queue each way at ``host_bps``, while the bytes the tier holds stay
  within ``host_bytes``, else to the disk. Each step sends its leading groups to the disk first,
  by the rule the runtime applies (``spill_groups``, NOTE [Tier order] in tba/decide/tiers.py)
  over the bytes each group offloaded in the engine's last step, as the runtime measures them,
  or on a first step every byte the group could offload (more than a full staging lets through:
  conservative, it sends more to the disk).
  A tensor bound for the tier takes no staging: the device copy lands in the tier's buffer,
  charged as staging is until that copy (a queue at ``host_bps``) completes (NOTE [Host
  capture] in tba/datapath/pack.py; the runtime's fallbacks through staging, a named checksum
  and a full tier, are not modelled); the tier frees an entry's bytes at its use. The
  actions ``host`` and ``ssd`` force a group's tier (when ``host`` finds the tier full, the
  disk). ``bytes_written``/``bytes_read`` count both tiers; ``ssd_bytes_written`` and
  ``host_bytes_written`` split them.
- Steps run back to back on one :class:`Engine` carry the disk queues and staging over.

The runtime's use is the plain case: the default :class:`Setup` (no copy costs, transfers of
exactly their bytes, a fixed window). Adaptive keep cuts each group's measured bytes into
``pieces`` and leaves staging unbounded; the chooser gives each group its ``measured_pieces``
and bounds staging as tba does (rules.py; NOTE [Chooser] in tba/decide/chooser.py). The planner
sets every field from its hardware and knobs.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from typing import Any

from ...config.values import RECOMPUTED, SELECTIVE
from ...storage.alloc import ExtentAllocator
from ..tiers import spill_groups
from .rules import Setup, Stage, read_ahead


@dataclasses.dataclass
class SimResult:
    keep: int
    step_seconds: float
    forward_seconds: float
    backward_seconds: float
    stall_seconds: float
    sync_loads: int
    peak_resident_bytes: int  # tba's accounting: kept + staging + read-back
    peak_device_bytes: int  # kept tensors only (what stays on an accelerator)
    peak_host_bytes: int  # staging + read-back buffers
    bytes_written: int
    bytes_read: int
    served_from_staging: int
    kept_bytes: int  # kept by group or size
    staging_full_bytes: int  # kept because staging was full
    writes_done_at: float  # seconds after the step started when its last write completes
    steps: int = 1  # steps simulated; this is the last
    ssd_bytes_written: int = 0  # of bytes_written, to the disk
    host_bytes_written: int = 0  # of bytes_written, to the host tier
    peak_host_tier_bytes: int = 0  # the most bytes the host tier held
    spill_groups: int = 0  # the leading groups sent to the disk first (NOTE [Tier order])

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Fifo:
    """A disk queue served in submit order at a fixed rate (submits arrive in time order)."""

    def __init__(self) -> None:
        self.free = 0.0

    def submit(self, now: float, nbytes: int, rate: float) -> float:
        start = max(now, self.free)
        self.free = start + (nbytes / rate if rate != math.inf else 0.0)
        return self.free


class _Entry:
    __slots__ = ("nbytes", "padded", "written", "want", "budgeted", "read_done", "used", "host")

    def __init__(self, nbytes: int, padded: int, written: float, host: bool = False):
        self.nbytes = nbytes
        self.padded = padded
        self.written = written  # when its write completes and staging frees
        self.host = host  # in the host tier, else on the disk
        self.want = False  # prefetch reached it while it was being written
        self.budgeted = 0
        self.read_done: float | None = None
        self.used = False


_DEV, _HOST = 0, 1
_FREE, _USE = 0, 1  # at one instant, releases come before uses


class Engine:
    """Steps simulated back to back under one :class:`Setup` (NOTE [Simulator]). Without
    ``memory``, resident bytes are not tracked and :meth:`peaks` reports nothing."""

    def __init__(self, setup: Setup, memory: bool = True):
        self.setup = setup
        if not memory:
            self.mem = lambda t, delta, kind: None  # type: ignore[method-assign]
        self.wq = _Fifo()
        self.rq = self.wq if setup.shared_disk else _Fifo()
        self.now = 0.0
        # tba's own allocator over the staging arena: best fit, so fragmentation is modelled
        cap = setup.staging_bytes
        self.arena = None if cap is None else ExtentAllocator(cap, setup.align)
        self.staging: list[tuple[float, int]] = []  # (write done, offset in the arena) heap
        self.events: list[tuple[float, int, int, int]] = []  # (time, seq, delta, kind)
        self.seq = 0
        self.base = [0, 0]  # resident bytes of events folded away (before the current step)
        self.window = (0.0, 0.0)  # the last step's start and end
        self.staged_entries = 0  # tensors of the last step served from staging (no read)
        self.hwq, self.hrq = _Fifo(), _Fifo()  # the host tier's copies, in and out
        self.host_used = 0  # bytes the host tier holds
        self.host_peak = 0
        self.spill = 0  # this step's leading groups that go to the disk first
        self.tiered = {"ssd": 0, "host": 0}  # this step's bytes written per tier
        self.offloaded: dict[int, int] | None = None  # the last step's bytes written per group

    def mem(self, t: float, delta: int, kind: int) -> None:
        self.seq += 1
        self.events.append((t, self.seq, delta, kind))

    def fold(self, t: float) -> None:
        """Fold the memory events before ``t`` into the baseline (keeps long runs cheap)."""
        keep = []
        for ev in self.events:
            if ev[0] < t:
                self.base[ev[3]] += ev[2]
            else:
                keep.append(ev)
        self.events = keep

    def prefill(self) -> None:
        """Start behind a full staging pool of unfinished writes (a backlog that never ends)."""
        if self.arena is None:
            return
        chunk = 16 << 20
        while True:
            at = self.arena.alloc(chunk)
            if at is None:
                break
            done = self.wq.submit(0.0, chunk, self.setup.write_bps)
            heapq.heappush(self.staging, (done, at))
            self.mem(0.0, chunk, _HOST)
            self.mem(done, -chunk, _HOST)

    def _stage(self, t: float, padded: int) -> int | None:
        """A staging block for ``padded`` bytes at time ``t`` (0 when unbounded), or None."""
        if self.arena is None:
            return 0
        while self.staging and self.staging[0][0] <= t:
            self.arena.free(heapq.heappop(self.staging)[1])
        limit = self.setup.staging_limit
        used = self.arena.used
        if limit is not None and used + padded > limit and used:
            return None  # over the budget's share while others are in flight: it waits
        return self.arena.alloc(padded)

    def step(
        self,
        groups: Sequence[Stage],
        first_kept: int,
        keep: int = 0,
        actions: Sequence[str] | None = None,
    ) -> SimResult:
        """One step with groups ``first_kept`` on resident; ``keep`` only labels the result.
        ``actions`` (one per group: keep, offload or recompute) replaces ``first_kept``."""
        su = self.setup
        t0 = t = self.now
        self.fold(t0)
        self.tiered = {"ssd": 0, "host": 0}
        self.host_peak = self.host_used
        self.spill = self._spill(groups, first_kept, actions) if su.host_bytes > 0 else 0
        n_kept = n_full = written = 0
        per_group: dict[int, int] = {}
        entries: list[_Entry] = []
        uses: list[list[tuple[float, int, int, _Entry | None, float | None]]] = []
        # a recomputed group's input bytes, with recompute_offload their entry, and what
        # selective keeps of it; else None
        recomputed: list[tuple[int, _Entry | None, int] | None] = []
        for gi, g in enumerate(groups):
            act = actions[gi] if actions is not None else ("keep" if gi >= first_kept else "")
            kept = act == "keep"
            tier = act if act in ("host", "ssd") else ("ssd" if gi < self.spill else "")
            start, shift, items = t, 0.0, []
            if act in RECOMPUTED:  # the Recompute rule: only the inputs stay (or are written)
                inputs = getattr(g, "input_bytes", 0)
                e = None
                if act == "recompute_offload" and inputs > 0:
                    e, shift = self._write(start, inputs, tier)
                    if e is not None:
                        entries.append(e)
                        written += inputs
                        per_group[gi] = inputs
                if e is None:
                    self.mem(start, inputs, _DEV)
                cached = getattr(g, "cached_bytes", 0) if act == SELECTIVE else 0
                self.mem(start, cached, _DEV)  # kept from its forward (NOTE [Selective recompute])
                recomputed.append((inputs, e, cached))
                saved = sorted(g.saved, key=lambda x: x.pack_at)
                uses.append(
                    [(s.use_at, -i, s.nbytes, None, s.free_at) for i, s in enumerate(saved)]
                )
                t = start + shift + g.fwd
                continue
            recomputed.append(None)
            for i, s in enumerate(sorted(g.saved, key=lambda x: x.pack_at)):
                tp = start + shift + s.pack_at * g.fwd
                if kept or not su.offloadable(s) or s.nbytes == 0:
                    self.mem(tp, s.nbytes, _DEV)
                    items.append((s.use_at, -i, s.nbytes, None, s.free_at))
                    n_kept += s.nbytes
                    continue
                e, copy = self._write(tp, s.nbytes, tier)
                if e is None:  # no free range fits: kept, the forward does not wait
                    self.mem(tp, s.nbytes, _DEV)
                    items.append((s.use_at, -i, s.nbytes, None, s.free_at))
                    n_full += s.nbytes
                    continue
                shift += copy
                entries.append(e)
                items.append((s.use_at, -i, s.nbytes, e, s.free_at))
                written += s.nbytes
                per_group[gi] = per_group.get(gi, 0) + s.nbytes
            t = start + shift + g.fwd
            uses.append(items)
        fwd_end = t
        self.offloaded = per_group
        bwd_total = sum(g.bwd for g in groups)
        t, stall, sync, served, read = self._backward(
            groups, uses, entries, written, bwd_total, t, recomputed
        )
        self.now = t
        self.window = (t0, t)
        return SimResult(
            keep=keep,
            step_seconds=t - t0,
            forward_seconds=fwd_end - t0,
            backward_seconds=t - fwd_end,
            stall_seconds=stall,
            sync_loads=sync,
            peak_resident_bytes=0,  # filled from peaks(), for a step that is reported
            peak_device_bytes=0,
            peak_host_bytes=0,
            bytes_written=written,
            bytes_read=read,
            served_from_staging=served,
            kept_bytes=n_kept,
            staging_full_bytes=n_full,
            writes_done_at=max((e.written for e in entries), default=t0) - t0,
            ssd_bytes_written=self.tiered["ssd"],
            host_bytes_written=self.tiered["host"],
            peak_host_tier_bytes=self.host_peak,
            spill_groups=self.spill,
        )

    def _spill(
        self, groups: Sequence[Stage], first_kept: int, actions: Sequence[str] | None
    ) -> int:
        """The Tiers rule: the leading groups that go to the disk first, from the bytes each
        group offloads (its offloadable saves, a recompute_offload block's inputs)."""
        su = self.setup
        if self.offloaded is not None:  # measured, as the runtime has it from its last step
            return spill_groups(self.offloaded.items(), su.host_bytes - self.host_used)
        per_group = []
        for gi, g in enumerate(groups):
            act = actions[gi] if actions is not None else ("keep" if gi >= first_kept else "")
            if act in ("keep", "ssd", "recompute", SELECTIVE):
                continue
            if act == "recompute_offload":
                n = getattr(g, "input_bytes", 0)
            else:
                n = sum(s.nbytes for s in g.saved if su.offloadable(s) and s.nbytes)
            per_group.append((gi, n))
        return spill_groups(per_group, su.host_bytes - self.host_used)

    def _write(self, tp: float, nbytes: int, tier: str = "") -> tuple[_Entry | None, float]:
        """Offload ``nbytes`` packed at ``tp``: a staging block (none for the host tier), the
        capture copy (its seconds are returned: they delay the forward) and the write, to the
        host tier unless ``tier`` is "ssd" or the tier is full (the Tiers rule). None when
        staging is full."""
        su = self.setup
        padded = -(-nbytes // su.align) * su.align
        host = tier != "ssd" and su.host_bytes > 0 and self.host_used + padded <= su.host_bytes
        at = None
        waited = 0.0
        if not host:  # a host-tier write takes no staging (the Tiers rule)
            at = self._stage(tp, padded)
            if at is None and su.staging_waits and padded <= (su.staging_bytes or 0):
                t = tp  # the pack waits for writes to free a block (the Staging rule)
                while at is None and self.staging:
                    t = self.staging[0][0]
                    at = self._stage(t, padded)
                waited = t - tp
            if at is None:
                return None, 0.0
        tp += waited
        self.mem(tp, padded, _HOST)
        copy = nbytes / su.capture_bps
        if host:
            done = self.hwq.submit(tp + copy, padded, su.host_bps)
            self.host_used += padded
            self.host_peak = max(self.host_peak, self.host_used)
            self.tiered["host"] += nbytes
        else:
            done = self.wq.submit(tp + copy, padded, su.write_bps)
            self.tiered["ssd"] += nbytes
        if self.arena is not None and at is not None:
            heapq.heappush(self.staging, (done, at))
        self.mem(done, -padded, _HOST)
        return _Entry(nbytes, padded, done, host), waited + copy

    def _read(self, e: _Entry, now: float) -> float:
        """When a read of ``e`` issued at ``now`` completes, from its tier."""
        if e.host:
            return self.hrq.submit(now, e.padded, self.setup.host_bps)
        return self.rq.submit(now, e.padded, self.setup.read_bps)

    def window_for(self, entries: Sequence[_Entry], written: int, bwd_total: float) -> int:
        """The read-ahead window of a step (the Prefetch rule of NOTE [Simulator])."""
        su = self.setup
        if not su.size_window or not entries:
            return su.prefetch_bytes
        consume = written / bwd_total if bwd_total > 0 else math.inf
        largest = max(e.padded for e in entries)
        return read_ahead(largest, consume, su.read_bps, su.prefetch_bytes)[0]

    def _backward(self, groups, uses, entries, written, bwd_total, t, recomputed):
        su = self.setup
        plan = entries[::-1]  # reverse pack order
        window = self.window_for(entries, written, bwd_total)
        state = {"cursor": 0, "inflight": 0, "read": 0}

        def pump(now: float) -> None:
            while state["cursor"] < len(plan):
                e = plan[state["cursor"]]
                if e.used or e.budgeted or e.read_done is not None:
                    state["cursor"] += 1
                    continue
                if state["inflight"] and state["inflight"] + e.padded > window:
                    return
                e.budgeted = e.padded
                state["inflight"] += e.padded
                if e.written > now:
                    e.want = True  # copied out of staging when its write completes
                else:
                    self.mem(now, e.padded, _HOST)
                    e.read_done = self._read(e, now)
                    state["read"] += e.nbytes
                state["cursor"] += 1

        def release(e: _Entry, now: float) -> None:
            state["inflight"] -= e.budgeted
            e.budgeted = 0
            pump(now)

        got = {"stall": 0.0, "sync": 0, "served": 0, "staged": 0}

        def take(e: _Entry, nbytes: int, tu: float, later: bool) -> float:
            """Backward uses offloaded ``e`` at ``tu``; returns when it has it (and copied
            it to the device)."""
            if e.read_done is None and e.written > tu:  # still in staging: copy it out
                self.mem(tu, e.padded, _HOST)
                tu += nbytes / su.capture_bps
                got["served"] += nbytes
                got["staged"] += 1
            elif e.read_done is None and e.want:  # copied out when the write completed
                self.mem(e.written, e.padded, _HOST)
                got["served"] += nbytes
                got["staged"] += 1
            else:
                if e.read_done is None:  # on disk and never issued: a synchronous load
                    got["sync"] += 1
                    if not e.budgeted:
                        e.budgeted = e.padded
                        state["inflight"] += e.padded
                    self.mem(tu, e.padded, _HOST)
                    e.read_done = self._read(e, tu)
                    state["read"] += nbytes
                if e.read_done > tu:
                    got["stall"] += e.read_done - tu
                    tu = e.read_done
            if not later:  # freed when its handle dies after the use
                self.mem(tu, -e.padded, _HOST)
            tu += nbytes / su.h2d_bps
            if e.host and not e.used:  # the tier lets go of its bytes at the use
                self.host_used -= e.padded
            e.used = True
            if not later:
                release(e, tu)
            return tu

        pump(t)
        for g, items, rec in zip(reversed(groups), reversed(uses), reversed(recomputed)):
            start, shift = t, 0.0
            if rec is not None:  # the block's forward again, then its saves are there
                inputs, e, cached = rec
                if e is not None:  # its inputs, written in forward, come back first
                    shift = take(e, inputs, start, False) - start
                    self.mem(start + shift, inputs, _DEV)
                again = getattr(g, "recompute", None)
                shift += g.fwd if again is None else again
                self.mem(start + shift, sum(s.nbytes for s in g.saved), _DEV)
                self.mem(start + shift, -inputs - cached, _DEV)
            events = []
            for use_at, order, n, e, free_at in items:
                later = free_at is not None and free_at > use_at  # held past its use
                events.append((use_at, _USE, order, n, e, later))
                if later:
                    events.append((free_at, _FREE, order, n, e, later))
            # backward order: by time, releases first, ties in reverse pack order
            for at, kind, _, nbytes, e, later in sorted(events, key=lambda x: x[:3]):
                tu = start + shift + at * g.bwd
                if kind == _FREE:
                    if e is None:
                        self.mem(tu, -nbytes, _DEV)
                    else:
                        self.mem(tu, -e.padded, _HOST)
                        release(e, tu)
                    continue
                if e is None:
                    if not later:
                        self.mem(tu, -nbytes, _DEV)
                    continue
                done = take(e, nbytes, tu, later)
                shift += done - tu
            t = start + shift + g.bwd
        self.staged_entries = got["staged"]
        return t, got["stall"], got["sync"], got["served"], state["read"]

    def peaks(self) -> tuple[int, int, int]:
        """Peak (all, device, host) bytes over the last step, what earlier steps left included."""
        t0, t1 = self.window
        cur = list(self.base)
        best = [0, 0, 0]
        for tm, _, delta, kind in sorted(self.events):
            cur[kind] += delta
            if t0 <= tm <= t1:
                best[0] = max(best[0], cur[0] + cur[1])
                best[kind + 1] = max(best[kind + 1], cur[kind])
        return best[0], best[1], best[2]
