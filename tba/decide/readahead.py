"""The read-ahead window of the next step's backward (``DepthController``): sized from the
measured read rate and how fast backward consumes, within its cap, raised after a stall (NOTE
[Prefetch depth] in tba/decide/simulator/rules.py). Adaptive keep (tba/decide/adaptive.py) chooses K
for the window this sets."""

from __future__ import annotations

import logging
from typing import Any

from .budget import MIN_WINDOW, default_window_cap
from .cadence import DRIFT, STALL_SHARE
from .simulator import read_ahead

__all__ = ["FLOOR_AGE", "DepthController"]

log = logging.getLogger("tba")

FLOOR_AGE = 20  # steps without a stall after which the read-ahead floor a stall raised halves


class DepthController:
    """Chooses the read-ahead window within its cap (NOTE [Prefetch depth] in
    tba/decide/simulator/rules.py, whose read_ahead the planner's simulation uses too).

    ``scaled``: the cap is TBA_PREFETCH_BYTES's default, so the cap in use scales with the step's
    saved bytes (default_window_cap in tba/decide/budget.py); a cap the user set stands as given.
    """

    def __init__(self, cap: int, scaled: bool = False):
        self.cap = cap
        self.scaled = scaled
        self.depth = cap
        self.floor = 0
        self.floor_at = 0  # the step that raised the floor, or last halved it
        self.measured = False
        self.reported = cap  # the window the last INFO line named (see report)
        self._whys: list[str] = []  # this step's reasons for changing it, in order
        self.decision: dict[str, Any] = {
            "depth": cap,
            "cap": cap,
            "reason": "first step: nothing measured yet, the cap",
        }

    def cap_for(self, saved_bytes: int, largest_read: int) -> int:
        if not self.scaled or not saved_bytes:
            return self.cap
        return default_window_cap(self.cap, saved_bytes, largest_read)

    def first(self, saved_bytes: int, room: int | None) -> int:
        """The window of a step before anything was measured: the cap for its saved bytes,
        within ``room`` (what a budget leaves, None: no budget)."""
        if self.measured:
            return self.depth
        depth = self.cap_for(saved_bytes, 0)
        why = "first step: nothing measured yet, the cap"
        if self.scaled:
            why += " for the step's saved bytes"
        if room is not None and room < depth:
            depth, why = max(MIN_WINDOW, room), "first step: what TBA_MEMORY_BUDGET leaves"
        self.depth = self.reported = depth
        self.decision = {"depth": depth, "cap": self.cap_for(saved_bytes, 0), "reason": why}
        return depth

    def observe(
        self, step: int, records, read_bps: float | None, largest_read: int, saved_bytes: int = 0
    ) -> None:
        if not records or not read_bps or not largest_read:
            return
        self.measured = True
        cap = self.cap_for(saved_bytes, largest_read)
        # a stall may raise a default cap to two largest reads (NOTE [Memory budget])
        ceiling = max(cap, 2 * largest_read) if self.scaled else cap
        consumed = sum(x["offloaded_bytes"] for x in records)
        bwd = sum(x["bwd_seconds"] for x in records)
        base = sum(x["fwd_seconds"] + x["bwd_seconds"] for x in records)
        stalled = sum(x["stall_seconds"] for x in records)
        if stalled > STALL_SHARE * base:
            self.floor = min(ceiling, 2 * self.depth)
            self.floor_at = step
        elif self.floor and step - self.floor_at >= FLOOR_AGE:  # a stall long ago: halve it
            self.floor, self.floor_at = self.floor // 2 if self.floor > MIN_WINDOW else 0, step
        self.floor = min(self.floor, ceiling)
        rate = consumed / bwd if bwd > 0 else float("inf")
        want, why = read_ahead(largest_read, rate, read_bps, cap)
        depth = min(max(cap, self.floor), max(want, largest_read, self.floor))
        if self.floor and depth == self.floor and want < self.floor:
            why = "raised after a step stalled"
        self._set(step, depth, why)
        self.decision.update(
            cap=cap,
            largest_read=largest_read,
            consume_bps=rate,
            read_bps=read_bps,
        )

    def limit(
        self, step: int, room: int | None, why: str = "cut to what TBA_MEMORY_BUDGET leaves"
    ) -> None:
        """Cut the window to ``room``, what the memory budget leaves (NOTE [Memory budget]);
        never below one largest read, which the read-ahead always allows."""
        if room is None or self.depth <= room:
            return
        largest = self.decision.get("largest_read", 0)
        self._set(step, max(room, largest, MIN_WINDOW), why)

    def _set(self, step: int, depth: int, why: str) -> None:
        if depth != self.depth:
            log.debug(
                "tba: read-ahead window %d -> %d bytes after step %d (%s)",
                self.depth,
                depth,
                step,
                why,
            )
            self._whys.append(why)
        self.depth = depth
        self.decision = {**self.decision, "depth": depth, "reason": why, "step": step}

    def report(self, step: int) -> None:
        """One INFO line for the window's net change after ``step``, once everything that sizes
        it has had its say (a stall raises it, then a budget or auto's assignment may cut it
        back), and only when it moved by more than DRIFT since the last line: a user reads one
        line per real change, not a raise and a cut per step."""
        whys, self._whys = self._whys, []
        if abs(self.depth - self.reported) <= DRIFT * self.reported:
            return
        log.info(
            "tba: read-ahead window %d -> %d bytes after step %d (%s)",
            self.reported,
            self.depth,
            step,
            ", then ".join(dict.fromkeys(whys)) or self.decision["reason"],
        )
        self.reported = self.depth
