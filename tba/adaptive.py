"""Adaptive keep (``TBA_KEEP_LAST=auto``): how many of the last blocks stay resident.

# NOTE [Adaptive keep]
Backward needs the last blocks first, just when their writes are the most recent. Keeping the
last K blocks resident costs their memory; keeping too few makes backward wait for reads (or for
writes that have not finished). After each step whose backward has run, the offloader feeds the
step's measurements to :class:`KeepController`: per group, the forward and backward compute
time and the bytes that could be offloaded, and the achieved write and read bandwidth of the
step. For each candidate K, :func:`simulate` replays the step with the simulator `tba plan`
uses (NOTE [Simulator] in tba/simulator/engine.py), in its plain case: each group's bytes cut
into pieces produced and consumed evenly over its time (``pieces`` in tba/simulator/rules.py),
one writer and one reader at the measured rates that do not slow each other, staging that
never fills, no copy costs, and the read-ahead window in use (DepthController's). Reads run in
reverse order within the window; a piece the read-ahead reaches while its write still runs is
served from staging (no read); one whose read has not landed stalls backward until it does.

The controller takes the smallest K whose predicted stall is at most 1% of the step, else the
K with the shortest predicted step. It decides after step 1 (which runs with K=1), then every
``every`` steps, and at once when the measured bandwidth moves by more than 25% or a step
stalled more than 1%.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .chooser import Cost, choose
from .simulator import DEPTH_SAFETY, PIECE, Engine, Setup, Span, pieces, read_ahead

__all__ = [
    "DEPTH_SAFETY",
    "PIECE",
    "DepthController",
    "Group",
    "KeepController",
    "PolicyController",
    "Prediction",
    "read_ahead",
    "simulate",
]

log = logging.getLogger("tba")

STALL_SHARE = 0.01  # a K is good enough when its predicted stall is at most this share of a step
DRIFT = 0.25  # re-decide when a bandwidth moves by more than this
FIRST_K = 1  # K for the first step, before anything was measured


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
    staged_groups: int  # pieces served from staging because their write was still running


def simulate(
    groups: list[Group], kept_from: int, write_bps: float, read_bps: float, prefetch: int, k: int
) -> Prediction:
    """Replay one step with groups ``kept_from`` onwards resident, ``prefetch`` bytes of
    read-ahead; see NOTE [Adaptive keep]."""
    return _predict(_spans(groups), kept_from, write_bps, read_bps, prefetch, k)


def _spans(groups: list[Group]) -> list[Span]:
    return [Span(g.fwd, g.bwd, pieces(g.nbytes)) for g in groups]


def _predict(
    spans: list[Span], kept_from: int, write_bps: float, read_bps: float, prefetch: int, k: int
) -> Prediction:
    setup = Setup(write_bps=write_bps, read_bps=read_bps, prefetch_bytes=prefetch)
    engine = Engine(setup, memory=False)  # the decision needs times only
    got = engine.step(spans, kept_from, k)
    return Prediction(k, got.step_seconds, got.stall_seconds, got.kept_bytes, engine.staged_entries)


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
        spans = _spans(groups)
        preds = [_predict(spans, kept_from(k), w, r, self.prefetch, k) for k in range(max_k + 1)]
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


class DepthController:
    """Chooses the read-ahead window within the TBA_PREFETCH_BYTES cap (NOTE [Prefetch depth]
    in tba/simulator/rules.py, whose read_ahead the planner's simulation uses too)."""

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


# A stand-in for the memory budget of TBA_POLICY=auto until TBA_MEMORY_BUDGET lands: this share
# of the step's saved bytes (the target the issue sets for the defaults). The one call site is
# Offloader._memory_budget.
DEFAULT_BUDGET_SHARE = 0.35


class PolicyController:
    """Per-block actions for TBA_POLICY and TBA_BLOCK_POLICY (NOTE [Block policy] in
    tba/recompute.py); chooses them for ``auto`` (NOTE [Chooser] in tba/chooser.py), deciding
    as adaptive keep does: after step 1, every ``every`` steps, at once on a bandwidth drift of
    more than 25% or a step that stalled more than 1%. Until it has decided, ``auto`` is
    ``offload`` (the last TBA_KEEP_LAST blocks kept)."""

    def __init__(self, policy: str, forced: Any, every: int = 20):
        self.policy = policy
        self.forced: dict[int, str] = dict(forced or ())
        self.chosen: dict[int, str] = {}
        self.every = every
        self.decided_at = 0
        self.basis: tuple[float, float] | None = None
        self.bandwidth: tuple[float | None, float | None] = (None, None)
        self.block_bytes: dict[int, tuple[int, int]] = {}  # block -> (saved, input) measured
        self.decision: dict[str, Any] = {
            "policy": policy,
            "reason": "first step: nothing measured yet" if policy == "auto" else "TBA_POLICY",
        }

    def default_action(self) -> str | None:
        """The action of blocks nothing names; None: the keep-last rule."""
        return self.policy if self.policy in ("keep", "recompute") else None

    def assignment(self) -> dict[int, str] | None:
        got = dict(self.chosen)
        got.update(self.forced)
        return got or None

    def observe(self, step: int, records, write_bps, read_bps, budget, prefetch: int) -> None:
        """A step whose backward has run. ``budget(saved)`` gives the memory budget in bytes
        for a step that saves ``saved`` bytes (None: unbounded)."""
        w = write_bps or self.bandwidth[0]
        r = read_bps or self.bandwidth[1]
        self.bandwidth = (w, r)
        groups, fixed = self._costs(records)
        if self.policy != "auto" or not any(g.block for g in groups) or not w or not r:
            return  # without a model's blocks (pack-order windows), auto is offload
        base = sum(g.fwd + g.bwd for g in groups)
        stalled = sum(x["stall_seconds"] for x in records)
        drifted = self.basis is None or any(
            abs(now - then) > DRIFT * then for now, then in zip((w, r), self.basis)
        )
        if not (drifted or step - self.decided_at >= self.every or stalled > STALL_SHARE * base):
            return
        limit = budget(sum(g.nbytes for g in groups))
        got = choose(groups, w, r, limit, prefetch, exhaustive_blocks=0, fixed=fixed)
        chosen = {i: a for i, a in enumerate(got.best.actions) if i not in self.forced}
        changed = chosen != self.chosen
        self.chosen, self.decided_at, self.basis = chosen, step, (w, r)
        why = "fastest predicted step within the budget" if got.fits else "none fits: lowest peak"
        self.decision = {
            "policy": "auto",
            "actions": list(got.best.actions),
            "reason": why,
            "step": step,
            "budget_bytes": limit,
            "predicted_step_seconds": got.best.step_seconds,
            "predicted_peak_bytes": got.best.peak_bytes,
            "write_bps": w,
            "read_bps": r,
            "searched": got.searched,
        }
        if changed:
            log.info(
                "tba: policy=auto chose %s after step %d (%s; predicted step %.3f s, peak %d "
                "bytes, budget %s; write %.0f MB/s, read %.0f MB/s)",
                ",".join(got.best.actions),
                step,
                why,
                got.best.step_seconds,
                got.best.peak_bytes,
                limit,
                w / 1e6,
                r / 1e6,
            )

    def _costs(self, records) -> tuple[list[Cost], dict[int, str]]:
        """The chooser's groups from a step's records; blocks checkpointed by the user are
        fixed as recomputed. Bytes of a block come from the last step that measured them."""
        groups, fixed, b = [], {}, 0
        for x in records:
            act = x["action"]
            if not act:
                groups.append(Cost(x["fwd_seconds"], x["bwd_seconds"], _group_bytes(x), 0, False))
                continue
            if act == "user":
                fixed[b] = "recompute"
            saved = _group_bytes(x) + (x["hidden_bytes"] if act == "recompute" else 0)
            if act != "user" and (act != "recompute" or x["hidden_bytes"]):
                self.block_bytes[b] = (saved, x["input_bytes"])
            saved, inputs = self.block_bytes.get(b, (saved, x["input_bytes"]))
            bwd = x["bwd_seconds"] - (x["fwd_seconds"] if act in ("recompute", "user") else 0.0)
            groups.append(Cost(x["fwd_seconds"], max(0.0, bwd), saved, inputs))
            b += 1
        fixed.update(self.forced)
        return groups, fixed


def _group_bytes(x: dict[str, Any]) -> int:
    return x["offloaded_bytes"] + x["kept_bytes"]
