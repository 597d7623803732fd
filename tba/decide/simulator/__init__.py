"""One discrete-event simulation of tba's offload schedule, used by both the runtime's adaptive
keep (tba/decide/adaptive.py) and the planner (tba/plan/): the keep, staging and prefetch rules live
here only, so the two cannot drift (NOTE [Simulator] in tba/decide/simulator/engine.py). Standard
library only (and tba.storage.alloc, the staging allocator tba itself uses); no torch, no I/O.
"""

from __future__ import annotations

from .engine import Engine, SimResult
from .rules import (
    DEPTH_SAFETY,
    PIECE,
    Saved,
    Setup,
    Span,
    Stage,
    kept_from,
    measured_pieces,
    offloadable,
    pieces,
    read_ahead,
)

__all__ = [
    "DEPTH_SAFETY",
    "PIECE",
    "Engine",
    "Saved",
    "Setup",
    "SimResult",
    "Span",
    "Stage",
    "kept_from",
    "measured_pieces",
    "offloadable",
    "pieces",
    "read_ahead",
]
