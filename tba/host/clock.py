"""The clock tba's core reads: one callable returning seconds, injected everywhere it measures.

The Offloader takes it at construction (``Offloader(config, clock=...)``, default
:data:`SYSTEM`) and hands it to every part that times something: the step (forward time), the
block tracker (each group's forward), both hooks (pack and unpack time), the Reader (stalls),
the shared I/O state (write and read spans), block recompute, staging backpressure (its deadline
too), and the controllers' decision pacing. No part of the core reads a clock of its own, so a
test that passes a fake clock drives every timer ``stats()`` reports.

Outside it, storage paces real I/O against real time: the rate caps' token buckets
(``tba.storage.ratelimit``, a clock of their own that tests also replace) and the native
engine's C clock. They measure no timer of ``stats()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["SYSTEM", "Clock"]

Clock = Callable[[], float]  # seconds, monotonic; differences are what matter

SYSTEM: Clock = time.perf_counter
