"""Which offloaded blocks go to the spill disk when the host tier cannot hold them all.

NOTE [Tier order]
Backward needs the blocks in reverse forward order, so the earliest blocks of the forward are
needed last and have the whole backward to come back from the disk: they are the ones the disk
should take. The forward, though, runs first to last, and a plain "host first, disk when full"
fills the host with the earliest blocks and sends the last ones (needed first) to the disk.
So each step sends its leading ``spill_groups`` groups to the disk first, the smallest such
prefix whose remaining groups fit the host tier by the previous step's measured per-group bytes
(:func:`spill_groups`). A group past the prefix that still finds the tier full (a step that
saves more than the last one) goes to the disk as it comes, and so does every group of the
first step, before anything is measured. The simulator (tba/decide/simulator/engine.py) and
``tba plan`` apply the same rule.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["HEADROOM", "spill_groups"]

HEADROOM = 1 / 32  # of the tier kept free for a step that saves a little more than the last


def spill_groups(group_bytes: Iterable[tuple[int, int]], capacity: int) -> int:
    """The first group that goes to the host tier: groups below it go to the disk first.

    ``group_bytes`` holds (group index, bytes offloaded) of the last step, ``capacity`` what
    the tier can hold this step. 0 when everything fits (or nothing was measured)."""
    room = capacity - int(capacity * HEADROOM)
    held = 0
    for group, nbytes in sorted(group_bytes, reverse=True):
        if nbytes <= 0:
            continue
        if held + nbytes > room:
            return group + 1
        held += nbytes
    return 0
