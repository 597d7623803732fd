"""``TBA_MEMORY_BUDGET`` and the default read-ahead window: how many bytes of saved tensors a step
may hold resident. Adaptive keep (tba/adaptive.py) and any other chooser of what stays in memory
ask here, so that every decision reads the budget the same way.

# NOTE [Memory budget]
The budget bounds tba's ``peak_resident_bytes``: everything tba holds in memory during a step,
that is kept blocks, tensors kept for their size, tensors held while their write runs (staging)
and bytes read back ahead of backward (the read-ahead window). ``TBA_MEMORY_BUDGET`` is either a
size (``2GiB``) or a fraction of the step's ``saved_bytes`` (``0.35``: a third of what stock
PyTorch would hold); :func:`allowed_bytes` turns it into bytes for a step. Adaptive keep applies
it (NOTE [Adaptive keep]): for each K it predicts the step's peak with the simulator, at the
window DepthController wants and at the smallest window (one largest read); a K fits when its
peak at the smallest window is within the budget, and the window is then cut to the room the
budget leaves (:func:`window_room`). Among the K that fit, the usual rule picks (the smallest
without predicted stalls, else the fastest). A measured step over the budget re-decides and
shrinks the room by the excess. When no K fits (writes slower than the forward produces, so
staging alone is over the budget), tba takes the K with the smallest predicted peak and says so
in ``stats()["budget_decision"]``: only recompute can then meet the budget.

Without a budget, the read-ahead window's cap is TBA_PREFETCH_BYTES when the user set it, else
:func:`default_window_cap`: an eighth of the step's saved bytes (at least two largest reads, at
most 128 MiB). A fixed 128 MiB would be more than a small model's whole step.
"""

from __future__ import annotations

from typing import Any

from .config import format_size

WINDOW_SHARE = 0.125  # without a budget, the default window cap is this share of saved_bytes
MIN_WINDOW = 1 << 20  # no window is smaller (TBA_PREFETCH_BYTES's own minimum)


def allowed_bytes(budget: int | float | None, saved_bytes: int) -> int | None:
    """Bytes this budget allows resident during a step of ``saved_bytes`` saved bytes; None
    without a budget. A fraction (float) scales ``saved_bytes``; bytes (int) stand as given."""
    if budget is None:
        return None
    if isinstance(budget, float):
        return int(budget * saved_bytes)
    return int(budget)


def describe(budget: int | float | None) -> str:
    """The budget as a user reads it: ``0.35 of saved_bytes``, ``2.0 GiB`` or ``none``."""
    if budget is None:
        return "none"
    if isinstance(budget, float):
        return f"{budget:g} of saved_bytes"
    return format_size(budget)


def default_window_cap(cap: int, saved_bytes: int, largest_read: int) -> int:
    """The read-ahead cap when TBA_PREFETCH_BYTES is not set: WINDOW_SHARE of the step's saved
    bytes, at least two largest reads (one consumed while the next is read), within ``cap``."""
    want = max(int(WINDOW_SHARE * saved_bytes), 2 * largest_read, MIN_WINDOW)
    return min(cap, want)


def window_room(allowed: int, peak_at_smallest: int, smallest: int) -> int:
    """The largest read-ahead window that keeps a step's peak within ``allowed``, given its
    predicted peak with the smallest window (``smallest`` bytes): the window grows the peak at
    most byte for byte, so the room is the smallest window plus what the budget leaves."""
    return max(smallest, smallest + allowed - peak_at_smallest)


def decision(budget: int | float | None, saved_bytes: int, **more: Any) -> dict[str, Any]:
    """What ``stats()["budget_decision"]`` reports, before anything else is known."""
    out = {
        "budget": budget,
        "describe": describe(budget),
        "allowed_bytes": allowed_bytes(budget, saved_bytes) if saved_bytes else None,
        "saved_bytes": saved_bytes,
    }
    out.update(more)
    return out
