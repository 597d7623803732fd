"""A step from a TBA_TRACE file of a real run (schema version 1, written by
tba/datapath/trace.py)."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence
from typing import Any

from ..decide.simulator import Saved, pieces
from .inputs import PlanInputError
from .workload import Group, Workload


@dataclasses.dataclass
class TraceInfo:
    config: dict[str, Any]
    steps: int
    groups: int
    write_bps: float | None
    read_bps: float | None
    step_seconds: float | None
    peak_resident_bytes: int | None
    keep_last: int | None
    machine: str


def median(xs: Sequence[float]) -> float:
    """The median, 0 for none."""
    return statistics.median(xs) if xs else 0.0


def read_trace(path: str) -> tuple[Workload, TraceInfo]:
    """Per-group compute and bytes from a JSON-lines trace (schema version 1).

    Unknown keys and record types are ignored. Figures are medians over the steps after the
    first (all steps if only one); ``bwd_seconds`` excludes stalls (docs/observability.md).
    ``offloaded_bytes`` counts each storage once, but ``packed_bytes``, ``kept_bytes`` and
    ``keepable_bytes`` count it once per view saved (q, k and v of one projection: three
    times). So a kept block's offloadable bytes are ``keepable_bytes`` times the unique share
    ``offloaded / (packed - kept)`` of the blocks that offloaded (other groups: as they are);
    its small tensors are ``kept_bytes - keepable_bytes``. An offloaded block's small tensors
    are the median small share of the kept blocks (or, with none, the least ``kept/packed`` of
    an offloaded block); the rest of its ``kept_bytes`` was kept for lack of staging or disk.
    An offloaded group that is not a block keeps only small tensors. Offloadable bytes are cut
    into pieces of at most 16 MiB, produced and used evenly over the group's time, as the
    runtime's adaptive keep cuts the same records (:func:`tba.decide.simulator.pieces`). When the
    groups are numbered as tba numbers them with a model (blocks odd, the groups between
    blocks empty), only the odd ones count as blocks for K; otherwise every group does.
    """
    meta: dict[str, Any] = {}
    groups: dict[int, list[dict[str, Any]]] = {}
    steps: list[dict[str, Any]] = []
    try:
        with open(path) as f:
            lines = list(f)
    except OSError as e:
        raise PlanInputError("--trace", f"cannot read {path}: {e.strerror or e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise PlanInputError("--trace", f"{path} line {n} is not JSON") from None
        if not isinstance(rec, dict):
            continue
        kind = rec.get("type")
        if kind == "meta":
            if rec.get("version", 1) != 1:
                raise PlanInputError("--trace", f"version {rec.get('version')}; this reads 1")
            meta = rec
        elif kind == "group" and "group" in rec:
            groups.setdefault(int(rec["group"]), []).append(rec)
        elif kind == "step":
            steps.append(rec)
    if not groups:
        raise PlanInputError("--trace", f"{path} has no group records")
    step_ids = sorted({int(r.get("step", 0)) for rs in groups.values() for r in rs})
    later = set(step_ids[1:] or step_ids)

    def med(rs: list[dict[str, Any]], key: str) -> float:
        return median([float(r.get(key, 0) or 0) for r in rs if int(r.get("step", 0)) in later])

    ids = sorted(groups)
    rows = []
    for g in ids:
        rs = groups[g]
        rows.append(
            {
                "g": g,
                "fwd": med(rs, "fwd_seconds"),
                "bwd": med(rs, "bwd_seconds"),
                "packed": med(rs, "packed_bytes"),
                "offloaded": med(rs, "offloaded_bytes"),
                "kept_bytes": med(rs, "kept_bytes"),
                "keepable": med(rs, "keepable_bytes"),
            }
        )
    total = sum(r["offloaded"] + r["kept_bytes"] for r in rows) or 1.0
    gaps = [r for r in rows[1:-1] if r["g"] % 2 == 0]
    by_model = len(rows) >= 3 and all(r["packed"] <= 0.01 * total for r in gaps)
    for r in rows:
        r["block"] = r["g"] % 2 == 1 if by_model else True
    # packed/kept/keepable count a storage once per view saved; offloaded_bytes once: the
    # unique share of what blocks pack, from the blocks that offloaded
    uniq = [
        r["offloaded"] / (r["packed"] - r["kept_bytes"])
        for r in rows
        if r["block"] and r["offloaded"] > 0 and r["packed"] > r["kept_bytes"]
    ]
    ratio = min(1.0, median(uniq)) if uniq else 1.0
    blocks = [r for r in rows if r["block"] and r["packed"] > 0]
    exact = [(r["kept_bytes"] - r["keepable"]) / r["packed"] for r in blocks if r["keepable"] > 0]
    rough = [r["kept_bytes"] / r["packed"] for r in blocks if r["offloaded"] > 0]
    share = median(exact) if exact else (min(rough) if rough else 0.0)
    out = []
    for r in rows:
        unique = ratio if r["block"] else 1.0
        if r["keepable"] > 0:  # a kept group: what it would offload, and its small tensors
            small = r["kept_bytes"] - r["keepable"]
            big = r["keepable"] * unique
        else:  # offloaded, plus (blocks) what staging-full or disk-full kept
            small = min(r["kept_bytes"], r["packed"] * share) if r["block"] else r["kept_bytes"]
            big = r["offloaded"] + (r["kept_bytes"] - small) * unique
        saved = pieces(int(big), f"g{r['g']}.")  # as the runtime's adaptive keep cuts them
        if small > 0:
            saved.append(Saved(f"g{r['g']}.small", int(small), 0.0, 1.0, small=True))
        out.append(Group(f"group{r['g']}", r["fwd"], r["bwd"], saved, r["block"]))
    cfg = meta.get("config") or {}

    def step_med(key: str) -> float | None:
        xs = [float(s[key]) for s in steps if s.get(key) and int(s.get("step", 0)) in later]
        return median(xs) if xs else None

    peak = step_med("peak_resident_bytes")
    info = TraceInfo(
        config=cfg,
        steps=len(step_ids),
        groups=len(ids),
        write_bps=step_med("write_bps"),
        read_bps=step_med("read_bps"),
        step_seconds=step_med("step_seconds"),
        peak_resident_bytes=None if peak is None else int(peak),
        keep_last=cfg.get("keep_last", steps[-1].get("keep_last") if steps else None),
        machine=str(meta.get("machine", "")),
    )
    return Workload(out, f"trace {path}"), info
