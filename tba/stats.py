"""Per-step state and counters. A new `StepState` starts with every ``Offloader.step()``.

Work done during a step's backward (reloads, stalls) is credited to the step that packed the
tensor, so two graphs alive at once (gradient accumulation) never mix their numbers.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from torch.multiprocessing.reductions import StorageWeakRef

# The keys ARCHITECTURE.md pins, in its order.
PINNED_KEYS = (
    "saved_bytes",
    "bytes_offloaded",
    "bytes_reloaded",
    "tensors_offloaded",
    "tensors_kept",
    "dedup_hits",
    "forwarded",
    "sync_loads",
    "stall_seconds",
    "peak_resident_bytes",
    "disk_bytes_in_use",
)


class StepState:
    """Counters and the prefetch plan of one step."""

    def __init__(self, index: int):
        self.index = index
        self.started = time.perf_counter()
        self.forward_seconds = 0.0
        self.saved_bytes = 0
        self.bytes_offloaded = 0
        self.bytes_reloaded = 0
        self.tensors_offloaded = 0
        self.tensors_kept = 0
        self.kept_reasons: Counter[str] = Counter()
        self.dedup_hits = 0
        self.forwarded = 0
        self.sync_loads = 0
        self.stall_seconds = 0.0
        self.peak_resident_bytes = 0
        self.peak_disk_bytes = 0
        self.io_errors = 0
        self.groups = 0
        self.kept_groups = 0
        self.packs = 0
        self.coalesced_tensors = 0  # offloaded tensors that went into a batch (NOTE [Coalescing])
        self.coalesced_writes = 0  # batch writes issued
        self.seen: dict[int, StorageWeakRef] = {}  # storages counted in saved_bytes
        self.entries: list[Any] = []  # offloaded entries, for the prefetch plan
        self.plan: list[Any] | None = None
        self.cursor = 0

    def see(self, storage: Any, cdata: int, nbytes: int) -> None:
        """Count a storage once per step in ``saved_bytes`` (the baseline's residency)."""
        if cdata not in self.seen:
            self.seen[cdata] = StorageWeakRef(storage)
            self.saved_bytes += nbytes

    def keep(self, reason: str) -> None:
        self.tensors_kept += 1
        self.kept_reasons[reason] += 1

    def snapshot(self, disk_bytes_in_use: int) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in PINNED_KEYS[:-1]}
        out["disk_bytes_in_use"] = disk_bytes_in_use
        out.update(
            step=self.index,
            packs=self.packs,
            kept_reasons=dict(self.kept_reasons),
            peak_disk_bytes=self.peak_disk_bytes,
            io_errors=self.io_errors,
            groups=self.groups,
            kept_groups=self.kept_groups,
            coalesced_tensors=self.coalesced_tensors,
            coalesced_writes=self.coalesced_writes,
            forward_seconds=self.forward_seconds,
        )
        return out

    def finish_forward(self) -> None:
        self.forward_seconds = time.perf_counter() - self.started
        self.seen.clear()  # release the weak references; saved_bytes is final
