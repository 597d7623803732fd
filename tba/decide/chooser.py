"""Keep, offload or recompute per block: the chooser of ``TBA_POLICY=auto``. No torch, no I/O.

# NOTE [Chooser]
Input, per group of a step in forward order (``Cost``): forward and backward compute seconds,
the bytes the group saves, the bytes of its inputs (what recompute keeps), and whether it is a
block; plus the write and read bandwidth and a memory budget in bytes. Each block gets keep,
offload, recompute, recompute_offload (recomputed, its inputs offloaded rather than kept:
DELTA's swap of the checkpoints; NOTE [Block policy] in tba/datapath/blocks/recompute.py) or
selective (recomputed but for its matrix products, which stay resident: ``Cost.cached_bytes``,
offered only where known; NOTE [Selective recompute] in tba/datapath/blocks/selective.py); a group
between or after blocks follows the block before it when that one is kept, else it is offloaded (the
group before the first block is offloaded). An assignment is replayed by the simulator tba plan and
adaptive keep use (NOTE [Simulator] in tba/decide/simulator/engine.py, its plain runtime case plus
its Recompute rule, and staging bounded by TBA_STAGING_BYTES as the run bounds it: a full
staging keeps a tensor resident, or with TBA_STAGING_FULL=wait, as ``auto`` runs, stalls the
forward until writes free it; under TBA_MEMORY_BUDGET also held to the budget, NOTE [Staging
in the replays] in tba/decide/block_policy.py), which predicts the step time and the peak of
resident saved bytes (kept, staging, read-back, a recomputed block's tensors during its
backward). Unbounded
staging would make offloads that outrun the disk look free under a budget, where the run's forward
waits for them (tests/decide/test_chooser.py, test_staging_is_bounded_as_the_run_bounds_it, pins
this). Each block's saves are simulated as the sizes a step measured (NOTE [Measured layout] in
tba/decide/simulator/rules.py). Swapping costs what its I/O does not hide behind compute (about
max(0, bytes / bandwidth - compute window)), and a recompute costs the block's forward once more
(``Cost.recompute``: measured when the block has been recomputed, else estimated from blocks that
have; NOTE [Recompute cost] in tba/decide/block_policy.py); keeping costs memory only.

The choice: among the assignments whose predicted peak is within the budget, the shortest
predicted step, ties going to the lower peak; when none fits, the lowest peak (and the caller
says so). Without a budget (None) nothing bounds memory, and keeping everything wins. With at
most ``exhaustive_blocks`` blocks (default 6) every assignment is simulated (5^6 = 15,625 for
6 blocks); beyond that (and at run time, where ``exhaustive_blocks=0``: a decision must be cheap) a
local search. It first builds a greedy start (``_fill``): from every block recomputed, it
replays each single change, ranks those that shorten the step by seconds saved per byte of
peak added, and takes them in that order while the budget holds, one per block. Then it replays
the uniform assignments (every block recomputed, offloaded, kept) and the keep-last ones (the
last k blocks kept, the rest all given one of the other actions, for up to
``KEEP_LAST_STARTS`` values of k spread over 1..n-1) and the same with the last k blocks
selective, and the assignments the run has measured (``measured``: among them the one in
force; an unmeasured one must fit ``unmeasured_budget``, NOTE [Unmeasured margin] in
tba/decide/block_policy.py), and, from the greedy start and the best ``DESCENTS`` of the others,
changes one block at a time while that improves the objective. The greedy start is needed
because the other starts can lie where no sequence of single changes leads to the fastest
assignments that fit: on the 7B of BENCHMARKS.md ("Projections") the search ends well short of
them without it (tests/plan/test_plan_mix.py, test_the_greedy_start_fills_the_budget_on_the_7b,
pins this). It stops after ``max_sims`` replays (``SEARCH_SIMS`` at run time; the uniform starts
are always replayed) and answers the best assignment it replayed. Each replay is Python on the
training thread, so the search is kept small: a descent from every start, with no bound, grows
with the cube of the depth, while this one descends from a few starts and stops at ``max_sims``.
Blocks in ``fixed`` (forced by TBA_BLOCK_POLICY, or checkpointed by the user) do not change.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Collection, Sequence

from ..config import BLOCK_ACTIONS, SELECTIVE
from .simulator import Engine, Setup, Span, measured_pieces

ACTIONS = BLOCK_ACTIONS  # keep, offload, recompute, recompute_offload, selective
WRITES = ("offload", "recompute_offload")  # the actions whose bytes go to disk
EXHAUSTIVE_BLOCKS = 6  # the default of choose(exhaustive_blocks=...)
SEARCH_SIMS = 300  # replays a run-time decision may take (NOTE [Chooser])
KEEP_LAST_STARTS = 32  # values of k of the keep-last assignments the local search replays first
DESCENTS = 3  # of those and the uniform ones, how many the search descends from


# The pseudo-action of ``Cost.times`` that holds an offload step's times less what tba's hooks
# took in them (NOTE [Hook time] in tba/decide/block_policy.py): a block's compute without tba's
# work.
BARE = "bare"

# whose measured times stand for an action's when it has none of its own, in order: a kept
# block computes as a recomputed one does in its first pass (no packing, no writes), the two
# recompute actions compute alike, and any of them as an offloaded block does less its hooks
STAND_INS = {
    "keep": ("keep", "recompute", "recompute_offload", SELECTIVE, BARE),
    "recompute": ("recompute", "recompute_offload", SELECTIVE, BARE),
    "recompute_offload": ("recompute_offload", "recompute", SELECTIVE, BARE),
    SELECTIVE: (SELECTIVE, "recompute", "recompute_offload", BARE),
}


@dataclasses.dataclass(frozen=True)
class Cost:
    """One group of a measured (or planned) step."""

    fwd: float  # seconds of forward compute
    bwd: float  # seconds of backward compute, without any recompute
    nbytes: int  # bytes it saves (offloadable)
    input_bytes: int = 0  # a block's inputs: what stays resident when it is recomputed
    block: bool = True
    # seconds backward's recompute of the block takes (None: ``fwd``). Measured, it is less
    # than the first forward, which touches fresh memory and records the graph (NOTE
    # [Recompute cost] in tba/decide/block_policy.py).
    recompute: float | None = None
    # (action, fwd, bwd) as measured the last time the block ran with that action (bwd without
    # a recompute), and (BARE, fwd, bwd) its last offload step's less tba's hooks; predict()
    # charges a block the times of the action it is given, where measured (NOTE [Compute per
    # action] in tba/decide/block_policy.py), else a stand-in's (STAND_INS), else fwd and bwd
    times: tuple[tuple[str, float, float], ...] = ()
    # what ``selective`` keeps of the block besides its inputs (NOTE [Selective recompute] in
    # tba/datapath/blocks/selective.py): measured when it ran so, else estimated; None: unknown, and
    # the chooser does not offer selective for the block
    cached_bytes: int | None = None
    selective_recompute: float | None = None  # its recompute's seconds (None: ``recompute``'s)
    # its saved storages' bytes in pack order, as a step that packed them measured (NOTE
    # [Measured layout] in tba/decide/simulator/rules.py); empty: unknown, simulated as pieces
    sizes: tuple[int, ...] = ()

    def compute(self, action: str) -> tuple[float, float]:
        """Forward and backward seconds of this group run with ``action``: its measured (or a
        stand-in's) times, never more than ``fwd`` and ``bwd``, the step just run."""
        got = {a: (f, b) for a, f, b in self.times}
        for a in STAND_INS.get(action, (action,)):
            if a in got:
                f, b = got[a]
                return min(f, self.fwd), min(b, self.bwd)
        return self.fwd, self.bwd

    def again(self, action: str) -> float | None:
        """Seconds backward's recompute of the block takes under ``action`` (None: ``fwd``)."""
        if action == SELECTIVE and self.selective_recompute is not None:
            return self.selective_recompute
        return self.recompute

    def span(self, action: str) -> Span:
        """The simulator's view of this group run with ``action``."""
        cached = (self.cached_bytes or 0) if action == SELECTIVE else 0
        return Span(
            *self.compute(action),
            measured_pieces(self.nbytes, self.sizes),
            self.input_bytes,
            self.again(action),
            cached,
        )


@dataclasses.dataclass(frozen=True)
class Prediction:
    actions: tuple[str, ...]  # one per block
    step_seconds: float
    peak_bytes: int


@dataclasses.dataclass(frozen=True)
class Choice:
    best: Prediction
    fits: bool  # its peak is within the budget (always True without one)
    searched: int  # assignments simulated
    exhaustive: bool
    budget: int | None


def group_actions(groups: Sequence[Cost], actions: Sequence[str]) -> list[str]:
    """Per-block ``actions`` spread over every group (see NOTE [Chooser])."""
    out, bi, last = [], 0, "offload"
    for g in groups:
        if g.block:
            last = actions[bi]
            bi += 1
            out.append(last)
        else:
            out.append("keep" if last == "keep" else "offload")
    return out


def predict(
    groups: Sequence[Cost],
    actions: Sequence[str],
    write_bps: float,
    read_bps: float,
    prefetch_bytes: int,
    staging_bytes: int | None = None,
    staging_waits: bool = False,
    write_spread: float = 0.0,
    host_bytes: int = 0,
    host_bps: float = math.inf,
    staging_limit: int | None = None,
) -> Prediction:
    """Predicted step time and peak resident bytes of one assignment (NOTE [Chooser]); with
    ``host_bytes`` the host tier of that capacity at ``host_bps`` takes what it holds of the
    offloaded bytes (the Tiers rule of NOTE [Simulator]);
    ``staging_bytes`` and ``staging_waits``: TBA_STAGING_BYTES and TBA_STAGING_FULL=wait, as
    the run has them (None: unbounded staging), and ``staging_limit`` the bytes in flight a
    memory budget allows them (the Staging rule of NOTE [Simulator]; None: no such bound).
    With ``write_spread`` the peak is the larger of
    those at ``write_bps`` and at ``(1 - write_spread) * write_bps`` (NOTE [Write spread] in
    tba/decide/block_policy.py); the step time is the one at ``write_bps``."""
    per_group = group_actions(groups, actions)
    spans = [g.span(a) for g, a in zip(groups, per_group)]

    def run(wbps: float) -> tuple[float, int]:
        setup = Setup(
            write_bps=wbps,
            read_bps=read_bps,
            prefetch_bytes=prefetch_bytes,
            staging_bytes=staging_bytes,
            staging_waits=staging_waits,
            staging_limit=staging_limit,
            host_bytes=host_bytes,
            host_bps=host_bps,
        )
        engine = Engine(setup)
        got = engine.step(spans, len(spans), actions=per_group)
        return got.step_seconds, engine.peaks()[0]

    seconds, peak = run(write_bps)
    if write_spread and any(a in WRITES for a in per_group):
        peak = max(peak, run((1 - write_spread) * write_bps)[1])
    return Prediction(tuple(actions), seconds, peak)


def choose(
    groups: Sequence[Cost],
    write_bps: float,
    read_bps: float,
    budget: int | None,
    prefetch_bytes: int = 128 << 20,
    exhaustive_blocks: int = EXHAUSTIVE_BLOCKS,
    fixed: dict[int, str] | None = None,
    max_sims: int | None = None,
    staging_bytes: int | None = None,
    staging_waits: bool = False,
    write_spread: float = 0.0,
    unmeasured_budget: int | None = None,
    measured: Collection[tuple[str, ...]] = (),
    max_step_seconds: float | None = None,
    too_slow: Collection[tuple[str, ...]] = (),
    host_bytes: int = 0,
    host_bps: float = math.inf,
    staging_limit: int | None = None,
) -> Choice:
    """The assignment of keep/offload/recompute per block that NOTE [Chooser] describes;
    ``fixed`` maps block indices to actions the search does not change; ``max_sims`` bounds the
    local search's replays (None: no bound); staging (``staging_limit`` too) and
    ``write_spread`` as :func:`predict` takes them. With ``unmeasured_budget``, an assignment
    not in ``measured`` must fit that budget rather than ``budget`` (NOTE [Unmeasured margin]
    in tba/decide/block_policy.py).
    Without a budget, ``max_step_seconds`` bounds time instead: the lowest peak among the
    assignments predicted within it and not in ``too_slow`` (measured over it), else the
    fastest (NOTE [Slowdown under auto] in tba/decide/block_policy.py).
    ``host_bytes`` and ``host_bps``: the host tier every replay models, as :func:`predict`
    takes them."""
    n = sum(g.block for g in groups)
    if n == 0:
        raise ValueError("tba.chooser: no blocks to choose for; give the step a model")
    fixed = fixed or {}
    blocks = [g for g in groups if g.block]
    options = [
        (fixed[i],)
        if i in fixed
        else tuple(a for a in ACTIONS if a != SELECTIVE or blocks[i].cached_bytes is not None)
        for i in range(n)
    ]
    seen: dict[tuple[str, ...], Prediction] = {}
    known = frozenset(measured)

    def limit(actions: tuple[str, ...]) -> int | None:  # the budget this assignment must fit
        if budget is None or unmeasured_budget is None or actions in known:
            return budget
        return unmeasured_budget

    def sim(actions: tuple[str, ...]) -> Prediction:
        p = seen.get(actions)
        if p is None:
            p = seen[actions] = predict(
                groups,
                actions,
                write_bps,
                read_bps,
                prefetch_bytes,
                staging_bytes,
                staging_waits,
                write_spread,
                host_bytes,
                host_bps,
                staging_limit,
            )
        return p

    slow_set = frozenset(too_slow)

    def slow(p: Prediction) -> bool:
        return max_step_seconds is not None and (
            p.step_seconds > max_step_seconds or p.actions in slow_set
        )

    def rank(p: Prediction) -> tuple:
        if budget is None and max_step_seconds is not None:
            late = slow(p)
            return (late, p.step_seconds if late else 0.0, p.peak_bytes, p.step_seconds)
        cap = limit(p.actions)
        over = cap is not None and p.peak_bytes > cap
        return (over, p.peak_bytes if over else 0, p.step_seconds, p.peak_bytes)

    exhaustive = n <= exhaustive_blocks
    if exhaustive:
        best = min((sim(a) for a in itertools.product(*options)), key=rank)
    else:
        left = (lambda: len(seen) < max_sims) if max_sims else (lambda: True)

        def pin(a: Sequence[str]) -> tuple[str, ...]:  # fixed blocks, and only what they allow
            fit = lambda i, x: "recompute" if "recompute" in options[i] else options[i][0]  # noqa: E731
            return tuple(x if x in options[i] else fit(i, x) for i, x in enumerate(a))

        # in the order _starts gives (a set would follow string hashes, which differ per
        # process): ties in rank then go the same way in every process
        offered = any(SELECTIVE in o for o in options)
        filled = _fill(pin(("recompute",) * n), sim, options, limit, left)
        firsts = [] if filled is None else [filled]
        tried = [  # the uniform ones always; the rest while the bound allows
            sim(pin(s)) for i, s in enumerate(_starts(n, offered)) if i < len(ACTIONS) or left()
        ]
        # and every measured assignment, always: the one in force among them (NOTE
        # [Unmeasured margin] in tba/decide/block_policy.py); sorted, as a set's order differs by
        # process
        tried += [sim(pin(m)) for m in sorted(known) if len(m) == n]
        starts = sorted(dict.fromkeys(tried), key=rank)
        for p in firsts + [p for p in starts if p not in firsts][:DESCENTS]:
            _descend(p, sim, rank, options, left)
        best = min(seen.values(), key=rank)  # every replay counts, a cut-off descent's too
    cap = limit(best.actions)
    fits = (cap is None or best.peak_bytes <= cap) and not (budget is None and slow(best))
    return Choice(best, fits, len(seen), exhaustive, budget)


def _starts(n: int, selective: bool = True) -> list[list[str]]:
    """The assignments the local search replays first: uniform ones, then the last k blocks
    kept (or selective) and the rest given one other action, for up to KEEP_LAST_STARTS values
    of k spread over 1..n-1. The selective tails are there because one block at a time does not
    get from a keep-last start to them: on the 7B of BENCHMARKS.md ("Projections"), trading a
    kept block for a selective one is slower, and an offloaded one for it overruns the budget,
    while a tail of selective blocks after recompute_offload ones beats the best keep-last
    descent. Without ``selective`` (no block offers it) there are no selective tails."""
    out = [[a] * n for a in ACTIONS]
    if n > 1:
        m = min(n - 1, KEEP_LAST_STARTS)
        ks = sorted({1 + round(i * (n - 2) / max(1, m - 1)) for i in range(m)})
        for tail in ("keep", SELECTIVE) if selective else ("keep",):
            lead = [
                a for a in ("recompute", "offload", "recompute_offload", SELECTIVE) if a != tail
            ]
            out += [[a] * (n - k) + [tail] * k for k in ks for a in lead]
    return out


def _fill(base: tuple[str, ...], sim, options, limit, left) -> Prediction | None:
    """The greedy start (NOTE [Chooser]): from ``base`` (every block recomputed), the single
    changes that shorten the step, ranked by seconds saved per byte of peak they add, taken in
    that order while the budget holds (``limit(actions)``: the budget an assignment must fit),
    one per block. None without a budget (nothing to fill) or when ``base`` itself is over it."""
    if limit(base) is None:
        return None
    p0 = cur = sim(base)
    if p0.peak_bytes > limit(base):
        return None
    gains = []
    for i, opts in enumerate(options):
        for a in opts:
            if a == base[i] or not left():
                continue
            q = sim(base[:i] + (a,) + base[i + 1 :])
            saved = p0.step_seconds - q.step_seconds
            if saved > 0:
                gains.append((-saved / max(q.peak_bytes - p0.peak_bytes, 1), i, a))
    done: set[int] = set()
    for _, i, a in sorted(gains):
        if i in done or not left():
            continue
        q = sim(cur.actions[:i] + (a,) + cur.actions[i + 1 :])
        if q.peak_bytes <= limit(q.actions) and q.step_seconds < cur.step_seconds:
            cur = q
            done.add(i)
    return cur


def _descend(p: Prediction, sim, rank, options, left) -> None:
    """Change one block at a time, taking the best change, while it improves ``rank`` and
    ``left()`` allows more replays (every replay lands in ``sim``'s cache, where the caller
    takes the best)."""
    while left():
        moves = [
            sim(p.actions[:i] + (a,) + p.actions[i + 1 :])
            for i in range(len(p.actions))
            for a in options[i]
            if a != p.actions[i]
        ]
        if not moves:
            return
        nxt = min(moves, key=rank)
        if rank(nxt) >= rank(p):
            return
        p = nxt
