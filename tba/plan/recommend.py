"""What `tba plan` concludes: the recommended K, the bandwidth needed, the recompute
alternative, and the whole plan as one dict.

Recommendation rule: among K = 0..blocks, the smallest peak (device peak with a GPU, resident
peak on a CPU) whose step time is within 3% of the fastest K; ties go to the larger K (less
disk traffic).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

from ..decide.simulator import SimResult, offloadable
from .inputs import ALIGN, GB, Hardware, Knobs
from .simulation import peak_formula, simulate
from .trace import median
from .workload import Workload

WITHIN = 0.03  # the recommendation's step-time tolerance


def recommend(results: Sequence[SimResult], device: str) -> SimResult:
    """The smallest peak within 3% of the fastest step time; ties go to the larger K."""
    fastest = min(r.step_seconds for r in results)
    ok = [r for r in results if r.step_seconds <= fastest * (1 + WITHIN)]

    def peak(r: SimResult) -> int:
        return r.peak_device_bytes if device == "cuda" else r.peak_resident_bytes

    return min(ok, key=lambda r: (peak(r), -r.keep))


PEAK_SLACK = 0.05  # needed_gbps: the peak may exceed an unlimited disk's by this share of saved


def needed_gbps(
    w: Workload, hw: Hardware, knobs: Knobs, keep: int = 1, steps: int = 0
) -> float | None:
    """Least aggregate GB/s, the same for writes and reads, at which keep-last ``keep`` runs
    within 3% of the compute-only step and its peak is within 5% of the step's saved bytes of
    the peak an unlimited disk gives. None when no rate up to 100 TB/s does."""
    ideal = simulate(w, dataclasses.replace(hw, write_bps=None, read_bps=None), knobs, keep, 1)
    base = dataclasses.replace(hw, write_bps=GB, read_bps=GB, drives=1)
    cuda = hw.device == "cuda"
    target = (ideal.peak_device_bytes if cuda else ideal.peak_resident_bytes) + PEAK_SLACK * (
        w.total_bytes
    )

    def ok(x: float) -> bool:
        r = simulate(w, base.scaled(x), knobs, keep, steps)
        peak = r.peak_device_bytes if cuda else r.peak_resident_bytes
        return peak <= target and r.step_seconds <= w.compute_seconds * (1 + WITHIN)

    lo, hi = 1e-3, 1e5  # GB/s
    if not ok(hi):
        return None
    while hi / lo > 1.01:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def recompute_estimate(w: Workload) -> tuple[float, int | None]:
    """Per-block checkpointing: one more forward of every block in backward. Memory (saved
    tensors, as tba counts them): every block's input plus the other groups until the head's
    backward ends, then the inputs of blocks 0..i plus block i recomputed. None when the block
    inputs are unknown (a trace)."""
    time = w.compute_seconds + sum(g.fwd for g in w.groups if g.block)
    blocks = [g for g in w.groups if g.block]
    if any(g.input_bytes is None for g in blocks):
        return time, None
    inputs = [g.input_bytes or 0 for g in blocks]
    head = sum(g.nbytes for g in w.groups if not g.block)
    pre = sum(g.nbytes for g in w.groups[: w.groups.index(blocks[0])]) if blocks else 0
    peak = sum(inputs) + head
    for i, g in enumerate(blocks):
        peak = max(peak, sum(inputs[:i]) + g.nbytes + pre)
    return time, peak


def make_plan(
    w: Workload,
    hw: Hardware,
    knobs: Knobs,
    steps: int = 0,
    keeps: Iterable[int] | None = None,
    with_needed: bool = True,
) -> dict[str, Any]:
    """Everything `tba plan` prints, as one JSON-ready dict."""
    keeps = list(range(w.blocks + 1)) if keeps is None else list(keeps)
    results = [simulate(w, hw, knobs, k, steps) for k in keeps]
    best = recommend(results, hw.device)
    blocks = [g for g in w.groups if g.block]
    block_bytes = median([g.nbytes for g in blocks])
    movable = median(
        [sum(s.nbytes for s in g.saved if offloadable(s, knobs.min_offload_bytes)) for g in blocks]
    )
    fwd = median([g.fwd for g in blocks])
    bwd = median([g.bwd for g in blocks])
    keep_all_time = w.compute_seconds
    keep_all_mem = w.total_bytes
    rtime, rmem = recompute_estimate(w)

    def peak(r: SimResult) -> int:
        return r.peak_device_bytes if hw.device == "cuda" else r.peak_resident_bytes

    out: dict[str, Any] = {
        "source": w.source,
        "shape": dataclasses.asdict(w.shape) if w.shape else None,
        "hardware": dataclasses.asdict(hw),
        "knobs": dataclasses.asdict(knobs),
        "steps_simulated": steps,
        "blocks": len(blocks),
        "per_layer_bytes": int(block_bytes),
        "per_layer_offloadable_bytes": int(movable),
        "per_step_bytes": int(keep_all_mem),
        "layer_forward_seconds": fwd,
        "layer_backward_seconds": bwd,
        "required_write_gbps": movable / fwd / GB if fwd else None,
        "required_read_gbps": movable / bwd / GB if bwd else None,
        "table": [
            {**r.as_dict(), "peak_formula_bytes": peak_formula(w, knobs, r.keep)} for r in results
        ],
        "recommended": {
            "keep": best.keep,
            "rule": "smallest peak (device peak on cuda, resident peak on cpu) whose step time "
            "is within 3% of the fastest K; ties go to the larger K",
        },
        "rok": {
            "keep_all": {"step_seconds": keep_all_time, "memory_bytes": keep_all_mem},
            "offload": {
                "keep": best.keep,
                "step_seconds": best.step_seconds,
                "memory_bytes": peak(best),
                "host_bytes": best.peak_host_bytes,
            },
            "recompute": {"step_seconds": rtime, "memory_bytes": rmem},
        },
    }
    if w.shape is not None and hw.flops is not None and w.shape.arch == "gpt":
        t, h = w.shape.tp, w.shape.hidden  # the TBA paper's rule of thumb (docs/sources.md)
        out["tba_paper_write_gbps"] = (10 * t + 24) * hw.flops / (24 * h) / GB
    if hw.device_bytes is not None:
        for row in out["table"]:
            row["fits"] = (
                row["peak_device_bytes"] if hw.device == "cuda" else row["peak_resident_bytes"]
            ) <= hw.device_bytes
        out["rok"]["keep_all"]["fits"] = keep_all_mem <= hw.device_bytes
        out["rok"]["recompute"]["fits"] = rmem is None or rmem <= hw.device_bytes
    if hw.host_bytes is not None:
        out["host_fits"] = knobs.staging_bytes + knobs.prefetch_bytes <= hw.host_bytes
    over = [
        x
        for g in blocks
        for x in g.saved
        if offloadable(x, knobs.min_offload_bytes)
        and -(-x.nbytes // ALIGN) * ALIGN > knobs.staging_bytes
    ]
    if over:
        out["over_staging"] = {
            "tensors_per_layer": len(over) / len(blocks),
            "largest_bytes": max(x.nbytes for x in over),
        }
    if with_needed and w.blocks:
        got = needed_gbps(w, hw, knobs, keep=min(1, w.blocks))
        out["needed_gbps_keep_1"] = got
    if hw.host_tier_bytes:
        out["host_tier"] = host_tier_effect(w, hw, knobs, steps, keeps, best)
    return out


def host_tier_effect(
    w: Workload, hw: Hardware, knobs: Knobs, steps: int, keeps: list[int], best: SimResult
) -> dict[str, Any]:
    """What the host tier changes (NOTE [Host tier]): the recommended K with it, and the plan's
    recommendation without it, side by side."""
    bare = dataclasses.replace(hw, host_tier_bytes=None, host_tier_bps=None)
    without = recommend([simulate(w, bare, knobs, k, steps) for k in keeps], hw.device)

    def row(r: SimResult) -> dict[str, Any]:
        return {
            "keep": r.keep,
            "step_seconds": r.step_seconds,
            "stall_seconds": r.stall_seconds,
            "peak_device_bytes": r.peak_device_bytes,
            "ssd_bytes_written": r.ssd_bytes_written,
            "host_bytes_written": r.host_bytes_written,
            "peak_host_tier_bytes": r.peak_host_tier_bytes,
            "spill_groups": r.spill_groups,
        }

    return {
        "host_tier_bytes": hw.host_tier_bytes,
        "host_tier_bps": hw.host_tier_bps,
        "with": row(best),
        "without": row(without),
        "step_vs_without": best.step_seconds / without.step_seconds
        if without.step_seconds
        else None,
    }
