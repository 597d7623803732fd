"""Why a saved tensor stays in memory: the keys of ``stats()["kept_reasons"]`` (and the
``reason`` label of ``tba_tensors_kept``), and how a spill-file errno maps onto them. No torch
here: the metrics and the sidecar read this too.

NOTE [Counted once]
Every saved tensor tba counts (``packs``: all but parameters and their views) ends up in
exactly one of ``tensors_offloaded`` (its bytes reached the disk: counted when its write
completes, so a step's numbers can still grow after its forward, like ``bytes_reloaded``),
``tensors_kept`` (with one reason below), ``dedup_hits`` (the same bytes saved again), or
``recomputed_tensors`` (derived from a parameter alone, rebuilt at unpack and never held:
NOTE [Weight-derived tensors] in tba/datapath/capture/derived.py).
Until its writes have completed, a step has ``unsettled`` entries; the metrics keep
following it until there are none (NOTE [Metrics] in tba/metrics/__init__.py).
"""

from __future__ import annotations

import errno as _errno

KEPT_REASONS = {
    "small": "it would retain fewer than TBA_MIN_OFFLOAD_BYTES",
    "unsupported": "not a plain strided CPU or CUDA tensor (sparse, nested, meta, quantized)",
    "subclass": "a tensor subclass other than DTensor (e.g. Float8Tensor): kept, with a warning",
    "group": "it belongs to one of the last TBA_KEEP_LAST blocks, which backward needs first",
    "recompute": "an input of a block tba recomputes in backward (checkpointing keeps it)",
    "compiled": "saved by a torch.compile region that encloses the model's blocks: all of them "
    "exist at once when it ends, so writing them would not lower the peak",
    "staging_full": "the staging budget (TBA_STAGING_BYTES) was full",
    "quota": "the per-process quota TBA_MAX_DISK_BYTES refused space",
    "disk_full": "the filesystem is full, or below the TBA_MIN_FREE_BYTES floor",
    "node_quota": "the node-wide quota TBA_NODE_MAX_DISK_BYTES is used up by the node's ranks",
    "spill_dir_gone": "the spill directory was removed while tba ran (ENOENT)",
    "permission": "the spill directory refused access (EACCES, EPERM)",
    "read_only": "the spill filesystem is read-only (EROFS)",
    "io_error": "a write failed with an I/O error",
    "resized": "its storage was resized while written, so it is kept as PyTorch reads it",
    "modified": "it was modified in place while captured: nothing was written, unpack raises",
    "dropped": "its graph was dropped before its write started",
}


def kept_reason_for(err: int | None) -> str:
    """The ``stats()["kept_reasons"]`` key for a spill file error with this errno."""
    if err in (_errno.ENOSPC, _errno.EDQUOT):
        return "disk_full"
    if err in (_errno.ENOENT, _errno.ENOTDIR, _errno.ESTALE):
        return "spill_dir_gone"
    if err in (_errno.EACCES, _errno.EPERM):
        return "permission"
    if err == _errno.EROFS:
        return "read_only"
    return "io_error"
