"""`tba plan` from parsed arguments (tba/cli.py builds the parser): inputs, the plan, output."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from typing import Any

from ..decide.chooser import EXHAUSTIVE_BLOCKS
from .inputs import GB, Hardware, Knobs, PlanInputError
from .mix import make_mix
from .projections import (
    PROJECTION_ASSUMPTIONS,
    mix_projections,
    projections,
    render_mix_projections,
    render_projections,
)
from .recommend import make_plan
from .render import render_text
from .shape import ModelShape
from .trace import read_trace
from .workload import Workload, workload_from_shape

_SHAPE_FLAGS = (
    "layers",
    "hidden",
    "heads",
    "seq",
    "batch",
    "dtype",
    "tp",
    "attention",
    "arch",
    "mlp_ratio",
    "vocab",
    "kv_heads",
    "dropout",
    "sequence_parallel",
)


def _given(args: Any, name: str) -> bool:
    v = getattr(args, name, None)
    return v is not None and v is not False


def build(args: Any) -> tuple[Workload, Hardware, Knobs, str, dict[str, Any] | None]:
    """Workload, hardware and knobs from parsed `tba plan` arguments (PlanInputError if bad)."""
    info = None
    cfg: dict[str, Any] = {}
    if args.trace:
        extra = [n for n in _SHAPE_FLAGS if _given(args, n)]
        if extra:
            flag = "--" + extra[0].replace("_", "-")
            raise PlanInputError(flag, "describes a model shape; with --trace the trace does")
        w, ti = read_trace(args.trace)
        cfg = ti.config
        info = dataclasses.asdict(ti)
        describe = f"trace {args.trace}: {ti.groups} groups, {ti.steps} steps"
        if ti.machine:
            describe += f", {ti.machine}"
        if args.write_gbps is None or args.read_gbps is None:
            describe += (
                "; disk rates not given are the trace's achieved rates (a lower bound on the "
                "drive's: reads wait for the prefetch budget)"
            )
    else:
        missing = [n for n in ("layers", "hidden", "heads", "seq") if not _given(args, n)]
        if missing:
            raise PlanInputError(
                "--" + missing[0], "required (a model shape), or give --trace FILE or --projections"
            )
        shape = ModelShape(
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            seq=args.seq,
            batch=args.batch or 1,
            dtype_bytes=args.dtype or 2,
            tp=args.tp or 1,
            attention=args.attention or "flash",
            arch=args.arch or "gpt",
            mlp_ratio=args.mlp_ratio,
            vocab=args.vocab or 0,
            kv_heads=args.kv_heads,
            dropout=bool(args.dropout),
            sequence_parallel=bool(args.sequence_parallel),
        )
        describe = shape.describe()

    def rate(flag_value: float | None, trace_value: float | None, flag: str) -> float | None:
        if flag_value is not None:
            return flag_value * GB
        if args.trace and trace_value:
            return trace_value
        if args.trace:
            return None
        raise PlanInputError(flag, "required: the drive's rate in GB/s, e.g. 6 (per drive)")

    hw = Hardware(
        write_bps=rate(args.write_gbps, info and info["write_bps"], "--write-gbps"),
        read_bps=rate(args.read_gbps, info and info["read_bps"], "--read-gbps"),
        drives=args.drives or 1,
        duplex=args.duplex or "full",
        flops=args.flops,
        layer_fwd_seconds=None if args.layer_fwd_ms is None else args.layer_fwd_ms / 1e3,
        backward_ratio=args.backward_ratio or 2.0,
        device=args.device or "cuda",
        capture_bps=None if args.capture_gbps is None else args.capture_gbps * GB,
        h2d_bps=None if args.h2d_gbps is None else args.h2d_gbps * GB,
        device_bytes=args.device_mem,
        host_bytes=args.host_mem,
        host_tier_bytes=args.host_tier,
        host_tier_bps=None if args.host_tier_gbps is None else args.host_tier_gbps * GB,
    )
    knobs = Knobs(
        prefetch_bytes=_pick(args.prefetch, cfg.get("prefetch_bytes"), 128 << 20),
        staging_bytes=_pick(args.staging, cfg.get("staging_bytes"), 256 << 20),
        min_offload_bytes=_pick(args.min_offload, cfg.get("min_offload_bytes"), 1 << 20),
    )
    if not args.trace:
        w = workload_from_shape(shape, hw)
    return w, hw, knobs, describe, info


def _pick(flag: Any, traced: Any, default: int) -> int:
    if flag is not None:
        return int(flag)
    if isinstance(traced, int) and traced > 0:
        return traced
    return default


def run_cli(args: Any) -> int:
    """`tba plan`: 0 done, 2 bad input (the message names the flag)."""

    try:
        if args.projections_mix:
            rows = mix_projections()
            print(json.dumps(rows, indent=2) if args.json else render_mix_projections(rows))
            return 0
        if args.projections:
            rows = projections()
            if args.json:
                print(json.dumps({"assumptions": PROJECTION_ASSUMPTIONS, "rows": rows}, indent=2))
            else:
                print(render_projections(rows))
            return 0
        w, hw, knobs, describe, info = build(args)
        if args.steps is not None and args.steps < 1:
            raise PlanInputError("--steps", "must be 1 or more")
        p = make_plan(w, hw, knobs, steps=args.steps or 0)
        p["mix"] = _mix(w, hw, knobs, args.budget)
    except PlanInputError as e:
        print(f"tba plan: {e}", file=sys.stderr)
        return 2
    p["describe"] = describe
    if info is not None:
        p["trace"] = info
    if args.json:
        print(json.dumps(p, indent=2, default=_json_default))
    else:
        print(render_text(p, describe))
    return 0


def _mix(w: Workload, hw: Hardware, knobs: Knobs, budget: str | None) -> dict[str, Any]:
    """The chooser's mix; a search over many blocks can take minutes, so say so first."""
    if w.blocks > EXHAUSTIVE_BLOCKS:
        print(
            f"tba plan: choosing keep/offload/recompute for {w.blocks} blocks by a local search "
            "(tba.decide.chooser); with tens of large blocks this takes minutes",
            file=sys.stderr,
        )
    return make_mix(w, hw, knobs, budget)


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and math.isinf(x):
        return None
    return str(x)
