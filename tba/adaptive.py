"""Adaptive keep (``TBA_KEEP_LAST=auto``): how many of the last blocks stay resident.

# NOTE [Adaptive keep]
Backward needs the last blocks first, just when their writes are the most recent. Keeping the
last K blocks resident costs their memory; keeping too few makes backward wait for reads (or for
writes that have not finished). After each step whose backward has run, the offloader feeds the
step's measurements to :class:`KeepController`: per group, the forward and backward compute
time and the bytes that could be offloaded, and the achieved write and read bandwidth of the
step. For each candidate K, :func:`simulate` replays the step:

- forward: group i produces its bytes while it computes; one writer drains them at the write
  bandwidth, in order (the staging pool holds what waits, so the forward never waits);
- backward, in reverse: reads are issued in reverse order as soon as the group's write is done,
  the reader is free and the prefetch budget (bytes read but not yet consumed) allows; a group
  whose write is still running when backward reaches it is served from staging (no read); a
  group whose read has not landed stalls backward until it does.

The controller takes the smallest K whose predicted stall is at most 1% of the step, else the
K with the shortest predicted step. It decides after step 1 (which runs with K=1), then every
``every`` steps, and at once when the measured bandwidth moves by more than 25% or a step
stalled more than 1%. Simplifications, stated: reads and writes do not slow each other, tensors
are produced evenly within a group, staging never fills.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("tba")

STALL_SHARE = 0.01  # a K is good enough when its predicted stall is at most this share of a step
DRIFT = 0.25  # re-decide when a bandwidth moves by more than this
FIRST_K = 1  # K for the first step, before anything was measured
PIECE = 16 << 20  # the simulation moves bytes in pieces of at most this (tensors are smaller)


@dataclass(frozen=True)
class Group:
    fwd: float  # seconds of forward compute
    bwd: float  # seconds of backward compute
    nbytes: int  # bytes this group offloads when it is not kept


@dataclass(frozen=True)
class Prediction:
    k: int
    step_seconds: float
    stall_seconds: float
    kept_bytes: int
    staged_groups: int  # groups served from staging because their write was still running


def simulate(
    groups: list[Group], kept_from: int, write_bps: float, read_bps: float, prefetch: int, k: int
) -> Prediction:
    """Replay one step with groups ``kept_from`` onwards resident; see NOTE [Adaptive keep].

    Groups are cut into pieces of at most 16 MiB (compute split evenly), since tba reads and
    releases tensor by tensor: a group larger than the budget is read while the previous one is
    being consumed, not after it.
    """
    piece = PIECE
    chunks: list[Group] = []
    first = None
    for i, g in enumerate(groups):
        if i == kept_from:
            first = len(chunks)
        n = max(1, -(-g.nbytes // piece))
        q, extra = divmod(g.nbytes, n)
        chunks += [Group(g.fwd / n, g.bwd / n, q + (j < extra)) for j in range(n)]
    got = _replay(chunks, len(chunks) if first is None else first, write_bps, read_bps, prefetch)
    return Prediction(k, *got)


def _replay(groups: list[Group], kept_from: int, write_bps, read_bps, prefetch: int):
    t = 0.0
    writer = 0.0
    written: list[float] = []
    for i, g in enumerate(groups):
        start = t
        t += g.fwd
        if i < kept_from and g.nbytes:
            writer = max(max(writer, start) + g.nbytes / write_bps, t)
        written.append(writer if i < kept_from and g.nbytes else 0.0)
    forward_end = t
    reader = forward_end
    consumed: list[tuple[float, int]] = []  # (time, bytes) groups read back and then used
    stall = 0.0
    staged = 0
    kept = 0
    for i in range(len(groups) - 1, -1, -1):
        g = groups[i]
        if i >= kept_from or not g.nbytes:
            kept += g.nbytes if i >= kept_from else 0
            t += g.bwd
            continue
        if written[i] > t:  # still being written: the bytes are in staging
            staged += 1
            t += g.bwd
            continue
        start = max(reader, written[i], forward_end)
        start = _budget_allows(consumed, start, g.nbytes, prefetch)
        reader = start + g.nbytes / read_bps
        wait = max(0.0, reader - t)
        stall += wait
        t += wait + g.bwd
        consumed.append((t, g.nbytes))
    return t, stall, kept, staged


def _budget_allows(consumed: list[tuple[float, int]], start: float, nbytes: int, budget: int):
    """Earliest time >= start when the reads still unconsumed leave room for ``nbytes``."""
    pending = sorted(c for c in consumed if c[0] > start)
    held = sum(n for _, n in pending)
    for when, n in pending:
        if held == 0 or held + nbytes <= budget:
            break
        start, held = when, held - n
    return start


class KeepController:
    """Chooses K for ``TBA_KEEP_LAST=auto``; a fixed number just stays. See the NOTE."""

    def __init__(self, setting: int | str, prefetch_bytes: int, every: int = 20):
        self.auto = setting == "auto"
        self.k = FIRST_K if self.auto else int(setting)
        self.prefetch = prefetch_bytes
        self.every = every
        self.decided_at = 0  # step index of the last decision
        self.basis: tuple[float, float] | None = None  # (write, read) bandwidth it used
        self.bandwidth: tuple[float | None, float | None] = (None, None)
        self.decision: dict[str, Any] = {
            "mode": "auto" if self.auto else "fixed",
            "k": self.k,
            "reason": "first step: nothing measured yet" if self.auto else "TBA_KEEP_LAST",
        }

    def observe(self, step: int, records, write_bps, read_bps, kept_from, max_k: int) -> None:
        """Measurements of a step whose backward has run; may change :attr:`k`.

        ``records`` are :meth:`StepState.group_records`; ``kept_from(k)`` maps a K to the index of
        the first kept group (``len(records)`` when none is); K ranges over 0..``max_k``.
        """
        w = write_bps or self.bandwidth[0]
        r = read_bps or self.bandwidth[1]
        self.bandwidth = (w, r)
        if not self.auto or not records or not w or not r:
            return
        groups = [
            Group(x["fwd_seconds"], x["bwd_seconds"], x["offloaded_bytes"] + x["keepable_bytes"])
            for x in records
        ]
        base = sum(g.fwd + g.bwd for g in groups)
        stalled = sum(x["stall_seconds"] for x in records)
        drifted = self.basis is None or any(
            abs(now - then) > DRIFT * then for now, then in zip((w, r), self.basis)
        )
        due = step - self.decided_at >= self.every
        if not (drifted or due or stalled > STALL_SHARE * base):
            return
        preds = [simulate(groups, kept_from(k), w, r, self.prefetch, k) for k in range(max_k + 1)]
        fits = [p for p in preds if p.stall_seconds <= STALL_SHARE * base]
        best = fits[0] if fits else min(preds, key=lambda p: (p.step_seconds, p.k))
        why = (
            f"smallest K with predicted stall <= {STALL_SHARE:.0%} of the step"
            if fits
            else "no K avoids stalls: the fastest predicted step"
        )
        changed = best.k != self.k
        self.k = best.k
        self.decided_at = step
        self.basis = (w, r)
        self.decision = {
            "mode": "auto",
            "k": best.k,
            "reason": why,
            "step": step,
            "write_bps": w,
            "read_bps": r,
            "compute_seconds": base,
            "predicted_step_seconds": best.step_seconds,
            "predicted_stall_seconds": best.stall_seconds,
            "candidates": {p.k: round(p.step_seconds, 4) for p in preds},
        }
        if changed:
            log.info(
                "tba: keep_last=auto chose K=%d after step %d (%s; predicted step %.3f s, "
                "stall %.3f s, compute %.3f s; write %.0f MB/s, read %.0f MB/s)",
                best.k,
                step,
                why,
                best.step_seconds,
                best.stall_seconds,
                base,
                w / 1e6,
                r / 1e6,
            )


# NOTE [Prefetch depth]
# TBA_PREFETCH_BYTES caps the read-ahead window; within it, the window (the bytes read ahead
# and not yet consumed by backward) is sized from measurements of the last observed step:
#
#   depth = L * (1 + SAFETY * c / r),  within [L, cap]
#
# L is the largest single read (a tensor's extent, or a whole coalesced batch), c the rate at
# which backward consumed offloaded bytes (their bytes over backward compute time) and r the
# achieved read bandwidth. While one read of L bytes is in flight (L / r seconds), backward
# consumes c * L / r bytes, so the window must hold that much beyond the read itself for the
# next read to be issued early enough; SAFETY (2) absorbs jitter. When the disk reads slower
# than backward consumes (r <= c), no window hides that, and the cap is used (adaptive keep
# then keeps more). A step that stalls more than STALL_SHARE of its compute raises a floor: the
# depth never drops below twice the depth that stalled (up to the cap). A smaller window is a
# lower peak: on W1 the read-ahead window is most of what tba keeps resident in backward.
DEPTH_SAFETY = 2.0


def read_ahead(largest: int, consume_bps: float, read_bps: float, cap: int) -> tuple[int, str]:
    """The read-ahead window for these measurements, and why (NOTE [Prefetch depth]); the
    planner (tba/plan.py) sizes its simulated window with the same rule."""
    if consume_bps >= read_bps:
        return cap, "the disk reads slower than backward consumes: the cap"
    want = int(largest * (1 + DEPTH_SAFETY * consume_bps / read_bps))
    why = "largest read plus what backward consumes while it is read, twice over"
    return min(cap, max(want, largest)), why


class DepthController:
    """Chooses the read-ahead window within the TBA_PREFETCH_BYTES cap (NOTE [Prefetch depth])."""

    def __init__(self, cap: int):
        self.cap = cap
        self.depth = cap
        self.floor = 0
        self.decision: dict[str, Any] = {
            "depth": cap,
            "cap": cap,
            "reason": "first step: nothing measured yet, the cap",
        }

    def observe(self, step: int, records, read_bps: float | None, largest_read: int) -> None:
        if not records or not read_bps or not largest_read:
            return
        consumed = sum(x["offloaded_bytes"] for x in records)
        bwd = sum(x["bwd_seconds"] for x in records)
        base = sum(x["fwd_seconds"] + x["bwd_seconds"] for x in records)
        stalled = sum(x["stall_seconds"] for x in records)
        if stalled > STALL_SHARE * base:
            self.floor = min(self.cap, 2 * self.depth)
        rate = consumed / bwd if bwd > 0 else float("inf")
        want, why = read_ahead(largest_read, rate, read_bps, self.cap)
        depth = min(self.cap, max(want, largest_read, self.floor))
        if self.floor and depth == self.floor and want < self.floor:
            why = "raised after a step stalled"
        if depth != self.depth:
            log.info(
                "tba: read-ahead window %d -> %d bytes after step %d (%s)",
                self.depth,
                depth,
                step,
                why,
            )
        self.depth = depth
        self.decision = {
            "depth": depth,
            "cap": self.cap,
            "reason": why,
            "step": step,
            "largest_read": largest_read,
            "consume_bps": rate,
            "read_bps": read_bps,
        }
