"""``TBA_MEMORY_BUDGET`` and the default read-ahead window: how many bytes of saved tensors a step
may hold resident. Adaptive keep (tba/decide/adaptive.py) and any other chooser of what stays in
memory ask here, so that every decision reads the budget the same way.

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
most 128 MiB). A fixed 128 MiB would be more than a small model's whole step. Where two largest
reads are more than 128 MiB, a step that stalls may raise the window past that default cap, up
to two largest reads (NOTE [Prefetch depth] in tba/decide/simulator/rules.py, ``DepthController``):
a window of one largest read cannot read a large tensor while the smaller ones in front of it are
used, so a step whose largest tensors fill that cap stalls at it, and a somewhat wider window
removes the stall at the same peak (BENCHMARKS.md, "Batch headroom"). Only a stall does: the wider
window costs memory, and as the default cap it would cost batch headroom also where the stalls it
removes are negligible.

# NOTE [Window past the budget]
When even the smallest window's predicted peak is over the budget (staging alone is over it: no
K of adaptive keep fits, or auto's assignment cannot meet its target), cutting the window to one
largest read meets nothing: the peak is set elsewhere (by the writes still in flight at the end
of the forward, say), and the narrow window only adds stalls. So the window is then the widest
whose predicted peak is no higher than the smallest window's (:func:`widest_window`): it costs no
memory the step was not spending anyway.

# NOTE [No growth past the budget]
A budget is a bound, so a step that is already over it must not take more than the steps
before it. When nothing meets the budget (no K of adaptive keep, or no assignment of auto), the
window is the one NOTE [Window past the budget] gives, but never wider than the window in force:
it may shrink, not grow, for as long as the budget is out of reach. The prediction that a wider
window adds nothing to the peak is a prediction; measured, such widenings raised the peak step
after step (each stall doubles the window's floor), and the read-back buffers a wider window
needs at once stay with the process under allocators that keep freed memory (tcmalloc), which
tba's peak does not count once they are free. A run sized by its first steps (a batch-size
search, say) then went over its memory cap in a later step. Without growth, the steps after the
second hold what the second held; the window in force is the one the first decision left (the
first step's window, raised after a stall on it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..config import format_size

P = TypeVar("P")  # a prediction: anything with ``peak_bytes``

WINDOW_SHARE = 0.125  # without a budget, the default window cap is this share of saved_bytes
MIN_WINDOW = 1 << 20  # no window is smaller (TBA_PREFETCH_BYTES's own minimum)
ROOM_STEPS = 4  # bisections widest_window takes past the byte-for-byte bound


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


def widest_window(limit: int, smallest: int, want: int, narrow: P, predict: Callable[[int], P]):
    """The widest window in ``[smallest, want]`` whose predicted peak is within ``limit``, and
    its prediction (NOTE [Window past the budget]). ``narrow`` is the prediction at
    ``smallest``, ``predict(window)`` one at another window (anything with ``peak_bytes``).
    The byte-for-byte bound (:func:`window_room`) always fits; ROOM_STEPS bisections look past
    it, since a window often adds less than its size (what it holds is not all resident at the
    step's peak)."""
    if want <= smallest:
        return smallest, narrow
    wide = predict(want)
    if wide.peak_bytes <= limit:
        return want, wide
    lo, got, hi = smallest, narrow, want
    guess = min(want, window_room(limit, narrow.peak_bytes, smallest))
    for i in range(ROOM_STEPS + 1):
        mid = guess if i == 0 else lo + (hi - lo) // 2
        if mid <= lo or hi - lo <= MIN_WINDOW:
            continue
        p = predict(mid)
        if p.peak_bytes <= limit:
            lo, got = mid, p
        else:
            hi = mid
    return lo, got


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
