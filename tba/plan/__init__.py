"""`tba plan`: will the SSDs keep up? Activation bytes, required bandwidth, and a discrete-event
simulation of tba's offload schedule for every keep-last K, from a model shape and hardware
figures or from a trace of a real run. No torch calls and no I/O except reading a trace.

Modules, in the order a plan is made:

- ``inputs``: the hardware, tba's settings (:class:`Knobs`), the input error, and the
  simulator's setup for them;
- ``shape``: a transformer's saved tensors and FLOPs (NOTE [Activation bytes]);
- ``workload``: a step's groups from a shape; ``trace``: from a TBA_TRACE file;
- ``simulation``: steps back to back on the simulator the runtime's adaptive keep uses too
  (NOTE [Simulator] in tba/decide/simulator/engine.py), and the closed-form peak;
- ``recommend``: the recommended K, the bandwidth needed, recompute, the plan as a dict;
- ``mix``: keep, offload or recompute per block by the runtime's chooser (NOTE [Planner mix]);
- ``render``: the tables; ``projections``: the 7B-on-H100 tables; ``command``: `tba plan`.
"""

from __future__ import annotations

from ..decide.simulator import Saved, SimResult
from .command import build, run_cli
from .inputs import ALIGN, DTYPES, GB, Hardware, Knobs, PlanInputError, setup_for
from .mix import budget_for, costs, make_mix
from .projections import (
    LLAMA_7B,
    PROJECTION_ASSUMPTIONS,
    PROJECTION_KNOBS,
    mix_projections,
    projections,
    render_mix_projections,
    render_projections,
)
from .recommend import WITHIN, make_plan, needed_gbps, recommend, recompute_estimate
from .render import render_text
from .shape import (
    LLAMA_FFN_RATIO,
    ModelShape,
    head_tensors,
    korthikanti_bytes,
    layer_bytes,
    layer_flops,
    layer_tensors,
)
from .simulation import STEADY_MAX, peak_formula, simulate
from .trace import TraceInfo, read_trace
from .workload import Group, Workload, workload_from_shape

__all__ = [
    "ALIGN",
    "DTYPES",
    "GB",
    "LLAMA_7B",
    "LLAMA_FFN_RATIO",
    "PROJECTION_ASSUMPTIONS",
    "PROJECTION_KNOBS",
    "STEADY_MAX",
    "WITHIN",
    "Group",
    "Hardware",
    "Knobs",
    "ModelShape",
    "PlanInputError",
    "Saved",
    "SimResult",
    "TraceInfo",
    "Workload",
    "budget_for",
    "build",
    "costs",
    "head_tensors",
    "korthikanti_bytes",
    "layer_bytes",
    "layer_flops",
    "layer_tensors",
    "make_mix",
    "make_plan",
    "mix_projections",
    "needed_gbps",
    "peak_formula",
    "projections",
    "read_trace",
    "recommend",
    "recompute_estimate",
    "render_mix_projections",
    "render_projections",
    "render_text",
    "run_cli",
    "setup_for",
    "simulate",
    "workload_from_shape",
]
