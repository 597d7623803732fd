"""Adaptive keep (``TBA_KEEP_LAST=auto``): how many of the last blocks stay resident.

# NOTE [Adaptive keep]
Backward needs the last blocks first, just when their writes are the most recent. Keeping the
last K blocks resident costs their memory; keeping too few makes backward wait for reads (or for
writes that have not finished). After each step whose backward has run, the offloader feeds the
step's measurements to :class:`KeepController`: per group, the forward and backward compute
time and the bytes that could be offloaded, and the achieved write and read bandwidth of the
step. For each candidate K, :func:`simulate_keep` replays the step with the simulator `tba plan`
uses (NOTE [Simulator] in tba/decide/simulator/engine.py), in its plain case: each group's bytes cut
into pieces produced and consumed evenly over its time (``pieces`` in tba/decide/simulator/rules.py;
no piece larger than the step's largest read, so the window holds as many as at run time),
one writer and one reader at the measured rates that do not slow each other, staging that
never fills, no copy costs, and the read-ahead window in use (DepthController's). Reads run in
reverse order within the window; a piece the read-ahead reaches while its write still runs is
served from staging (no read); one whose read has not landed stalls backward until it does.

The controller takes the smallest K whose predicted stall is at most 1% of the step, else the
smallest K whose predicted step is within 1% of the shortest, among the K that fit
TBA_MEMORY_BUDGET when one is set (NOTE [Memory budget] in tba/decide/budget.py). It decides after
step 1 (which runs with K=1), then every ``every`` steps, and at once when the measured
bandwidth moves by more than 25%, a step stalled more than 1%, or a step went over the budget.
The offloader sizes the read-ahead window (DepthController) before the controller decides, so
K is chosen for the window the next step uses.

# NOTE [No keep-all]
Adaptive keep never keeps every block: K is at most the number of blocks less one. A step that
keeps everything writes and reads nothing, so it measures no bandwidth; with nothing new to
decide from, the controller would repeat the decision that made it keep everything, forever
(one stalled step could thus end all saving for the rest of the run). With at least the first
block offloaded, every step measures the disk again, and the first block is the one whose reads
have the whole backward to arrive. Keeping everything is what ``TBA_KEEP_LAST`` set to the number
of blocks, or ``TBA_ENABLED=0``, asks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .budget import MIN_WINDOW, allowed_bytes, widest_window, window_room
from .cadence import DRIFT, STALL_SHARE, Cadence, stalled_seconds
from .readahead import DepthController
from .simulator import DEPTH_SAFETY, PIECE, Engine, Saved, Setup, Span, pieces, read_ahead

__all__ = [
    "DEPTH_SAFETY",
    "adapt",
    "PIECE",
    "DepthController",
    "MeasuredGroup",
    "KeepController",
    "KeepPrediction",
    "read_ahead",
    "simulate_keep",
]

log = logging.getLogger("tba")

# K for the first step, before anything was measured. When memory is bounded (TBA_MEMORY_BUDGET
# or TBA_POLICY=auto) it is 0 instead: a kept block makes step 1's peak far higher than the
# steps after it, and so breaks the budget on the step where a memory cap is met first
# (BENCHMARKS.md, "Batch headroom"). Step 1 still writes and reads every block, so it measures
# the disk either way.
FIRST_K = 1


@dataclass(frozen=True)
class MeasuredGroup:
    fwd: float  # seconds of forward compute
    bwd: float  # seconds of backward compute
    nbytes: int  # bytes this group offloads when it is not kept
    floor: int = 0  # bytes it keeps whatever K is (small tensors); counted for the budget


@dataclass(frozen=True)
class KeepPrediction:
    k: int
    step_seconds: float
    stall_seconds: float
    kept_bytes: int
    staged_groups: int  # pieces served from staging because their write was still running
    peak_bytes: int = 0  # predicted peak_resident_bytes (0: not predicted, no budget)
    window: int = 0  # the read-ahead window it was predicted with


def simulate_keep(
    groups: list[MeasuredGroup],
    kept_from: int,
    write_bps: float,
    read_bps: float,
    prefetch: int,
    k: int,
) -> KeepPrediction:
    """Replay one step with groups ``kept_from`` onwards resident, ``prefetch`` bytes of
    read-ahead; see NOTE [Adaptive keep]."""
    return _predict(_spans(groups), kept_from, write_bps, read_bps, prefetch, k)


def _spans(groups: list[MeasuredGroup], piece: int = PIECE) -> list[Span]:
    return [Span(g.fwd, g.bwd, pieces(g.nbytes, size=piece) + _floor(g.floor)) for g in groups]


def _floor(nbytes: int) -> list[Saved]:
    return [Saved("floor", nbytes, 0.5, 0.5, small=True)] if nbytes > 0 else []


def _predict(
    spans: list[Span],
    kept_from: int,
    write_bps: float,
    read_bps: float,
    prefetch: int,
    k: int,
    memory: bool = False,
) -> KeepPrediction:
    setup = Setup(write_bps=write_bps, read_bps=read_bps, prefetch_bytes=prefetch)
    engine = Engine(setup, memory=memory)  # without a budget the decision needs times only
    got = engine.step(spans, kept_from, k)
    peak = engine.peaks()[0] if memory else 0
    return KeepPrediction(
        k,
        got.step_seconds,
        got.stall_seconds,
        got.kept_bytes,
        engine.staged_entries,
        peak,
        prefetch,
    )


class KeepController:
    """Chooses K for ``TBA_KEEP_LAST=auto``; a fixed number just stays. See the NOTE.

    ``budget`` is TBA_MEMORY_BUDGET (NOTE [Memory budget]); :attr:`room` is then the largest
    read-ahead window the budget leaves at the chosen K (None: no budget, no limit). ``cadence``
    spaces the decisions (NOTE [Decision cost] in tba/decide/cadence.py).
    """

    def __init__(
        self,
        setting: int | str,
        prefetch_bytes: int,
        every: int = 20,
        budget: int | float | None = None,
        cadence: Cadence | None = None,
        bounded: bool = False,
    ):
        self.cadence = cadence or Cadence()
        self.auto = setting == "auto"
        first = 0 if bounded or budget is not None else FIRST_K
        self.k = first if self.auto else int(setting)
        self.prefetch = prefetch_bytes
        self.every = every
        self.budget = budget
        self.room: int | None = None
        self.margin = 0  # bytes a measured peak exceeded its prediction by, taken off the budget
        self.decided_at = 0  # step index of the last decision
        self.basis: tuple[float, ...] | None = None  # (write, read, allowed) it decided on
        self.bandwidth: tuple[float | None, float | None] = (None, None)
        self.decision: dict[str, Any] = {
            "mode": "auto" if self.auto else "fixed",
            "k": self.k,
            "reason": "first step: nothing measured yet" if self.auto else "TBA_KEEP_LAST",
        }

    def observe(
        self,
        step: int,
        records,
        write_bps,
        read_bps,
        kept_from,
        max_k: int,
        *,
        largest_read: int = 0,
        saved_bytes: int = 0,
        peak_bytes: int = 0,
    ) -> None:
        """Measurements of a step whose backward has run; may change :attr:`k`.

        ``records`` are :meth:`StepState.group_records`; ``kept_from(k)`` maps a K to the index of
        the first kept group (``len(records)`` when none is); K ranges over 0..``max_k``, and
        auto chooses below ``max_k`` when there is more than one block (NOTE [No keep-all]).
        ``largest_read``, ``saved_bytes`` and ``peak_bytes`` are the step's, for the budget.
        """
        w = write_bps or self.bandwidth[0]
        r = read_bps or self.bandwidth[1]
        self.bandwidth = (w, r)
        if not self.auto or not records or not w or not r:
            return
        allowed = allowed_bytes(self.budget, saved_bytes)
        over = allowed is not None and peak_bytes > allowed
        predicted = self.decision.get("predicted_peak_bytes")
        if over and predicted:  # the model underestimated this step's peak: plan with less
            self.margin = max(self.margin, peak_bytes - predicted)
        groups = [
            MeasuredGroup(
                x["fwd_seconds"],
                x["bwd_seconds"],
                x["offloaded_bytes"] + x["keepable_bytes"],
                max(0, x.get("kept_bytes", 0) - x["keepable_bytes"]),
            )
            for x in records
        ]
        base = sum(g.fwd + g.bwd for g in groups)
        stalled = stalled_seconds(records)
        basis = (w, r) if allowed is None else (w, r, float(allowed))
        drifted = self.basis is None or any(
            abs(now - then) > DRIFT * then for now, then in zip(basis, self.basis)
        )
        due = step - self.decided_at >= self.every
        ready = self.cadence.ready(base)
        if not (drifted or due or over or stalled > STALL_SHARE * base):
            return
        if not (ready or over):  # NOTE [Decision cost] in tba/decide/cadence.py
            return
        t0 = self.cadence.start()
        spans = _spans(groups, min(PIECE, largest_read) if largest_read else PIECE)
        if allowed is None:
            preds = [
                _predict(spans, kept_from(k), w, r, self.prefetch, k) for k in range(max_k + 1)
            ]
        else:
            smallest = max(largest_read, MIN_WINDOW)
            want = max(self.prefetch, smallest)
            limit = max(0, allowed - self.margin)
            preds = [
                self._fit(spans, kept_from(k), w, r, want, smallest, limit, k)
                for k in range(max_k + 1)
            ]
        top = max(0, max_k - 1)  # NOTE [No keep-all]
        allowed_k = preds[: top + 1]
        fitting = [p for p in allowed_k if allowed is None or p.peak_bytes <= limit]
        if fitting:
            fits = [p for p in fitting if p.stall_seconds <= STALL_SHARE * base]
            if not fits:  # the smallest K within STALL_SHARE of the fastest predicted step
                fastest = min(p.step_seconds for p in fitting)
                fits = [p for p in fitting if p.step_seconds <= fastest + STALL_SHARE * base]
            best = fits[0]
            why = (
                f"smallest K with predicted stall <= {STALL_SHARE:.0%} of the step"
                if best.stall_seconds <= STALL_SHARE * base
                else f"no K avoids stalls: the smallest K within {STALL_SHARE:.0%} of the "
                "fastest predicted step"
            )
            if allowed is not None:
                why += " within TBA_MEMORY_BUDGET"
        else:
            best = min(allowed_k, key=lambda p: (p.peak_bytes, p.k))
            why = "no K meets TBA_MEMORY_BUDGET: the smallest predicted peak"
            # NOTE [Window past the budget] in tba/decide/budget.py
            k, first = best.k, kept_from(best.k)
            _, best = widest_window(
                best.peak_bytes,
                smallest,
                want,
                best,
                lambda win: _predict(spans, first, w, r, win, k, memory=True),
            )
        self.room = None if allowed is None else best.window
        self._decided(step, best, why, base, w, r, basis, preds, allowed)
        self.decision["decision_seconds"] = self.cadence.spent(t0)

    def _fit(self, spans, first, w, r, want, smallest, allowed, k) -> KeepPrediction:
        """The prediction for ``k`` with the widest window up to ``want`` that keeps the
        predicted peak within ``allowed`` (NOTE [Memory budget]); its peak says whether even
        the smallest window fits."""
        wide = _predict(spans, first, w, r, want, k, memory=True)
        if wide.peak_bytes <= allowed or want <= smallest:
            return wide
        narrow = _predict(spans, first, w, r, smallest, k, memory=True)
        room = min(want, window_room(allowed, narrow.peak_bytes, smallest))
        if narrow.peak_bytes > allowed or room <= smallest:
            return narrow
        return _predict(spans, first, w, r, room, k, memory=True)

    def _decided(self, step, best, why, base, w, r, basis, preds, allowed) -> None:
        changed = best.k != self.k
        self.k = best.k
        self.decided_at = step
        self.basis = basis
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
        if allowed is not None:
            self.decision.update(
                allowed_bytes=allowed,
                margin_bytes=self.margin,
                predicted_peak_bytes=best.peak_bytes,
                window_room_bytes=self.room,
                candidate_peaks={p.k: p.peak_bytes for p in preds},
            )
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


def adapt(
    keeper: KeepController,
    depth: DepthController,
    step: int,
    records,
    write_bps: float | None,
    read_bps: float | None,
    kept_from,
    max_k: int,
    *,
    largest_read: int,
    saved_bytes: int,
    peak_bytes: int,
    keeper_room: bool = True,
) -> int:
    """One observed step through both controllers, in the order they depend on each other;
    returns the read-ahead window for the next step. The window is sized first, so that K is
    chosen for the window in use; then the budget's room at that K cuts the window (NOTE
    [Adaptive keep], NOTE [Memory budget] in tba/decide/budget.py), unless ``keeper_room`` is false:
    auto's assignment is in force, and its own room applies (NOTE [Window under auto] in
    tba/decide/block_policy.py)."""
    depth.observe(step, records, read_bps, largest_read, saved_bytes)
    keeper.prefetch = depth.depth
    keeper.observe(
        step,
        records,
        write_bps,
        read_bps,
        kept_from,
        max_k,
        largest_read=largest_read,
        saved_bytes=saved_bytes,
        peak_bytes=peak_bytes,
    )
    if keeper_room:
        depth.limit(step, keeper.room)
    return depth.depth
