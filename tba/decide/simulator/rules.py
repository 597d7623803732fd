"""The rules the simulator applies (NOTE [Simulator] in tba/decide/simulator/engine.py) and its
inputs: which groups stay resident, which tensors are large enough to offload, how a group known
only by its total bytes is cut into pieces, and the read-ahead window."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Protocol

PIECE = 16 << 20  # a group known only by its total bytes is simulated in pieces of at most this


@dataclasses.dataclass(frozen=True)
class Saved:
    """One capture: ``pack_at`` and ``use_at`` are fractions of its group's forward and
    backward time; ``free_at`` (None: at the use) when backward holds it longer."""

    name: str
    nbytes: int
    pack_at: float
    use_at: float
    small: bool | None = None  # None: below min_offload_bytes; a measurement decides it instead
    free_at: float | None = None


class Stage(Protocol):
    """What the simulator reads of a group (tba.plan's Group is one)."""

    fwd: float
    bwd: float
    saved: Sequence[Saved]


@dataclasses.dataclass(frozen=True)
class Span:
    """A group with nothing else to it: the runtime's measured groups."""

    fwd: float
    bwd: float
    saved: Sequence[Saved]
    input_bytes: int = 0  # what a recomputed group keeps (its checkpoint's inputs)
    recompute: float | None = None  # seconds backward's run of its forward takes (None: fwd)
    # what a selective group keeps besides its inputs (NOTE [Selective recompute])
    cached_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Setup:
    """Rates (bytes/s; inf: instant) and tba's settings; the defaults are the runtime's case."""

    write_bps: float = math.inf
    read_bps: float = math.inf
    shared_disk: bool = False  # reads queue behind writes on one server
    capture_bps: float = math.inf  # device-to-staging copy, on the compute timeline
    h2d_bps: float = math.inf  # read-back host-to-device copy, on the compute timeline
    staging_bytes: int | None = None  # None: unbounded
    staging_waits: bool = False  # a pack waits for staging (TBA_STAGING_FULL=wait), else keeps
    # the bytes in flight the run allows under a memory budget (NOTE [Staging within the
    # budget] in tba/datapath/capture/staging.py): over it a tensor waits, or goes alone when
    # nothing else is in flight; None: the arena's size is the only bound
    staging_limit: int | None = None
    min_offload_bytes: int = 0
    prefetch_bytes: int = 128 << 20  # the read-ahead window, or its cap with size_window
    size_window: bool = False
    align: int = 1  # transfers and staging blocks are rounded up to this
    # The host tier (NOTE [Host tier] in tba/storage/hosttier.py): its capacity (0: none) and
    # the rate of its copies each way (PCIe, or the staging-to-host memcpy), one queue each way
    host_bytes: int = 0
    host_bps: float = math.inf

    def offloadable(self, s: Saved) -> bool:
        return offloadable(s, self.min_offload_bytes)


def offloadable(s: Saved, min_offload_bytes: int) -> bool:
    """tba's size rule: not marked small, or (unmarked) at least ``min_offload_bytes``."""
    return not s.small if s.small is not None else s.nbytes >= min_offload_bytes


def kept_from(blocks: Sequence[bool], keep: int) -> int:
    """The first group that stays resident with keep-last ``keep``, given which groups are
    blocks: the first of the last ``keep`` blocks (every group after it stays too; all blocks
    when ``keep`` is their number or more); the number of groups when ``keep`` is 0. The
    runtime's GroupTracker.kept_from (tba/datapath/blocks/groups.py) asks this rule too."""
    if keep <= 0:
        return len(blocks)
    first = max(0, sum(blocks) - keep)
    seen = 0
    for i, block in enumerate(blocks):
        if block:
            if seen == first:
                return i
            seen += 1
    return len(blocks)


def pieces(nbytes: int, name: str = "", size: int = PIECE) -> list[Saved]:
    """A group's offloadable bytes when only their total is known (measurements, a trace):
    pieces of at most ``size`` bytes (PIECE, or the measured largest read when smaller, so that
    a window of two reads holds two pieces, as it holds two tensors at run time), one per equal
    slice of the group's time. Piece j of n is
    packed in the middle of forward slice j (where its tensors are on average), needed when
    backward reaches that slice, and released when backward leaves it (tba reads and releases
    tensor by tensor, so a group larger than the window is read while the one before it is
    consumed, not after)."""
    if nbytes <= 0:
        return []
    n = -(-nbytes // max(1, size))
    q, extra = divmod(nbytes, n)
    return [
        Saved(f"{name}{j}", q + (j < extra), (j + 0.5) / n, 1 - (j + 1) / n, None, 1 - j / n)
        for j in range(n)
    ]


# NOTE [Measured layout]
# Uniform pieces put a group's bytes evenly over its forward. A transformer block's are not: in a
# pre-LN block the MLP's two activations of width 4H, about half of what the block saves, are its
# last saves. Writes go in pack order, so on a slow disk those are still in staging when backward
# reaches the block and are never read, while the first, small ones are on disk and are. Uniform
# pieces therefore overstate what backward reads on a slow disk, and so the step time of the
# assignments that offload. A step that packs a group's tensors (kept or offloaded) records each new
# storage's bytes in pack order (``GroupStat.sizes``); ``measured_pieces`` gives the simulator those
# tensors, the i-th of n packed in the middle of forward slice i and needed and released as
# ``pieces`` has it. Runs of tensors below ``SMALL`` are merged (their order matters little; the
# replay's cost grows with the count). When they do not add up to the group's bytes (those were
# measured in another step, e.g. one that recomputed the block), they are scaled to them; without
# sizes it is ``pieces``.
SMALL = 1 << 20


def measured_pieces(nbytes: int, sizes: Sequence[int], name: str = "") -> list[Saved]:
    """A group's saved bytes as its measured tensors, else :func:`pieces` (NOTE [Measured
    layout])."""
    total = sum(sizes)
    if not sizes or nbytes <= 0 or total <= 0:
        return pieces(nbytes, name)
    if total != nbytes:
        scaled = [n * nbytes // total for n in sizes]
        scaled[-1] += nbytes - sum(scaled)
        sizes = scaled
    merged: list[int] = []
    for n in sizes:
        if merged and n < SMALL and merged[-1] < SMALL:
            merged[-1] += n
        else:
            merged.append(n)
    k = len(merged)
    return [
        Saved(f"{name}{j}", n, (j + 0.5) / k, 1 - (j + 1) / k, None, 1 - j / k)
        for j, n in enumerate(merged)
    ]


# NOTE [Prefetch depth]
# TBA_PREFETCH_BYTES caps the read-ahead window (without it, the default cap scales with the
# step's saved bytes: default_window_cap in tba/decide/budget.py); within the cap, the window (the
# bytes read ahead and not yet consumed by backward) is sized from measurements of the last step:
#
#   depth = L * (2 + SAFETY * c / r),  within [L, cap]
#
# L is the largest single read (a tensor's extent, or a whole coalesced batch), c the rate at
# which backward consumed offloaded bytes (their bytes over backward compute time) and r the
# achieved read bandwidth. An entry holds its budget until its last use, so the window holds
# the entry backward is consuming and the next one, being read: two largest reads (double
# buffering; with one, the next read starts only when the current entry is done and backward
# waits for every read, or loads it synchronously). While a read of L bytes is in flight (L / r
# seconds) backward consumes c * L / r bytes, so the window holds that much more for the read
# after it to be issued early enough; SAFETY (2) absorbs jitter. When the disk reads slower
# than backward consumes (r <= c), no window hides that, and the cap is used (adaptive keep
# then keeps more). A step that stalls more than STALL_SHARE of its compute raises a floor: the
# depth does not drop below twice the depth that stalled (up to the cap, or, for the default
# cap, up to two largest reads where those are more: NOTE [Memory budget] in tba/decide/budget.py;
# DepthController in tba/decide/readahead.py) until FLOOR_AGE steps pass without a stall, when the
# floor halves. A smaller window is a lower peak: when the disk keeps up, the read-ahead window is
# most of what tba keeps resident in backward. TBA_MEMORY_BUDGET can cut the window below this
# (NOTE [Memory budget] in tba/decide/budget.py), never below one largest read.
DEPTH_SAFETY = 2.0


def read_ahead(largest: int, consume_bps: float, read_bps: float, cap: int) -> tuple[int, str]:
    """The read-ahead window for these measurements, and why (NOTE [Prefetch depth])."""
    if consume_bps >= read_bps:
        return cap, "the disk reads slower than backward consumes: the cap"
    want = int(largest * (2 + DEPTH_SAFETY * consume_bps / read_bps))
    why = "two largest reads plus what backward consumes while one is read, twice over"
    return min(cap, max(want, largest)), why
