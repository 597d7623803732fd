"""A step as the planner simulates it: groups in forward order with their compute time and
saved tensors, from a model shape (or from a trace: tba/plan/trace.py)."""

from __future__ import annotations

import dataclasses

from ..decide.simulator import Saved, kept_from
from .inputs import Hardware, PlanInputError
from .shape import ModelShape, head_tensors, layer_flops, layer_tensors


@dataclasses.dataclass
class Group:
    name: str
    fwd: float  # forward compute seconds
    bwd: float  # backward compute seconds (no stalls)
    saved: list[Saved]
    block: bool = True  # a repeated block: what keep-last K counts
    input_bytes: int | None = None  # the block's input (what per-block checkpointing keeps)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.saved)


@dataclasses.dataclass
class Workload:
    groups: list[Group]  # forward order
    source: str = ""
    shape: ModelShape | None = None

    @property
    def blocks(self) -> int:
        return sum(g.block for g in self.groups)

    def kept_from(self, keep: int) -> int:
        """The first group kept resident with keep-last ``keep`` (tba's rule, ``kept_from`` in
        tba/decide/simulator/rules.py: the last ``keep`` blocks and every group after the first)."""
        return kept_from([g.block for g in self.groups], keep)

    def kept_flags(self, keep: int) -> list[bool]:
        """Per group, whether keep-last ``keep`` keeps it resident."""
        first = self.kept_from(keep)
        return [i >= first for i in range(len(self.groups))]

    @property
    def total_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @property
    def compute_seconds(self) -> float:
        return sum(g.fwd + g.bwd for g in self.groups)


def workload_from_shape(m: ModelShape, hw: Hardware) -> Workload:
    """Groups for ``m``: token ids, one per layer, then the head; times from FLOP/s."""
    if hw.layer_fwd_seconds is not None:
        per_flop = hw.layer_fwd_seconds / layer_flops(m)
    elif hw.flops is not None:
        per_flop = 1.0 / hw.flops
    else:
        raise PlanInputError("--flops", "give the achieved FLOP/s (e.g. 400e12) or --layer-fwd-ms")
    lf = layer_flops(m) * per_flop
    groups = [Group("embedding", 0.0, 0.0, [Saved("token_ids", 8 * m.tokens, 0.0, 1.0)], False)]
    tensors = layer_tensors(m)
    for i in range(m.layers):
        groups.append(
            Group(f"layer{i}", lf, lf * hw.backward_ratio, list(tensors), True, tensors[0].nbytes)
        )
    if m.vocab:
        hf = 2 * m.tokens * m.hidden * m.vocab / m.tp * per_flop
        groups.append(Group("head", hf, hf * hw.backward_ratio, head_tensors(m), False))
    return Workload(groups, "shape", m)
