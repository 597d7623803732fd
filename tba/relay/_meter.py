"""What the relay counts: bytes moved per step, bytes held now and at the peak, waits.

The relay's threads (fetch, update, I/O callbacks) all report here, so every method takes the
lock. ``hold``/``drop`` track the bytes the relay itself holds, by kind; their sum's peak is
``peak_working_bytes`` (see NOTE [Working bytes]).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

__all__ = ["COUNTERS", "KINDS", "Meter"]

# NOTE [Working bytes]
# ``peak_working_bytes`` is the most bytes that these kinds held at once during a step:
#   weights   layer weight buffers fetched and not yet released (read-ahead included)
#   state     optimizer state loaded from the SSD for a layer's update
#   grads     gradients of a layer handed to its optimizer step and not yet applied
#   stash     layer inputs kept for the backward (memory stash), or their staging and read-back
#             buffers (SSD stash), or the activations the kept graphs save (recompute=False)
#   boundary  tensors passed between layers and held outside the stash: forward outputs
#             waiting for the next layer (SSD stash) and input gradients waiting for the layer
#             below
# It does not include the temporaries inside one layer's forward or backward on one
# micro-batch (bounded by one layer, whatever the depth), the EPS's host-tier copy of the
# model and its optimizer state (``eps_host_bytes``), or the process's own baseline. Peak RSS is
# measured, not tracked, by benchmarks/bench_relay.py.
KINDS = ("weights", "state", "grads", "stash", "boundary")

COUNTERS = (
    "weight_bytes_moved",  # weights delivered to the executing layer (forward and backward)
    "grad_bytes_moved",  # gradients handed to the EPS for the optimizer step
    "weight_bytes_written",  # SSD tier: updated weights written back
    "state_bytes_read",  # SSD tier: optimizer state read for the update
    "state_bytes_written",  # SSD tier: optimizer state written back
    "stash_bytes",  # bytes stashed for the backward (layer inputs, or saved activations)
    "stash_bytes_written",  # SSD stash: written
    "stash_bytes_read",  # SSD stash: read back
    "stash_sync_reads",  # SSD stash: reads not issued ahead of their use
    "fetches",  # layer weight fetches
    "updates",  # layer optimizer steps
)

_SECONDS = (
    "fetch_wait_seconds",  # the compute thread waited for a layer's weights
    "update_wait_seconds",  # ... for a free optimizer-step slot, and at the step's end
    "stash_wait_seconds",  # ... for the SSD stash (staging full, or a read not back yet)
    "update_seconds",  # time spent in optimizer steps (on the update worker, with workers)
)


class Meter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = dict.fromkeys(KINDS, 0)
        self._peak = 0
        self._peak_by_kind = dict.fromkeys(KINDS, 0)
        self._count = dict.fromkeys(COUNTERS + _SECONDS, 0)

    def hold(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self._held[kind] += nbytes
            total = sum(self._held.values())
            if total > self._peak:
                self._peak = total
                self._peak_by_kind = dict(self._held)

    def drop(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self._held[kind] -= nbytes

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._count[k] += v

    @contextmanager
    def waiting(self, key: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(**{key: time.perf_counter() - t0})

    def start_step(self) -> None:
        """Zero the per-step counters; the peak restarts from what is held now."""
        with self._lock:
            self._count = dict.fromkeys(self._count, 0)
            self._peak = sum(self._held.values())
            self._peak_by_kind = dict(self._held)

    def snapshot(self) -> dict:
        with self._lock:
            out: dict = dict(self._count)
            out["peak_working_bytes"] = self._peak
            out["peak_working_by_kind"] = dict(self._peak_by_kind)
            out["working_bytes"] = sum(self._held.values())
        out["stall_seconds"] = (
            out["fetch_wait_seconds"] + out["update_wait_seconds"] + out["stash_wait_seconds"]
        )
        return out
