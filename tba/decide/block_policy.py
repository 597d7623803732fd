"""Per-block actions for ``TBA_POLICY`` and ``TBA_BLOCK_POLICY`` (NOTE [Block policy] in
tba/datapath/blocks/recompute.py), chosen for ``auto`` from measured steps (NOTE [Chooser] in
tba/decide/chooser.py) and paced as adaptive keep is (NOTE [Decision cost] in
tba/decide/cadence.py)."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from ..config import BY_BLOCK, RECOMPUTED, SELECTIVE
from .adaptive import PROBE_SHARE
from .budget import MIN_WINDOW, widest_window, window_room
from .cadence import DRIFT, STALL_SHARE, Cadence, stalled_seconds
from .chooser import BARE, SEARCH_SIMS, WRITES, Cost, choose, predict

__all__ = ["DEFAULT_BUDGET_SHARE", "PolicyController"]

log = logging.getLogger("tba")

# NOTE [Recompute cost]
# A recomputed block costs backward its forward once more, but not the forward as timed in the first
# pass: that one records the graph, touches fresh memory, and in an offload step also packs and
# queues writes, so a recompute takes clearly less. Charged the first pass's forward, every
# assignment that recomputes would be predicted slower than it runs. So the recompute wrapper times
# backward's run of the forward (``recompute_seconds`` of a group record) and the chooser charges a
# block the seconds its last recompute took; a block not yet recomputed, its forward times the ratio
# of recompute to forward of the blocks that have been (its plain forward when none has). The first
# time a block's recompute is measured the controller decides again (paced as any decision), so the
# first decision's guess is corrected at the next step rather than ``every`` steps later (the
# schedule).

# NOTE [Compute per action]
# A block computes at different speeds by action: offloading, it packs, copies and queues writes in
# forward and waits on unpacks in backward, so on a CPU with few cores both its forward and its
# backward take longer than when it is kept or recomputed. Charged the times of the step it last ran
# (all offloaded on step 1), every other assignment would be predicted that much slower. So the
# controller keeps, per block, the forward and backward seconds of the last step that ran it with
# each action (``Cost.times``), and the chooser charges a block the times of the action it is given;
# an action not yet measured borrows a stand-in's (``STAND_INS`` in tba/decide/chooser.py: a kept
# block computes as a recomputed one does in its first pass), else the times of the step just run. A
# stored time never counts for more than the step just run measured: one taken on a cold first step
# cannot make an action look dearer than it now is, which would keep auto from ever running it, and
# measuring it, again.

# NOTE [Hook time]
# Per-action times cannot see what offloading costs while every block offloads: with nothing kept or
# recomputed yet, a kept block borrows the offload step's times, so on a disk that hides every write
# all-offload and keeping the last block are predicted the same step, the tie goes to the lower
# peak, and auto chooses all-offload although the kept block would have run faster. What a kept
# block does not pay is tba's work on the training thread: the pack hook (index, staging, queuing
# the write) and the unpack hook (waiting for the lock, views, the version check). The hooks time
# themselves into the group's GroupStat (``pack_seconds``, ``unpack_seconds`` of a record, stalls
# excluded: those the simulator predicts from bandwidth; they time themselves only where this is
# read, under TBA_POLICY=auto, TBA_BLOCK_POLICY or a trace, and record 0 elsewhere), and an offload
# step stores, besides its own times, the block's times less those (``BARE`` in
# tba/decide/chooser.py), which stand in for an action not measured yet (STAND_INS). The hooks'
# share of a block's time is largest where the block's compute is short and the CPU has few cores.
# The I/O threads' CPU, which also slows compute on a machine with few cores, is not on the training
# thread and is not counted.

# NOTE [Selective recompute cost]
# selective (NOTE [Selective recompute] in tba/datapath/blocks/selective.py) keeps a block's matrix
# products and recomputes the rest. Until a block has run so, its cost is a prior: what the pack
# hook saw of the outputs selective would keep (``cacheable_bytes``) is what it is charged to hold,
# and its recompute is the block's full recompute scaled by the share of the block's saved bytes it
# does not keep. The prior overstates the recompute where the kept products are the dear part of the
# block, as they are in a transformer block, which errs towards not choosing selective; once a block
# has run selective, its measured recompute and kept bytes replace the prior, and the first such
# measurement makes the controller decide again (as NOTE [Recompute cost]).

# NOTE [Budget margin]
# The simulator's predicted peaks err by a little on both sides (BENCHMARKS.md, "Planner
# validation"), and the chooser takes the fastest assignment whose predicted peak fits: often one
# that just fits, which then measures just over. So the chooser aims under MARGIN of the budget,
# which leaves room for that usual error, and when a step that ran auto's choice measures over the
# budget all the same, the excess is taken off the target for good and the controller decides again
# at once, paced or not (NOTE [Decision cost]). Were it to wait for its cadence, one over-budget
# choice would run for several steps, and charging each of them would drive the target far down,
# even below zero, for a single misprediction. Deciding at once makes every overrun that of a choice
# made knowing all the overruns before it, so each one is charged.
MARGIN = 0.98

# NOTE [Nothing fits]
# When no assignment is predicted to fit the budget, the chooser takes the one of lowest peak, and
# its steps measure over the budget as predicted. Such an overrun is not charged to the target
# (NOTE [Budget margin]): charging it every step would drive the target down without end, and the
# window's room (NOTE [Window under auto]) with it. Nor does it make the controller decide at once:
# the decision would replay the same search on the same measurements every step, which on W1 at
# batch 37 under a 149 MiB budget took 0.22 s of a 13 s step (1.7%), and on a GPU's step of tens of
# milliseconds could cost more than the step. It decides again on its cadence (NOTE [Decision
# cost]), on a drift, or when a block's cost is learned, as for any choice; one that then fits is
# taken, and from there an overrun counts again.

# NOTE [Staging in the replays]
# Under TBA_MEMORY_BUDGET the run holds the bytes in flight to the budget (NOTE [Staging within the
# budget] in tba/datapath/capture/staging.py): a pack over it waits for writes, and one larger than
# it goes alone. So every replay of the controller (the choice, the keep-all reference, the window's
# room) applies the same limit (``Setup.staging_limit``). Replayed with the arena's size alone
# (TBA_STAGING_BYTES, 256 MiB), the forward's writes could pile up to it: on W1 at batch 8 under
# 40 MiB, all-offload was predicted to peak at 64 MiB, the window's room was sized from that, and
# the run went over the budget (41 to 53 MiB); at batch 37 under 149 MiB the prediction was 563 MB.
# The forward's waits the limit causes are in the predicted step too.

# NOTE [Unmeasured margin]
# MARGIN covers the simulator's usual peak error, but not the worst of it: assignments that offload
# much are predicted the furthest low (BENCHMARKS.md, "Planner validation"). An assignment auto has
# run has had its peak measured (and an overrun charged, NOTE [Budget margin]); one it has not is a
# prediction only. So an assignment not yet measured aims under UNMEASURED_MARGIN of the budget,
# which keeps the worst error the validation found within the budget, and one that has run under
# MARGIN.
# Once run, an assignment is measured for the rest of the run, whatever window or rates it ran at.
# This also favours the assignment in force over an unmeasured one predicted a little faster and a
# little higher: without it, auto deciding again after a drift can trade an assignment that has held
# the budget for many steps for one never run, which then goes over. The search replays every
# measured assignment at each decision (so that the one in force is always a candidate); the
# controller remembers the MEASURED_KEPT it ran last, so that a week-long run's decisions stay as
# cheap as its first (one forgotten is unmeasured again: held to the lower margin).
UNMEASURED_MARGIN = 0.96
MEASURED_KEPT = 32

# NOTE [Write spread]
# The controller decides again when a bandwidth moves by more than DRIFT (25%) from the one it
# decided with, so until then its assignment must hold the budget at any write rate in that band.
# The peak of an assignment that offloads depends on the write rate: an offloaded block's writes
# still in flight at the end of the forward are resident there, and a disk's rate varies from step
# to step, so an assignment predicted just under the budget at the measured rate goes over it at a
# somewhat lower one, while assignments whose writes finish in time do not move. So the chooser and
# the window's room take each assignment's peak as the larger of those at the measured write rate
# and at (1 - DRIFT) of it; its step time stays the one at the measured rate. ``tba plan`` predicts
# at the rates it is given.

# NOTE [Window under auto]
# The read-ahead window is sized by DepthController after every step (raised after a stall, up to
# its cap), while auto decides only when due (NOTE [Decision cost]); the chooser predicts its
# assignment's peak at the window in use when it decides. A window raised later is part of the peak
# too: an assignment chosen just under the budget at one window goes over it once a stall widens the
# window, and stays over until the overrun makes auto decide again. Adaptive keep's own room
# (NOTE [Memory budget]) does not cover this: it predicts the keep-last rule, not auto's assignment,
# and applies only to TBA_MEMORY_BUDGET, where auto also bounds itself by DEFAULT_BUDGET_SHARE. So
# after each step auto predicts its assignment in force at the new window; when the peak would pass
# the chooser's target, the window is cut to the room the target leaves (window_room, with the
# smallest window one largest read), or, when even the smallest window's peak is over the target, to
# the widest window that adds nothing to that peak (NOTE [Window past the budget] in
# tba/decide/budget.py). A window no wider than the one auto decided at needs no prediction (two
# replays of the simulator, Python on the training thread; up to five more past the budget). Once
# auto has chosen, this room replaces adaptive keep's under TBA_MEMORY_BUDGET: adaptive keep's
# simulator predicts neither auto's assignment nor a bounded staging, so where the writes in flight
# at the end of the forward set the peak, it takes each step over the budget for a window too wide,
# cuts the window step by step, and brings back the stalls a wider window had removed.

# NOTE [Slowdown under auto]
# Without TBA_MEMORY_BUDGET, what bounds auto is time (TBA_MAX_SLOWDOWN, as NOTE [Slowdown bound]
# in tba/decide/adaptive.py has it for adaptive keep): among the assignments predicted within
# that factor of keeping every block (the keep-all assignment replayed on the same figures, its
# blocks at their kept or stand-in times), the chooser takes the one with the lowest predicted
# peak, every action offered; when none is, the fastest. A step that ran the choice and measured
# over the bound (its compute and stalls against that keep-all prediction) marks the assignment
# too slow, multiplies the bandwidths the chooser plans with by DERATE, and decides again at
# once: the I/O the model underrated is charged more at each overrun, so auto moves back towards
# keeping more within a few steps (marking assignments alone would try the neighbours of each
# one in turn). Both are undone when a bandwidth moves by more than DRIFT or a probe measures
# again. An assignment that writes nothing measures no bandwidth, so it is probed as adaptive
# keep's keep-all is (NOTE [No absorbing state]): one step with its first free block offloaded,
# paced to PROBE_SHARE of the compute by what the last probe cost, then a decision on what it
# measured.

DERATE = 0.25

# The memory budget of TBA_POLICY=auto when TBA_MEMORY_BUDGET is not set and no slowdown bound
# is given (PolicyController's max_slowdown None; the offloader gives TBA_MAX_SLOWDOWN): this
# share of the step's saved bytes (about a third of what stock PyTorch holds, the target set for the
# defaults). Read by Offloader._memory_budget and by tba plan's mix (tba/plan/mix.py).
DEFAULT_BUDGET_SHARE = 0.35


class PolicyController:
    """Per-block actions for TBA_POLICY and TBA_BLOCK_POLICY (NOTE [Block policy] in
    tba/datapath/blocks/recompute.py); chooses them for ``auto`` (NOTE [Chooser] in
    tba/decide/chooser.py), deciding as adaptive keep does: after step 1, every ``every`` steps, at
    once on a bandwidth drift of more than 25% or a step that stalled more than 1%. Until it has
    decided, ``auto`` is ``offload`` (the last TBA_KEEP_LAST blocks kept; with adaptive keep, none
    on step 1: FIRST_K in tba/decide/adaptive.py)."""

    def __init__(
        self,
        policy: str,
        forced: Any,
        every: int = 20,
        cadence: Cadence | None = None,
        staging: tuple[int | None, bool] = (None, False),
        max_slowdown: float | None = None,
        staging_within_budget: bool = False,
    ):
        self.cadence = cadence or Cadence()
        self.staging = staging  # TBA_STAGING_BYTES, and whether a full staging waits
        # the run holds the bytes in flight to the budget (TBA_MEMORY_BUDGET with a staging that
        # waits): every replay does too (NOTE [Staging in the replays])
        self.staging_within_budget = staging_within_budget
        # NOTE [Slowdown under auto]: the bound without a budget (None: DEFAULT_BUDGET_SHARE's
        # budget instead), the assignments measured over it, the keep-all step it is
        # measured against, and the probe of a choice that writes nothing
        self.max_slowdown = max_slowdown
        self.too_slow: set[tuple[str, ...]] = set()
        self.derate = 1.0  # the share of the measured bandwidths the chooser plans with
        self.reference: float | None = None
        self.probe: dict[int, str] = {}
        self.probe_owed = 0.0
        # the host tier's capacity and copy rate (NOTE [Host tier]); (0, inf): none
        self.host_tier: tuple[int, float] = (0, math.inf)
        self.policy = policy
        self.forced: dict[int, str] = dict(forced or ())
        self.chosen: dict[int, str] = {}
        self.every = every
        self.decided_at = 0
        self.basis: tuple[float, float] | None = None
        self.bandwidth: tuple[float | None, float | None] = (None, None)
        self.block_bytes: dict[int, tuple[int, int]] = {}  # block -> (saved, input) measured
        self.block_sizes: dict[int, tuple[int, ...]] = {}  # NOTE [Measured layout]
        # block -> (recompute, forward) seconds of the last step that recomputed it
        self.block_recompute: dict[int, tuple[float, float]] = {}
        # the same for selective's recompute, and what selective kept (measured) or would keep
        # (the block's cacheable_bytes): NOTE [Selective recompute] in
        # tba/datapath/blocks/selective.py
        self.block_selective: dict[int, tuple[float, float]] = {}
        self.block_cached: dict[int, int] = {}
        self.block_cacheable: dict[int, int] = {}
        # block -> action -> (fwd, bwd) of the last step that ran it so (NOTE [Compute per action])
        self.block_times: dict[int, dict[str, tuple[float, float]]] = {}
        self.learned = False  # a block's recompute was measured for the first time
        self.excess = 0  # bytes measured steps of its choices went over the budget, summed
        # its choices that a step ran (per block), the last run last: NOTE [Unmeasured margin]
        self.measured: dict[tuple[str, ...], None] = {}
        self.room: int | None = None  # NOTE [Window under auto]
        # the window the next step runs with (NOTE [No growth past the budget] in budget.py)
        self.window: int | None = None
        self.fits = True  # the last decision's assignment fits the target (NOTE [Chooser])
        self.decision: dict[str, Any] = {
            "policy": policy,
            "reason": "first step: nothing measured yet" if policy == "auto" else "TBA_POLICY",
        }

    def default_action(self) -> str | None:
        """The action of blocks nothing names; None: the keep-last rule."""
        return self.policy if self.policy in ("keep", "recompute", SELECTIVE) else None

    def assignment(self) -> dict[int, str] | None:
        got = dict(self.chosen)
        got.update(self.probe)
        got.update(self.forced)
        return got or None

    def blocks_lost(self, step: int) -> None:
        """The model's blocks ran inside a torch.compile region (NOTE [Compiled regions] in
        tba/datapath/blocks/groups.py): no block action applies, and the decision says so."""
        if self.policy in BY_BLOCK:
            self.decision = {
                "policy": self.policy,
                "actions": [],
                "reason": "the model's blocks ran inside a torch.compile region: nothing "
                "recomputed, offloaded by pack-order windows",
                "step": step,
            }

    def observe(
        self,
        step: int,
        records,
        write_bps,
        read_bps,
        budget,
        prefetch: int,
        peak: int = 0,
        largest_read: int = 0,
    ) -> None:
        """A step whose backward has run, and its measured peak (``peak_with_recompute_bytes``).
        ``budget(saved)`` gives the memory budget in bytes for a step that saves ``saved``
        bytes (None: unbounded). ``prefetch`` is the read-ahead window the next step would run
        with, ``largest_read`` the step's largest read (the smallest window there is); after
        this, :attr:`room` is the widest window auto's assignment leaves within the budget
        (NOTE [Window under auto]), None for no limit."""
        self.room = None
        w = write_bps or self.bandwidth[0]
        r = read_bps or self.bandwidth[1]
        self.bandwidth = (w, r)
        if self.policy != "auto":
            return  # a fixed policy: nothing to choose, so nothing to measure per block
        groups, fixed = self._costs(records)
        if not any(g.block for g in groups) or not w or not r:
            return  # without a model's blocks (pack-order windows), auto is offload
        limit = budget(sum(g.nbytes for g in groups))
        ran = [x["action"] for x in records if x["action"]]
        ran_choice = bool(self.chosen) and ran == [
            self.assignment().get(i, a) for i, a in enumerate(ran)
        ]
        if ran_choice:  # NOTE [Unmeasured margin]: the last MEASURED_KEPT run
            self.measured.pop(tuple(ran), None)
            self.measured[tuple(ran)] = None
            while len(self.measured) > MEASURED_KEPT:
                del self.measured[next(iter(self.measured))]
        # NOTE [Budget margin]; NOTE [Nothing fits]: a choice made knowing that none fits
        # going over is no misprediction
        over = limit is not None and peak > limit and ran_choice and self.fits
        if over:  # charged, and decided again below at once
            self.excess += peak - limit
        base = sum(g.fwd + g.bwd for g in groups)
        stalled = stalled_seconds(records)
        drifted = self.basis is None or any(
            abs(now - then) > DRIFT * then for now, then in zip((w, r), self.basis)
        )
        ready = self.cadence.ready(base)
        due = step - self.decided_at >= self.every or stalled > STALL_SHARE * base
        # NOTE [Slowdown under auto]: a measured overrun goes back at once; a probe measures
        slowdown = self.max_slowdown if limit is None else None
        bounded = slowdown is not None
        took = sum(x["fwd_seconds"] + x["bwd_seconds"] for x in records) + stalled
        probed, self.probe = bool(self.probe), {}
        if drifted or probed:
            self.too_slow.clear()
            self.derate = 1.0
        if probed and self.reference is not None:
            self.probe_owed = max(0.0, took - self.reference) / PROBE_SHARE
        late = (
            slowdown is not None
            and ran_choice
            and not probed
            and self.reference is not None
            and took > slowdown * self.reference
        )
        if late:
            self.too_slow.add(tuple(ran))
            self.derate *= DERATE
        writes = any(a in WRITES for a in (self.assignment() or {}).values())
        if bounded and self.chosen and not writes and not (drifted or late):
            self.probe_owed = max(0.0, self.probe_owed - base)
            if step - self.decided_at >= self.every and self.probe_owed == 0.0:
                free = [i for i in range(len(ran)) if i not in self.forced]
                if free:  # one step that writes: the disk measured again
                    self.probe = {free[0]: "offload"}
                    self.decided_at = step
                    return
            due = self.learned = False  # nothing new measured: the choice stands
        urgent = over or late or probed
        if (drifted or due or self.learned or urgent) and (ready or urgent):
            # NOTE [Decision cost]: an overrun does not wait for the cadence
            self._decide(step, groups, fixed, w, r, limit, prefetch)
        self.room = self._window_room(groups, limit, prefetch, largest_read, w, r)
        self.window = prefetch if self.room is None else min(prefetch, self.room)

    def _limit(self, limit: int | None) -> int | None:
        """The staging limit the run applies under ``limit`` (NOTE [Staging in the replays])."""
        return limit if self.staging_within_budget else None

    def _target(self, limit: int | None, measured: bool = True) -> int | None:
        """What an assignment must fit (NOTE [Budget margin], NOTE [Unmeasured margin]): one
        auto has run under MARGIN of ``limit``, one it has not under UNMEASURED_MARGIN."""
        if limit is None:
            return None
        return int((MARGIN if measured else UNMEASURED_MARGIN) * limit) - self.excess

    def _decide(self, step, groups, fixed, w, r, limit, prefetch) -> None:
        t0 = self.cadence.start()
        target = self._target(limit)
        max_step = None
        if limit is None and self.max_slowdown is not None:  # NOTE [Slowdown under auto]
            n = sum(g.block for g in groups)
            keep = [fixed.get(i, "keep") for i in range(n)]
            self.reference = predict(
                groups, keep, w, r, prefetch, *self.staging, staging_limit=self._limit(limit)
            ).step_seconds
            max_step = self.max_slowdown * self.reference
        got = choose(
            groups,
            w * self.derate,  # NOTE [Slowdown under auto]: 1 but after measured overruns
            r * self.derate,
            target,
            prefetch,
            exhaustive_blocks=0,
            fixed=fixed,
            max_sims=SEARCH_SIMS,
            staging_bytes=self.staging[0],
            staging_waits=self.staging[1],
            write_spread=DRIFT,  # NOTE [Write spread]
            unmeasured_budget=self._target(limit, measured=False),
            measured=self.measured,
            max_step_seconds=max_step,
            too_slow=self.too_slow,
            host_bytes=self.host_tier[0],
            host_bps=self.host_tier[1],
            staging_limit=self._limit(limit),
        )
        spent = self.cadence.spent(t0)
        self.learned = False
        self.fits = got.fits
        known = tuple(got.best.actions) in self.measured
        chosen = {i: a for i, a in enumerate(got.best.actions) if i not in self.forced}
        changed = chosen != self.chosen
        self.chosen, self.decided_at, self.basis = chosen, step, (w, r)
        why = "fastest predicted step within the budget" if got.fits else "none fits: lowest peak"
        if max_step is not None:
            why = (
                f"lowest predicted peak within TBA_MAX_SLOWDOWN={self.max_slowdown:g}"
                if got.fits
                else f"none within TBA_MAX_SLOWDOWN={self.max_slowdown:g}: the fastest"
            )
        self.decision = {
            "policy": "auto",
            "actions": list(got.best.actions),
            "reason": why,
            "step": step,
            "budget_bytes": limit,
            # what the choice had to fit (NOTE [Budget margin], NOTE [Unmeasured margin])
            "target_bytes": self._target(limit, known),
            "measured": known,  # the choice has run before
            "predicted_step_seconds": got.best.step_seconds,
            "predicted_peak_bytes": got.best.peak_bytes,
            "write_bps": w,
            "read_bps": r,
            "searched": got.searched,
            "decision_seconds": spent,
            "window_bytes": prefetch,  # the read-ahead window it predicted with
        }
        if max_step is not None:
            self.decision.update(
                predicted_keep_all_seconds=self.reference, predicted_bound_seconds=max_step
            )
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

    def _window_room(self, groups, limit, prefetch, smallest, w, r) -> int | None:
        """The widest read-ahead window within ``prefetch`` whose predicted peak, with the
        assignment in force, stays within the chooser's target (NOTE [Window under auto]);
        None when ``prefetch`` itself fits or nothing is chosen."""
        actions = self.decision.get("actions")
        if limit is None or not self.chosen or len(actions or ()) != sum(g.block for g in groups):
            return None
        if prefetch <= self.decision.get("window_bytes", 0) and self.fits:
            return None  # chosen at this window or a wider one: it fits there
        asg = self.assignment() or {}
        actions = [asg.get(i, a) for i, a in enumerate(actions)]
        target = self._target(limit, tuple(actions) in self.measured)
        seen: dict[int, Any] = {}

        def at(win: int):  # the assignment's prediction at a window, each replayed once
            if win not in seen:
                seen[win] = predict(
                    groups,
                    actions,
                    w,
                    r,
                    win,
                    *self.staging,
                    DRIFT,
                    *self.host_tier,
                    staging_limit=self._limit(limit),
                )
            return seen[win]

        wide = at(prefetch)
        if wide.peak_bytes <= target:
            return None
        smallest = max(smallest, MIN_WINDOW)
        narrow = at(smallest)
        if narrow.peak_bytes <= target:
            return min(prefetch, window_room(target, narrow.peak_bytes, smallest))
        # NOTE [Window past the budget] in tba/decide/budget.py: the target is out of reach anyway
        room, _ = widest_window(narrow.peak_bytes, smallest, prefetch, narrow, at)
        if self.window is not None:  # NOTE [No growth past the budget] in tba/decide/budget.py
            room = min(room, max(smallest, self.window))
        return None if room >= prefetch else room

    def _costs(self, records) -> tuple[list[Cost], dict[int, str]]:
        """The chooser's groups from a step's records; blocks checkpointed by the user are
        fixed as recomputed. Bytes of a block come from the last step that measured them, its
        recompute seconds as NOTE [Recompute cost] says."""
        groups, fixed, b = [], {}, 0
        blocks = []
        for x in records:
            act = x["action"]
            sizes = tuple(
                x.get("sizes", ())
            )  # NOTE [Measured layout] in tba/decide/simulator/rules.py
            if not act:
                groups.append(
                    Cost(x["fwd_seconds"], x["bwd_seconds"], _group_bytes(x), 0, False, sizes=sizes)
                )
                continue
            if act == "user":
                fixed[b] = "recompute"
            rec = act in RECOMPUTED
            saved = _group_bytes(x) + (x["hidden_bytes"] if rec else 0)
            if act != "user" and (not rec or x["hidden_bytes"]):
                self.block_bytes[b] = (saved, x["input_bytes"])
            if act in ("keep", "offload") and sizes:  # its forward packed every saved tensor
                self.block_sizes[b] = sizes
            saved, inputs = self.block_bytes.get(b, (saved, x["input_bytes"]))
            again = x.get("recompute_seconds", 0.0) if rec else 0.0
            timed = self.block_selective if act == SELECTIVE else self.block_recompute
            if again > 0:
                self.learned |= b not in timed
                timed[b] = (again, x["fwd_seconds"])
            if act == SELECTIVE and x.get("hidden_bytes"):  # NOTE [Selective recompute]
                self.block_cached[b] = x.get("cached_bytes", 0)
            elif "cacheable_bytes" in x and b not in self.block_cached:
                self.block_cacheable[b] = x["cacheable_bytes"]
            # backward's time includes the recompute: the block's own part is the rest
            first = x["fwd_seconds"] if rec or act == "user" else 0.0
            bwd = x["bwd_seconds"] - (again or first)
            blocks.append((len(groups), b))
            if act != "user":
                mine = self.block_times.setdefault(b, {})
                mine[act] = (x["fwd_seconds"], max(0.0, bwd))
                if act == "offload":  # NOTE [Hook time]
                    mine[BARE] = (
                        max(0.0, x["fwd_seconds"] - x.get("pack_seconds", 0.0)),
                        max(0.0, bwd - x.get("unpack_seconds", 0.0)),
                    )
            times = tuple((k, f, w) for k, (f, w) in sorted(self.block_times.get(b, {}).items()))
            groups.append(
                Cost(
                    x["fwd_seconds"],
                    max(0.0, bwd),
                    saved,
                    inputs,
                    times=times,
                    sizes=self.block_sizes.get(b, ()),
                )
            )
            b += 1
        full, part = _ratio(self.block_recompute), _ratio(self.block_selective)
        for gi, bi in blocks:
            g = groups[gi]
            got = self.block_recompute.get(bi)
            again = got[0] if got else (full * g.fwd if full is not None else None)
            cached = self.block_cached.get(bi, self.block_cacheable.get(bi))
            got = self.block_selective.get(bi)
            if got is not None:
                sel = got[0]
            elif part is not None:
                sel = part * g.fwd
            elif cached is not None:  # NOTE [Selective recompute cost]: a prior until measured
                whole = g.fwd if again is None else again
                sel = whole * max(0.0, 1.0 - cached / max(1, g.nbytes - g.input_bytes))
            else:
                sel = None
            groups[gi] = dataclasses.replace(
                g, recompute=again, cached_bytes=cached, selective_recompute=sel
            )
        fixed.update(self.forced)
        return groups, fixed


def _ratio(timed: dict[int, tuple[float, float]]) -> float | None:
    """Seconds of recompute per second of first forward over the blocks measured (None: none)."""
    if not timed:
        return None
    return sum(r for r, _ in timed.values()) / max(1e-12, sum(f for _, f in timed.values()))


def _group_bytes(x: dict[str, Any]) -> int:
    """What a group saves, each storage once: kept views of one storage (a q/k/v split kept
    because staging was full) count once, as they do when the storage is captured whole.
    (Offloaded plus kept bytes would count each such view on its own, more than the group
    saves, and every prediction of the chooser's peak would run high.)"""
    if "saved_bytes" in x:
        return x["saved_bytes"]
    return x["offloaded_bytes"] + x["kept_bytes"]  # a trace written before the field
