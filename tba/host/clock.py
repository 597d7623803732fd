"""The clocks tba's core reads: one host clock injected everywhere it measures, and on a device
a timeline of marks on the stream that runs the step (NOTE [Device clock]).

The Offloader takes the host clock at construction (``Offloader(config, clock=...)``, default
:data:`SYSTEM`) and hands it to every part that times something: the step (forward time), the
block tracker (each group's forward), both hooks (pack and unpack time), the Reader (stalls),
the shared I/O state (write and read spans), block recompute, staging backpressure (its deadline
too), and the controllers' decision pacing. No part of the core reads a clock of its own, so a
test that passes a fake clock drives every timer ``stats()`` reports.

Outside it, storage paces real I/O against real time: the rate caps' token buckets
(``tba.storage.ratelimit``, a clock of their own that tests also replace) and the native
engine's C clock. They measure no timer of ``stats()``.

# NOTE [Device clock]
On a GPU the host clock times kernel launches, not kernels: a block's forward "ends" when its
last kernel is queued, long before the device has run it. So where a step runs on a device,
the points that bound its compute (each group's forward start and end, its first and last
unpack, a recompute's start and end) are also marked on a :class:`Timeline`: CUDA events on the
current stream (``DeviceClock`` in tba/datapath/capture/device.py), taken from a pool. Marking
never waits. The step's times become device times only once every mark has passed, asked
without waiting (``passed``: the events' ``query()``), at the start of a later step; until then
the step is not shown to the controllers, which thus always see one kind of figure: device
seconds on a device, host seconds on the CPU (where there is no timeline and the host
readings are the times). Closing waits for the marks: it is not a step. Passed marks go back
to the pool, so a steady run makes no events. The copies to and from the device are timed the
same way, by an event before and after each on the side stream, read once the copy is known
done (tba/datapath/capture/device.py, NOTE [Copy timing]).

Host durations stay host durations: what the hooks spend (pack and unpack seconds), stalls and
staging waits are the host's time, and are subtracted from device spans as they are on the
host (a host stall starves the device about as long).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["SYSTEM", "Clock", "Timeline"]

Clock = Callable[[], float]  # seconds, monotonic; differences are what matter

SYSTEM: Clock = time.perf_counter


class Timeline(Protocol):
    """Marks on the stream a step's compute runs on, read as seconds once they have passed
    (NOTE [Device clock]). Marks are opaque; any thread may mark."""

    def mark(self, again: Any = None) -> Any:
        """A mark of this point of the stream: a new one, or ``again`` moved here."""
        ...

    def passed(self, marks: Sequence[Any]) -> bool:
        """Whether the stream has passed every one of ``marks``; never waits."""
        ...

    def wait(self, marks: Sequence[Any]) -> None:
        """Wait until every one of ``marks`` has passed (only where no step runs: close)."""
        ...

    def elapsed(self, a: Any, b: Any) -> float:
        """Seconds from mark ``a`` to mark ``b``, both passed."""
        ...

    def release(self, marks: Sequence[Any]) -> None:
        """``marks`` (passed, read) are free to be marked again."""
        ...
