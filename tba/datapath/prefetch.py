"""The reverse-order prefetch plan: which bytes are read back when, and the device-side window
behind it (groups, which block a tensor belongs to, are in tba/datapath/blocks/groups.py).

# NOTE [Prefetch]
When the forward ends, the step's offloaded entries are sorted by their latest pack (the reverse
of the forward order, which is the order backward unpacks them). Reads are issued in that order
while the bytes read and not yet consumed stay within ``prefetch_bytes`` (at least one entry is
always allowed). Each consumed entry returns its bytes to the budget and the plan moves on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..records.entry import CAPTURE, DEAD, FAILED, MEMORY, ON_DISK, WRITING, Entry
from ..records.step import StepState

# NOTE [Forwarding]
# An unpack is served by the saved tensor itself while it is alive (the user, or another part
# of the graph, still holds it): reading its bytes back would cost a read and memory for
# nothing. So when the plan reaches an entry on disk whose originals (every tensor a handle
# was made for) are all alive, it takes the entry's budget as usual but reads nothing, and
# keeps the entry aside (``step.deferred``). (An entry still being captured or written is
# fetched as before, from staging when its write completes, with no read: until then tba
# itself may be what holds its original.) Each later pump looks at those first: one whose original
# has died since is read then, in its own budget, so the window and its order are those of a
# plan without forwarding; one that was unpacked (``Entry.deferred`` cleared at its last use,
# which gives the budget back) is forgotten. An original that dies between a pump and its
# unpack costs a synchronous read, counted in ``sync_loads``.


# NOTE [Plan order]
# Each forward leaves a plan (its entries, last packed first). Which plan's backward comes next
# is not known in advance: with plain gradient accumulation it is the only one; with pipeline
# parallelism (1F1B) several micro-batches' forwards run before the first backward, and that
# backward belongs to the OLDEST of them. So plans are served:
# 1. plans whose backward has started (an entry was unpacked), oldest first;
# 2. then the others, oldest first.
# The first time a step's backward starts, reads already done for OLDER steps whose backward has
# not started are dropped again (their bytes stay on disk) and those plans start over, so that a
# graph kept alive without a backward (a forward whose loss is only logged) cannot hold the
# budget that the running backward needs. Newer steps keep theirs: under 1F1B they come next.
# Reads still in flight keep their budget until used or dead.
# NOTE [Device prefetch]
# On a GPU a read lands in pinned host memory; the unpack needs it in device memory. Copying it
# there at unpack time would put the H2D copy on the critical path, serial with compute. So a
# second, smaller window follows the read-ahead: every entry the plan fetches is queued, in plan
# order, and as soon as the queue's head has its bytes in host memory (its read completed, on
# an I/O thread, or its staging was copied out) its H2D copy is issued on the side stream
# (NOTE [CUDA ordering] 4), while the bytes uploaded and not yet used stay within
# TBA_DEVICE_PREFETCH_BYTES (at least one entry is always allowed; 0 turns the window off and
# every copy is made at unpack). The queue is served strictly in order, so device memory is
# spent on what backward needs next, never on a later entry whose read happened to finish
# first. Each use gives its bytes back (with the read-ahead budget); the unpack makes the
# consumer stream wait on the copy's event (4a). ``uploads_ahead`` and ``uploads_at_unpack``
# in stats() count which way each copy went.
class DeviceWindow:
    """The device-side window over the plan's reads. Caller holds the lock.

    ``uploads(e)``: whether ``e``'s device takes uploads at all (a CUDA device; never the CPU);
    ``upload(e)``: start its H2D copy, False when it could not (it is then made at unpack).
    """

    def __init__(
        self,
        budget: int,
        uploads: Callable[[Entry], bool] = lambda e: False,
        upload: Callable[[Entry], bool] = lambda e: False,
    ):
        self.budget = budget
        self.uploads = uploads
        self.upload = upload
        self.inflight = 0
        self.queue: deque[Entry] = deque()

    def want(self, e: Entry) -> None:
        """The plan fetches ``e``: upload it when its turn comes."""
        if self.budget and self.uploads(e):
            self.queue.append(e)

    def pump(self) -> None:
        q = self.queue
        while q:
            e = q[0]
            if e.state in (DEAD, FAILED, MEMORY) or not e.budgeted or e.upload is not None:
                q.popleft()  # used, dropped or already on the device: not this window's
                continue
            if e.host is None:
                return  # its read is still running: strictly in order
            if self.inflight and self.inflight + e.padded > self.budget:
                return
            q.popleft()
            if self.upload(e):
                e.dev_budgeted = e.padded
                self.inflight += e.padded

    def give_back(self, e: Entry) -> None:
        if e.dev_budgeted:
            self.inflight -= e.dev_budgeted
            e.dev_budgeted = 0


class Prefetcher:
    """Issues reads in reverse forward order within a byte budget, and the device window's
    uploads behind them (:attr:`device`). Caller holds the lock."""

    def __init__(self, budget: int, start: Callable[[Entry], None]):
        self.budget = budget
        self.start = start
        self.inflight = 0
        self.plans: list[StepState] = []
        self.device = DeviceWindow(0)  # off until the Reader sets it up

    def arm(self, step: StepState) -> None:
        step.plan = sorted(step.entries, key=lambda e: -e.seq)
        step.entries = []
        step.cursor = 0
        self.plans.append(step)
        self.pump()

    def started(self, step: StepState, drop: Callable[[Entry], None]) -> None:
        """``step``'s backward unpacked its first entry (NOTE [Plan order]); ``drop(e)`` gives
        back a read-back buffer that no use has consumed yet."""
        step.backward_started = True
        for other in self.plans:
            if other.backward_started or other.index >= step.index:
                continue  # only older forwards without a backward (a newer one may be next)
            if other.cursor >= len(other.plan or []):
                continue  # every read issued: only forwardable entries left (NOTE [Forwarding])
            for e in other.plan[: other.cursor]:
                if e.budgeted and e.host is not None and not e.io_busy and e.left == e.uses:
                    drop(e)
            other.cursor = 0
            for e in other.deferred:
                e.deferred = False  # seen again from the start of the plan
                self.give_back(e)
            other.deferred = []

    def pump(self) -> None:
        # called at every entry's last use: no list is built unless a plan has finished
        plans = self.plans
        for started in (True, False):  # NOTE [Plan order]
            for step in plans:
                if step.backward_started is started and not self._pump_plan(step):
                    return
        for s in plans:
            if s.cursor >= len(s.plan or []) and not s.deferred:
                self._drop_finished()
                break
        self.device.pump()

    def _pump_plan(self, step: StepState) -> bool:
        """Issue ``step``'s next reads; False when the budget is spent (stop there)."""
        if step.deferred:
            self._pump_deferred(step)
        plan = step.plan or []
        while step.cursor < len(plan):
            e = plan[step.cursor]
            if e.state in (DEAD, FAILED, MEMORY) or e.host is not None or e.budgeted:
                step.cursor += 1
                continue
            if self.inflight and self.inflight + e.padded > self.budget:
                return False
            self.take(e)
            if e.state is ON_DISK and e.originals_alive():  # NOTE [Forwarding]
                e.deferred = True
                step.deferred.append(e)
            else:
                self._fetch(e)
            step.cursor += 1
        return True

    def _fetch(self, e: Entry) -> None:
        """Bring a budgeted entry's bytes back: a read, or its staging once written."""
        if e.state in (CAPTURE, WRITING):
            e.want = True  # served from staging when its write completes
        else:
            self.start(e)
        self.device.want(e)

    def _pump_deferred(self, step: StepState) -> None:
        """Read the passed-over entries whose originals died since (NOTE [Forwarding])."""
        still = []
        for e in step.deferred:
            if not e.deferred or not e.budgeted or e.state in (DEAD, FAILED, MEMORY):
                e.deferred = False
            elif e.originals_alive():
                still.append(e)
            else:
                e.deferred = False
                if e.host is None and e.reading is None:
                    self._fetch(e)
        step.deferred = still

    def _drop_finished(self) -> None:
        keep = []
        for s in self.plans:
            if s.cursor < len(s.plan or []) or s.deferred:
                keep.append(s)
            else:
                s.plan = None  # release the entries; the step keeps only its counters
        self.plans = keep

    def take(self, e: Entry) -> None:
        e.budgeted = e.padded
        self.inflight += e.padded

    def give_back(self, e: Entry) -> None:
        if e.budgeted:
            self.inflight -= e.budgeted
            e.budgeted = 0
        self.device.give_back(e)

    def drop_plans(self) -> None:
        self.plans.clear()
        self.device.queue.clear()
