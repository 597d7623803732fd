"""``TBA_TRACE=path.jsonl``: one JSON object per line, appended as steps complete.

Format (version 1), documented in docs/observability.md ("Trace"):

- ``{"type": "meta", "version": 1, "pid", "rank", "backend", "backend_reason", "config"}``,
  once per Offloader;
- per group of a step whose backward has run, in forward order: ``{"type": "group", "step",
  "group", "kept", "action", "input_bytes", "hidden_bytes", "recompute_seconds",
  "pack_seconds", "pack_stall_seconds", "unpack_seconds", "cached_bytes", "cacheable_bytes",
  "tensors", "packed_bytes", "offloaded_bytes", "kept_bytes", "keepable_bytes", "fwd_seconds",
  "bwd_seconds", "write_seconds", "read_seconds", "stall_seconds", "sync_loads"}``;
- then ``{"type": "step", "step", "forward_seconds", "backward_seconds", "step_seconds",
  "saved_bytes", "peak_resident_bytes", "bytes_offloaded", "bytes_reloaded", "stall_seconds",
  "sync_loads", "write_bps", "read_bps", "keep_last", "keep_decision", "group_policy",
  "recomputed_groups", "policy_decision"}``.

A step is written when the next step starts (its backward is over by then) or at ``close()``.
Times are seconds; ``write_bps``/``read_bps`` are bytes per second while I/O was in flight
(null when there was none).
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import ConfigError


class TraceWriter:
    def __init__(self, path: str, meta: dict[str, Any]):
        try:
            self._f = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        except OSError as e:
            raise ConfigError(
                f"TBA_TRACE={path} cannot be opened for appending ({os.strerror(e.errno or 0)}). "
                "Point it at a writable file, or unset it."
            ) from e
        self.path = path
        self._write({"type": "meta", "version": 1, **meta})

    def _write(self, obj: dict[str, Any]) -> None:
        self._f.write(json.dumps(obj, default=str) + "\n")

    def step(self, index: int, groups: list[dict[str, Any]], summary: dict[str, Any]) -> None:
        for g in groups:
            self._write({"type": "group", "step": index, **g})
        self._write({"type": "step", "step": index, **summary})
        self._f.flush()

    def close(self) -> None:
        self._f.close()
