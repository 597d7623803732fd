"""The keep/offload/recompute mix of `tba plan`: the runtime's chooser of ``TBA_POLICY=auto``
(NOTE [Chooser] in tba/decide/chooser.py) run on the planner's workload, next to keep-all and
checkpoint-all as the same :func:`tba.decide.chooser.predict` replays them.

# NOTE [Planner mix]
The planner hands the chooser what the runtime measures, per group in forward order: forward
and backward seconds, saved bytes, a block's input bytes (what recompute keeps) and whether it
is a block; the embedding and the head are groups that are not blocks, as in the workload. The
disk rates are the drives' aggregate, the read-ahead window is ``--prefetch`` (the cap the
runtime's window grows to). The chooser's model is the runtime's case of the simulator (staging
bounded by ``--staging`` and waited for when full, as ``auto`` under a budget runs; full
duplex; no capture or host-to-device copy costs), so the mix's step can differ from the keep-K
table, which sets every field. Checkpoint-all is every block
recomputed, the other groups as the chooser treats them (the head offloaded, as it follows a
block that is not kept), so it too depends on the drives. Every peak is the peak of resident
saved bytes (kept, staging, read-back, a recomputed block's saves), the quantity
TBA_MEMORY_BUDGET bounds. The budget: ``--budget`` read as TBA_MEMORY_BUDGET is, else
``--device-mem``, else the runtime's default share of the step's saved bytes. A trace does not
record a block's input bytes, so it has no mix.

With the model's shape the chooser may also give a block ``selective`` (NOTE [Selective
recompute] in tba/datapath/blocks/selective.py): it is charged the bytes of the layer's saved
products as kept until its backward, and a recompute of the share of the layer's forward that is not
those products (by the shape's op placement: the GEMMs by FLOPs, the other ops 10% of the layer).
At run time tba measures both (NOTE [Selective recompute cost] in tba/decide/block_policy.py); here
they are the shape's arithmetic, and the Python dispatch mode's cost per op is not counted.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from ..config import parse_budget
from ..decide.block_policy import DEFAULT_BUDGET_SHARE
from ..decide.budget import allowed_bytes, describe
from ..decide.chooser import Cost, Prediction, choose, predict
from ..errors import ValueParseError
from .inputs import Hardware, Knobs, PlanInputError
from .shape import ModelShape, _op_spans
from .workload import Workload


def costs(w: Workload) -> list[Cost] | None:
    """The chooser's groups for ``w``; None when a block's input bytes are unknown (a trace).
    With the model's shape, blocks say what ``selective`` keeps and recomputes (NOTE [Planner
    mix], last paragraph)."""
    if any(g.block and g.input_bytes is None for g in w.groups):
        return None
    kept, share = _selective(w.shape) if w.shape is not None else (None, None)
    out = []
    for g in w.groups:
        c = Cost(g.fwd, g.bwd, g.nbytes, g.input_bytes or 0, g.block)
        if g.block and kept is not None:
            c = dataclasses.replace(
                c,
                cached_bytes=sum(x.nbytes for x in g.saved if x.name in kept),
                selective_recompute=share * g.fwd,
            )
        out.append(c)
    return out


def _selective(m: ModelShape) -> tuple[frozenset[str], float]:
    """What ``selective`` keeps of a layer (the names of its saved products: the q/k/v
    projection, the MLP's first products, and fused attention's output when it has no
    dropout) and the share of the layer's forward its recompute runs: the norms and
    elementwise ops, the output projection (whose product nothing saves), and unfused or
    dropout attention. The last product is never recomputed: the recompute stops once it has
    what backward needs."""
    fused = m.attention != "explicit" and not m.dropout
    kept = {"q,k,v", "gate.out", "up.out", "act.in"} | (
        {"attn.out", "attn.lse"} if fused else set()
    )
    again = {"ln1", "ln2", "act", "mul", "proj"} | (set() if fused else {"attention"})
    spans = _op_spans(m)
    return frozenset(kept), sum(b - a for name, (a, b) in spans.items() if name in again)


def budget_for(
    text: str | None, saved_bytes: int, device_bytes: int | None
) -> tuple[int | None, str]:
    """The budget in bytes (None: unbounded) and where it comes from (NOTE [Planner mix])."""
    if text is not None:
        try:
            budget = parse_budget(text)  # TBA_MEMORY_BUDGET's own parser: one meaning for both
        except ValueParseError as e:
            raise PlanInputError(
                "--budget", f"{text!r} is invalid; expected {e.expected} (as TBA_MEMORY_BUDGET)"
            ) from None
        return allowed_bytes(budget, saved_bytes), f"--budget {describe(budget)}"
    if device_bytes is not None:
        return device_bytes, "--device-mem"
    share = DEFAULT_BUDGET_SHARE
    return allowed_bytes(share, saved_bytes), f"{share:g} of saved bytes, the runtime's default"


def make_mix(w: Workload, hw: Hardware, knobs: Knobs, budget: str | None = None) -> dict[str, Any]:
    """The chooser's assignment for ``w`` on ``hw`` and what it predicts, as a JSON-ready dict
    (``available`` False with a ``reason`` when there is none)."""
    groups = costs(w)
    if groups is None:
        return {"available": False, "reason": "a trace does not record block inputs"}
    if not w.blocks:
        return {"available": False, "reason": "no blocks to assign"}
    limit, source = budget_for(budget, w.total_bytes, hw.device_bytes)
    # staging as auto runs it: bounded by TBA_STAGING_BYTES, a full one waited for
    rates = (hw.write_rate, hw.read_rate, knobs.prefetch_bytes, knobs.staging_bytes, True)
    got = choose(
        groups,
        hw.write_rate,
        hw.read_rate,
        limit,
        knobs.prefetch_bytes,
        staging_bytes=knobs.staging_bytes,
        staging_waits=True,
        host_bytes=hw.host_tier_bytes or 0,
        host_bps=hw.host_tier_bps or math.inf,
    )
    keep_all = predict(groups, ("keep",) * w.blocks, *rates)
    checkpoint_all = predict(groups, ("recompute",) * w.blocks, *rates)
    best = got.best
    return {
        "available": True,
        "search": "exhaustive" if got.exhaustive else "local",
        "searched": got.searched,
        "budget_bytes": limit,
        "budget_source": source,
        "fits": got.fits,
        "actions": list(best.actions),
        "runs": [[a, len(list(g))] for a, g in itertools.groupby(best.actions)],
        **_outcome(best),
        "keep_all": _outcome(keep_all),
        "checkpoint_all": _outcome(checkpoint_all),
        "step_vs_keep_all": _ratio(best.step_seconds, keep_all.step_seconds),
        "peak_vs_keep_all": _ratio(best.peak_bytes, keep_all.peak_bytes),
        "saved_vs_keep_all_bytes": keep_all.peak_bytes - best.peak_bytes,
        "saved_vs_checkpoint_all_bytes": checkpoint_all.peak_bytes - best.peak_bytes,
        "write_bps": _finite(hw.write_rate),
        "read_bps": _finite(hw.read_rate),
        "prefetch_bytes": knobs.prefetch_bytes,
        "staging_bytes": knobs.staging_bytes,
    }


def _outcome(p: Prediction) -> dict[str, Any]:
    return {"step_seconds": p.step_seconds, "peak_bytes": p.peak_bytes}


def _ratio(x: float, base: float) -> float | None:
    return x / base if base else None


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else x
