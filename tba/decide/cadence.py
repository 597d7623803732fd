"""When a controller decides again: the triggers adaptive keep (tba/decide/adaptive.py) and the
chooser of TBA_POLICY=auto (tba/decide/block_policy.py) share, and the pacing that keeps their cost
off the training step.

# NOTE [Decision cost]
A decision replays the step in the simulator once per candidate: adaptive keep once per K (17
times for a 16-block model), the chooser up to SEARCH_SIMS assignments (NOTE [Chooser]). That is
Python on the training thread, milliseconds a replay. On a CPU step of seconds it does not show;
on a GPU, whose step can take tens of milliseconds, a controller re-deciding after every stalled
step could cost about as much as the step itself. So decisions are paced (:class:`Cadence`): after
one that took d seconds, the next waits until the steps since have computed for at least
d / DECISION_SHARE seconds, whatever asks for it (the schedule, a drift, a stall). The first
decision waits for nothing, and neither does a controller (adaptive keep, or auto's chooser)
when a step went over TBA_MEMORY_BUDGET: a broken memory bound is not left standing to save
time.
"""

from __future__ import annotations

from ..host.clock import SYSTEM, Clock

__all__ = ["DECISION_SHARE", "DRIFT", "STALL_SHARE", "Cadence", "stalled_seconds"]

STALL_SHARE = 0.01  # a K is good enough when its predicted stall is at most this share of a step
DRIFT = 0.25  # re-decide when a bandwidth moves by more than this


def stalled_seconds(records) -> float:
    """A step's stalls from its group records: waits for reads, and packs waiting for a full
    staging (NOTE [Staging backpressure] in tba/datapath/capture/staging.py), which are not in any
    fwd_seconds."""
    return sum(x["stall_seconds"] + x.get("pack_stall_seconds", 0.0) for x in records)


DECISION_SHARE = 0.01  # most share of compute time decisions take (the NOTE)


class Cadence:
    """Spaces a controller's decisions (NOTE [Decision cost]). Each observed step calls
    :meth:`ready` with its compute seconds; a decision runs between :meth:`start` and
    :meth:`spent`."""

    def __init__(self, clock: Clock = SYSTEM):
        self.clock = clock
        self.owed = 0.0  # compute seconds to run before the next decision

    def ready(self, compute_seconds: float) -> bool:
        self.owed = max(0.0, self.owed - compute_seconds)
        return self.owed == 0.0

    def start(self) -> float:
        return self.clock()

    def spent(self, t0: float) -> float:
        """A decision begun at ``t0`` has ended; returns the seconds it took."""
        took = self.clock() - t0
        self.owed = took / DECISION_SHARE
        return took
