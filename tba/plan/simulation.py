"""The planner's runs of the shared simulator (NOTE [Simulator] in tba/decide/simulator/engine.py):
steps back to back until the steady state, and the closed-form peak next to it.

# NOTE [Planner steps]
Several steps back to back (``steps``) carry the disk queues and staging over, so a step starts
behind the previous step's unfinished writes; the last step is reported. ``steps=0`` runs until
the steady state (see :func:`simulate`).

Closed form next to it (:func:`peak_formula`): kept groups + small tensors + a full staging
pool + a full prefetch window, the resident set at the end of forward when writes lag; tensors
kept for lack of staging come on top, which only the simulation sees.
"""

from __future__ import annotations

from ..decide.simulator import Engine, SimResult, offloadable
from .inputs import Hardware, Knobs, PlanInputError, setup_for
from .workload import Workload

STEADY_MAX = 40  # steps=0 simulates until a step repeats one of the two before, at most this


def simulate(
    w: Workload, hw: Hardware, knobs: Knobs, keep: int, steps: int = 1, gap: float = 0.0
) -> SimResult:
    """Simulate ``steps`` steps back to back (``gap`` seconds apart) and return the last.

    Writes are never cancelled, so a step inherits the previous step's unfinished writes and
    the staging they hold. ``steps=0`` means the steady state: from an idle disk until a step
    repeats the one or two before it (same time, bytes, staging-full keeps and backlog), at
    most STEADY_MAX steps. When the write backlog is still growing by then (a step offloads
    more than the disk writes in a step), the steady state is a full staging pool: it is
    simulated again from one, which is where that growth ends.
    """
    if not 0 <= keep <= w.blocks:
        raise PlanInputError("--keep", f"a number of blocks from 0 to {w.blocks}")
    if steps > 0:
        return _run(w, hw, knobs, keep, steps, gap, steady=False, prefill=False)[0]
    res, converged, growing = _run(w, hw, knobs, keep, STEADY_MAX, gap, True, False)
    if not converged and growing:
        res = _run(w, hw, knobs, keep, STEADY_MAX, gap, True, True)[0]
    return res


def _run(w, hw, knobs, keep, steps, gap, steady, prefill) -> tuple[SimResult, bool, bool]:
    sim = Engine(setup_for(hw, knobs))
    first = w.kept_from(keep)
    if prefill:
        sim.prefill()
    done: list[SimResult] = []
    converged = False
    for n in range(1, steps + 1):
        res = sim.step(w.groups, first, keep)
        res.steps = n
        sim.now += gap
        done.append(res)
        if steady and any(_same(prev, res) for prev in done[-3:-1]):
            converged = True
            break
    backlog = [r.writes_done_at - r.step_seconds for r in done[-4:]]
    growing = len(backlog) == 4 and all(b > a + 1e-9 for a, b in zip(backlog, backlog[1:]))
    res = done[-1]
    res.peak_resident_bytes, res.peak_device_bytes, res.peak_host_bytes = sim.peaks()
    return res, converged, growing


def _same(a: SimResult, b: SimResult) -> bool:
    return (
        abs(a.step_seconds - b.step_seconds) <= 1e-9 * max(1.0, b.step_seconds)
        and a.bytes_written == b.bytes_written
        and a.bytes_read == b.bytes_read
        and a.staging_full_bytes == b.staging_full_bytes
        and abs(a.writes_done_at - b.writes_done_at) <= 1e-9 * max(1.0, b.step_seconds)
    )


def peak_formula(w: Workload, knobs: Knobs, keep: int) -> int:
    """The closed-form bound on tba's peak for keep-last ``keep``: the kept groups and every
    small tensor, plus a full staging pool and a full prefetch window (what is resident at the
    end of forward when writes lag). Tensors kept because staging was full come on top; the
    simulator has them."""
    kept = movable = 0
    for g, k in zip(w.groups, w.kept_flags(keep)):
        for x in g.saved:
            if k or not offloadable(x, knobs.min_offload_bytes):
                kept += x.nbytes
            else:
                movable += x.nbytes
    window = min(knobs.staging_bytes, movable) + min(knobs.prefetch_bytes, movable)
    return kept + window
