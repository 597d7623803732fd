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
one writer and one reader at the measured rates that do not slow each other, staging bounded
as below, no copy costs, and the read-ahead window in use (DepthController's). Reads run in
reverse order within the window; a piece the read-ahead reaches while its write still runs is
served from staging (no read); one whose read has not landed stalls backward until it does.

Staging is bounded as the run bounds it (TBA_STAGING_BYTES, and TBA_STAGING_FULL: a full
staging keeps a tensor resident, or makes the pack wait), so a disk slower than the forward
fills staging and the rest of the step stays resident, as it does at run time.

The controller decides after step 1 (which runs with K=0, FIRST_K), then every ``every``
steps, and at once when the measured bandwidth moves by more than 25%, a step stalled more than
1%, a step went over the budget or over the slowdown bound (NOTE [Slowdown bound]). The offloader
sizes the read-ahead window (DepthController) before the controller decides, so K is chosen
for the window the next step uses.

# NOTE [Slowdown bound]
What a user states is what they want, not a mechanism. With TBA_MEMORY_BUDGET, the budget is
the bound: among the K whose predicted peak fits it (NOTE [Memory budget] in
tba/decide/budget.py), the smallest whose predicted stall is at most 1% of the step, else the
smallest within 1% of the fastest. Without one, TBA_MAX_SLOWDOWN (1.05 by default) is the
bound: the controller takes the smallest K (the most memory freed) whose predicted step is
within that factor of keeping every block (the step's compute, or the compute of the last
step that kept everything when that was less), and keeps every block when no smaller K is
predicted fast enough: keeping everything costs no time. A prediction is checked against the
step that ran it: a step over the bound (its compute plus its stalls against the same
reference), and the step after it at the same K, move the smallest K the controller may take
above the K that ran, and add what the prediction missed (the lesser of the two steps), per
offloaded byte, to every K that offloads: one step alone, on a noisy host, would move K for
good on an outlier. Both last until the bandwidth
or the compute moves by more than 25%, or a probe (below) measures again.

# NOTE [No absorbing state]
Keeping every block is a state like any other, and none is final. A step that keeps everything
writes and reads nothing, so it measures no bandwidth; left to itself the controller would
repeat, on the bandwidth it last measured, the decision that made it keep everything, forever.
So from keep-all it tries again in two ways: when the compute of a kept step moves by more than
25% from the one it decided on (with the bandwidth it last measured), and by a probe: one step
that offloads the first block (the one whose reads have the whole backward to arrive), which
measures the disk, after which the controller decides on fresh figures. Probes are paced so
that what they cost stays within PROBE_SHARE of the compute: after a probe whose step took e
seconds more than keeping everything, the next waits until the steps since have computed
e / PROBE_SHARE seconds, and at least ``every`` steps. From an offloading K, the way back is
the slowdown check above: a measured step over the bound moves K up at once, up to keep-all.
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

# K for the first step, before anything was measured: 0, budget or not. A kept block makes step
# 1's peak far higher than the steps after it whenever the controller then offloads it, and step 1
# is where a memory cap is met first: under a budget that breaks the budget (BENCHMARKS.md, "Batch
# headroom"), and without one a run is killed in step 1 at a batch its later steps would hold
# (W1 under a 1280 MiB cap at batch 32: 702 MiB resident in step 1 with one block kept, 330 MiB
# after). Step 1 writes and reads every block, so it measures the disk for every K.
FIRST_K = 0
PROBE_SHARE = (
    0.01  # most share of compute the probes from keep-all cost (NOTE [No absorbing state])
)


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
    staging: tuple[int | None, bool] = (None, False),
) -> KeepPrediction:
    """Replay one step with groups ``kept_from`` onwards resident, ``prefetch`` bytes of
    read-ahead, ``staging`` (TBA_STAGING_BYTES, or None for unbounded, and whether a full
    staging waits); see NOTE [Adaptive keep]."""
    return _predict(_spans(groups), kept_from, write_bps, read_bps, prefetch, k, staging=staging)


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
    staging: tuple[int | None, bool] = (None, False),
) -> KeepPrediction:
    setup = Setup(
        write_bps=write_bps,
        read_bps=read_bps,
        prefetch_bytes=prefetch,
        staging_bytes=staging[0],
        staging_waits=staging[1],
    )
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
    """Chooses K for ``TBA_KEEP_LAST=auto``; a fixed number just stays. See the NOTEs.

    ``budget`` is TBA_MEMORY_BUDGET (NOTE [Memory budget]); :attr:`room` is then the largest
    read-ahead window the budget leaves at the chosen K (None: no budget, no limit). Without a
    budget, ``max_slowdown`` bounds the predicted step (NOTE [Slowdown bound]). ``staging`` is
    (TBA_STAGING_BYTES, whether a full staging waits), as the run has them (None: unbounded).
    ``cadence`` spaces the decisions (NOTE [Decision cost] in tba/decide/cadence.py).
    """

    def __init__(
        self,
        setting: int | str,
        prefetch_bytes: int,
        every: int = 20,
        budget: int | float | None = None,
        cadence: Cadence | None = None,
        max_slowdown: float = 1.05,
        staging: tuple[int | None, bool] = (None, False),
    ):
        self.cadence = cadence or Cadence()
        self.auto = setting == "auto"
        self.k = FIRST_K if self.auto else int(setting)
        self.prefetch = prefetch_bytes
        self.every = every
        self.budget = budget
        self.max_slowdown = max_slowdown
        self.staging = staging
        self.room: int | None = None
        self.fits = True  # the last decision's K fits the budget (NOTE [Memory budget])
        self.margin = 0  # bytes a measured peak exceeded its prediction by, taken off the budget
        self.decided_at = 0  # step index of the last decision
        self.basis: tuple[float, ...] | None = None  # (write, read, allowed) it decided on
        self.bandwidth: tuple[float | None, float | None] = (None, None)
        # NOTE [Slowdown bound]: the compute of the last step that wrote nothing, the least K
        # the controller may take, and the seconds per offloaded byte its predictions missed
        self.reference: float | None = None
        self.least_k = 0
        self.missed = 0.0
        self.slow_at: int | None = None  # the K of the last step over the bound, if the last was
        self.slow_took = 0.0
        # NOTE [No absorbing state]: compute seconds to run before the next probe, the compute
        # the keep-all decision was made on, and whether the step now running is a probe
        self.probe_owed = 0.0
        self.kept_basis: float | None = None
        self.probing = False
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
        """Measurements of a step whose backward has run (it ran with :attr:`k`); may change
        :attr:`k`.

        ``records`` are :meth:`StepState.group_records`; ``kept_from(k)`` maps a K to the index of
        the first kept group (``len(records)`` when none is); K ranges over 0..``max_k``, and
        ``max_k`` keeps every block (NOTE [No absorbing state]). ``largest_read``,
        ``saved_bytes`` and ``peak_bytes`` are the step's, for the budget.
        """
        w = write_bps or self.bandwidth[0]
        r = read_bps or self.bandwidth[1]
        self.bandwidth = (w, r)
        if not self.auto or not records:
            return
        base = sum(x["fwd_seconds"] + x["bwd_seconds"] for x in records)
        stalled = stalled_seconds(records)
        ran, probed = self.k, self.probing
        self.probing = False
        moved = sum(x["offloaded_bytes"] for x in records)
        if not moved:  # nothing written: the compute of keeping everything
            self.reference = base
        ref = base if self.reference is None else min(base, self.reference)
        if probed:  # paced by what it cost (NOTE [No absorbing state])
            self.probe_owed = max(0.0, base + stalled - ref) / PROBE_SHARE
        if not w or not r:
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
        basis = (w, r) if allowed is None else (w, r, float(allowed))
        drifted = self.basis is None or any(
            abs(now - then) > DRIFT * then for now, then in zip(basis, self.basis)
        )
        kept_all = ran >= max_k and not moved
        if kept_all and self.kept_basis is not None:  # NOTE [No absorbing state]: compute moved
            drifted |= abs(base - self.kept_basis) > DRIFT * self.kept_basis
        if drifted or probed:  # conditions changed, or measured afresh: every K may run again
            self.least_k, self.missed = 0, 0.0
        took = base + stalled
        slow = allowed is None and moved > 0 and took > self.max_slowdown * ref
        # NOTE [Slowdown bound]: two steps in a row over the bound at the same K, not one (a
        # single step of a noisy host would move K for good); the lesser of the two counts
        if slow and not probed and self.slow_at != ran:
            self.slow_at, self.slow_took, slow = ran, took, False
        elif not slow:
            self.slow_at = None
        if slow and not probed:  # back towards keeping everything
            took = min(took, self.slow_took)
            self.slow_at = None
            self.least_k = max(self.least_k, ran + 1)
            guess = self.decision.get("predicted_step_seconds")
            if self.decision.get("k") == ran and guess is not None:
                self.missed = max(self.missed, (took - guess) / moved)
        due = step - self.decided_at >= self.every
        ready = self.cadence.ready(base)
        urgent = over or (slow and not probed) or probed
        if kept_all and max_k > 0 and not (drifted or over):
            self.probe_owed = max(0.0, self.probe_owed - base)
            if due and self.probe_owed == 0.0:  # a probe step: the first block offloaded
                self._probe(step, max_k)
            return  # nothing new measured: the decision stands until a probe or a change
        if not (drifted or due or urgent or stalled > STALL_SHARE * base):
            return
        if not (ready or urgent):  # NOTE [Decision cost] in tba/decide/cadence.py
            return
        t0 = self.cadence.start()
        spans = _spans(groups, min(PIECE, largest_read) if largest_read else PIECE)
        if allowed is None:
            preds = [
                _predict(spans, kept_from(k), w, r, self.prefetch, k, staging=self.staging)
                for k in range(max_k + 1)
            ]
            best, why = self._fastest_enough(preds, spans, kept_from, ref, max_k)
        else:
            smallest = max(largest_read, MIN_WINDOW)
            want = max(self.prefetch, smallest)
            limit = max(0, allowed - self.margin)
            preds = [
                self._fit(spans, kept_from(k), w, r, want, smallest, limit, k)
                for k in range(max_k + 1)
            ]
            best, why = self._within_budget(preds, base, limit)
            if best is None:
                best = min(preds, key=lambda p: (p.peak_bytes, p.k))
                if self.room is not None and not self.fits:
                    # NOTE [No growth past the budget] in tba/decide/budget.py
                    want = min(want, max(smallest, self.room))
                why = "no K meets TBA_MEMORY_BUDGET: the smallest predicted peak"
                # NOTE [Window past the budget] in tba/decide/budget.py
                k, first = best.k, kept_from(best.k)
                _, best = widest_window(
                    best.peak_bytes,
                    smallest,
                    want,
                    best,
                    lambda win: _predict(
                        spans, first, w, r, win, k, memory=True, staging=self.staging
                    ),
                )
        self.room = None if allowed is None else best.window
        self.fits = allowed is None or best.peak_bytes <= max(0, allowed - self.margin)
        self._decided(step, best, why, base, w, r, basis, preds, allowed)
        self.kept_basis = base if best.k >= max_k else None
        if best.k >= max_k > 0 and ran < max_k:
            # the first probe is paced by its predicted cost, later ones by their measured
            # cost (NOTE [No absorbing state])
            extra = max(0.0, preds[max_k - 1].step_seconds - base)
            self.probe_owed = max(self.probe_owed, extra / PROBE_SHARE)
        self.decision["decision_seconds"] = self.cadence.spent(t0)

    def _fastest_enough(self, preds, spans, kept_from, ref, max_k):
        """Without a budget: the smallest K at or above :attr:`least_k` predicted within
        TBA_MAX_SLOWDOWN of ``ref``, else keep-all (NOTE [Slowdown bound])."""
        bound = self.max_slowdown * ref
        for p in preds[self.least_k : max_k]:
            first = kept_from(p.k)
            offloaded = sum(sum(s.nbytes for s in g.saved) for g in spans[:first])
            if p.step_seconds + self.missed * offloaded <= bound:
                why = f"smallest K predicted within TBA_MAX_SLOWDOWN={self.max_slowdown:g}"
                return p, why
        why = (
            "keeps every block: no smaller K is predicted within "
            f"TBA_MAX_SLOWDOWN={self.max_slowdown:g}"
        )
        return preds[max_k], why

    @staticmethod
    def _within_budget(preds, base, limit):
        """With a budget: among the K whose peak fits, the smallest without predicted stalls,
        else the smallest within STALL_SHARE of the fastest (NOTE [Slowdown bound]); None when
        no K fits."""
        fitting = [p for p in preds if p.peak_bytes <= limit]
        if not fitting:
            return None, ""
        fits = [p for p in fitting if p.stall_seconds <= STALL_SHARE * base]
        if fits:
            why = f"smallest K with predicted stall <= {STALL_SHARE:.0%} of the step"
        else:
            fastest = min(p.step_seconds for p in fitting)
            fits = [p for p in fitting if p.step_seconds <= fastest + STALL_SHARE * base]
            why = (
                f"no K avoids stalls: the smallest K within {STALL_SHARE:.0%} of the fastest "
                "predicted step"
            )
        return fits[0], why + " within TBA_MEMORY_BUDGET"

    def _probe(self, step: int, max_k: int) -> None:
        """One step with the first block offloaded, to measure the disk again (NOTE [No
        absorbing state]); the next observed step decides on what it measured."""
        self.k = max_k - 1
        self.probing = True
        self.decided_at = step
        self.decision = {
            **self.decision,
            "k": self.k,
            "reason": "probe: one step offloads the first block to measure the disk again",
            "step": step,
            "probe": True,
        }
        log.info(
            "tba: keep_last=auto probes the disk after step %d (K=%d for one step)", step, self.k
        )

    def _fit(self, spans, first, w, r, want, smallest, allowed, k) -> KeepPrediction:
        """The prediction for ``k`` with the widest window up to ``want`` that keeps the
        predicted peak within ``allowed`` (NOTE [Memory budget]); its peak says whether even
        the smallest window fits."""
        at = lambda win: _predict(spans, first, w, r, win, k, memory=True, staging=self.staging)  # noqa: E731
        wide = at(want)
        if wide.peak_bytes <= allowed or want <= smallest:
            return wide
        narrow = at(smallest)
        room = min(want, window_room(allowed, narrow.peak_bytes, smallest))
        if narrow.peak_bytes > allowed or room <= smallest:
            return narrow
        return at(room)

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
