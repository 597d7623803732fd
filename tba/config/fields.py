"""The table of ``tba.Config``'s fields: per field its ``TBA_*`` variable, parser, default and
help text (tba/config/__init__.py reads them; the parsers are in tba/config/values.py)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from .values import (
    POLICIES,
    _block_policy,
    _bool,
    _choice,
    _keep,
    _optional_file,
    _optional_path,
    _optional_rank,
    _path,
    _quota,
    parse_budget,
    parse_host_bytes,
    parse_rate,
    parse_seconds,
    parse_size,
    parse_slowdown,
    parse_tbw,
    size_at_least,
    whole_number,
)

__all__ = ["BACKENDS", "CHECKSUMS", "LOG_LEVELS"]

BACKENDS = ("auto", "native", "posix", "kvikio", "buffered", "memory")
CHECKSUMS = ("auto", "off", "xxh3", "crc32", "crc32c", "xxh64")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _default_spill_dir() -> str:
    # /var/tmp is disk-backed on common distributions, unlike /tmp, which is often tmpfs.
    return f"/var/tmp/tba-{os.getuid()}"


@dataclasses.dataclass(frozen=True)
class _Field:
    env: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    fallback_env: tuple[str, ...] = ()


_FIELDS: dict[str, _Field] = {
    "enabled": _Field(
        "TBA_ENABLED", _bool, True, "Master switch. 0 turns every tba entry point into a no-op."
    ),
    "spill_dir": _Field(
        "TBA_SPILL_DIR",
        _path,
        None,
        "Root directory for spill files, on a local NVMe drive (not tmpfs). tba makes a 0700 "
        "sub-directory per process inside it. Default: /var/tmp/tba-<uid>.",
    ),
    "backend": _Field(
        "TBA_BACKEND",
        _choice(BACKENDS),
        "auto",
        "I/O backend. 'auto' probes each with a real write and read and takes the first that "
        "works; naming one forces it, or fails with the probe's reason.",
    ),
    "min_offload_bytes": _Field(
        "TBA_MIN_OFFLOAD_BYTES",
        parse_size,
        1 << 20,
        "Saved tensors smaller than this stay in memory: tiny I/Os cost more than they save.",
    ),
    "io_threads": _Field(
        "TBA_IO_THREADS",
        whole_number(1),
        4,
        "Threads issuing reads and writes. More gives more requests in flight on the drive.",
    ),
    "io_depth": _Field(
        "TBA_IO_DEPTH",
        whole_number(1),
        32,
        "Requests the native engine keeps in flight (its io_uring queue depth, or its thread "
        "count when io_uring is unavailable).",
    ),
    "gds_task_bytes": _Field(
        "TBA_GDS_TASK_BYTES",
        size_at_least(4096),
        8 << 20,
        "kvikio backend: each read or write is split into tasks of this size, spread over "
        "TBA_IO_THREADS threads.",
    ),
    "coalesce_bytes": _Field(
        "TBA_COALESCE_BYTES",
        parse_size,
        1 << 20,
        "Offloaded tensors smaller than this are packed together, per group, into one aligned "
        "extent and written with one request. 0 turns coalescing off.",
    ),
    "staging_bytes": _Field(
        "TBA_STAGING_BYTES",
        size_at_least(1 << 20),
        256 << 20,
        "Size of the aligned (pinned on CUDA) staging pool; on the CPU it also bounds the "
        "tensors held for a write from their own memory. When it is full, new tensors stay "
        "resident rather than block the forward pass; they are counted in tensors_kept.",
    ),
    "prefetch_bytes": _Field(
        "TBA_PREFETCH_BYTES",
        size_at_least(1 << 20),
        128 << 20,
        "Most bytes of reads in flight, or read back and not yet used, during backward.",
    ),
    "device_prefetch_bytes": _Field(
        "TBA_DEVICE_PREFETCH_BYTES",
        parse_size,
        256 << 20,
        "CUDA: most bytes of read-back tensors copied to the device ahead of their unpack and "
        "not yet used (H2D on a side stream, in backward's order). 0: copy each at its unpack.",
    ),
    "staging_full": _Field(
        "TBA_STAGING_FULL",
        _choice(("keep", "wait")),
        "keep",
        "What a pack does when staging (TBA_STAGING_BYTES) is full: 'keep' the tensor resident "
        "(no wait; counted in kept_reasons['staging_full']), or 'wait' for writes to free "
        "staging, at most TBA_STAGING_WAIT seconds, so the memory cap holds (counted as stall). "
        "Left unset, it is 'wait' when a memory budget bounds the step (TBA_MEMORY_BUDGET, or "
        "TBA_POLICY=auto).",
    ),
    "staging_wait": _Field(
        "TBA_STAGING_WAIT",
        parse_seconds,
        10.0,
        "With TBA_STAGING_FULL=wait: the longest one pack waits for staging. After a timeout the "
        "tensor is kept and the rest of the step keeps without waiting.",
    ),
    "keep_last": _Field(
        "TBA_KEEP_LAST",
        _keep,
        "auto",
        "The last K groups (blocks) of the forward stay resident: backward needs them first. "
        "'auto' (default) chooses K from the measured compute time and disk bandwidth, so "
        "writes finish and reads arrive in time; a number fixes it (0 keeps none).",
    ),
    "policy": _Field(
        "TBA_POLICY",
        _choice(POLICIES),
        "offload",
        "What happens to each block's saved tensors (NOTE [Block policy] in "
        "tba/datapath/blocks/recompute.py). "
        "offload (default, today's behaviour): written to disk, the last TBA_KEEP_LAST blocks "
        "kept; recompute: every block runs under activation checkpointing, chosen at run time; "
        "keep: nothing written; selective: recomputed but for the matrix products (NOTE "
        "[Selective recompute]); auto: one of these per block, chosen from "
        "measured compute time, bandwidth and the memory budget (NOTE [Chooser]).",
    ),
    "max_slowdown": _Field(
        "TBA_MAX_SLOWDOWN",
        parse_slowdown,
        1.05,
        "Without TBA_MEMORY_BUDGET: how much slower than keeping everything in memory a step may "
        "run, e.g. 1.05 (default: 5%). tba then frees the most memory it can within that, from "
        "measured compute and bandwidth, and keeps everything when nothing else is fast enough. "
        "With a budget, the budget rules and this is not used.",
    ),
    "block_policy": _Field(
        "TBA_BLOCK_POLICY",
        _block_policy,
        None,
        "Force the action of some blocks, whatever TBA_POLICY chooses: a list in block order, "
        "e.g. recompute,offload,recompute, or index:action pairs, e.g. 0:recompute,5:keep. "
        "Blocks not named follow TBA_POLICY. For tests and experiments.",
    ),
    "memory_budget": _Field(
        "TBA_MEMORY_BUDGET",
        parse_budget,
        None,
        "Most bytes of saved tensors tba may hold in memory during a step, the read-ahead "
        "window and kept blocks included: a size such as 2GiB, or a fraction of the step's "
        "saved bytes such as 0.35. 'none' (default): tba keeps what adaptive keep chooses and "
        "sizes the read-ahead window from the step's saved bytes.",
    ),
    "host_bytes": _Field(
        "TBA_HOST_BYTES",
        parse_host_bytes,
        0.5,
        "Host tier on a CUDA host: offloaded bytes go to pinned host memory first and to the "
        "spill disk only for what it cannot hold (the earliest blocks). A fraction of the memory "
        "the node can spare at start (MemAvailable, within the cgroup's limit), such as 0.5 "
        "(default), or a size such as 64GiB; either is shared by the node's ranks. 0 or 'off': "
        "no host tier. A size beyond what the node can spare is refused at start.",
    ),
    "max_disk_bytes": _Field(
        "TBA_MAX_DISK_BYTES",
        _quota,
        None,
        "Quota on the spill files of this process, e.g. 100GiB. 'none' (default) means only the "
        "free-space check applies. Over quota, tensors stay in memory and are counted.",
    ),
    "node_max_disk_bytes": _Field(
        "TBA_NODE_MAX_DISK_BYTES",
        _quota,
        None,
        "Node-wide quota on the spill files of all tba processes sharing a spill root, e.g. "
        "2TiB, kept in a shared file under flock. Over it, tensors stay in memory and are counted.",
    ),
    "ssd_tbw": _Field(
        "TBA_SSD_TBW",
        parse_tbw,
        None,
        "Rated endurance of the spill drive in terabytes written (TBW), e.g. 3500; the sidecar "
        "then projects days left at the current write rate (tba_ssd_projected_days_left).",
    ),
    "min_free_bytes": _Field(
        "TBA_MIN_FREE_BYTES",
        parse_size,
        1 << 30,
        "Free space tba leaves on the spill filesystem for everything else.",
    ),
    "slab_bytes": _Field(
        "TBA_SLAB_BYTES",
        size_at_least(1 << 20),
        1 << 30,
        "Size of each preallocated spill file. Extents inside slabs are reused.",
    ),
    "group_bytes": _Field(
        "TBA_GROUP_BYTES",
        size_at_least(1 << 20),
        64 << 20,
        "Without a model to take blocks from, a new group starts every this many packed bytes.",
    ),
    "recompute_weights": _Field(
        "TBA_RECOMPUTE_WEIGHTS",
        _bool,
        True,
        "Saved tensors computed from a parameter alone by a cast or a copy and views (the bf16 "
        "weight casts autocast saves) are recomputed from the parameter in backward instead of "
        "written; an in-place change of that parameter before backward then raises. 0: offload "
        "them like any other saved tensor.",
    ),
    "checksum": _Field(
        "TBA_CHECKSUM",
        _choice(CHECKSUMS),
        "auto",
        "Verify every read against a checksum taken at write time, so corruption on disk "
        "raises instead of becoming a wrong gradient. auto takes the fastest installed: xxh3 "
        "(xxhash, a dependency), else crc32c (google-crc32c), else crc32 (zlib), for the disk; "
        "naming one verifies the host tier's memory too. off: none.",
    ),
    "max_write_bps": _Field(
        "TBA_MAX_WRITE_BPS",
        parse_rate,
        None,
        "Cap on spill write bandwidth, e.g. 300MB/s (a token bucket in the backend): leaves the "
        "drive to data loading and checkpoints, limits wear, emulates a slower disk. 0: no cap.",
    ),
    "max_read_bps": _Field(
        "TBA_MAX_READ_BPS",
        parse_rate,
        None,
        "Cap on spill read bandwidth, e.g. 1GB/s (a token bucket in the backend). 0: no cap.",
    ),
    "trace": _Field(
        "TBA_TRACE",
        _optional_file,
        None,
        "Append a JSON-lines trace here: per step and group, bytes packed, offloaded and kept, "
        "forward and backward compute time, write and read times, stalls (docs/observability.md).",
    ),
    "metrics_dir": _Field(
        "TBA_METRICS_DIR",
        _optional_path,
        None,
        "Directory for prometheus-client multiprocess files, served by `tba sidecar`.",
    ),
    "log_level": _Field(
        "TBA_LOG_LEVEL",
        _choice(LOG_LEVELS, upper=True),
        "WARNING",
        "Level of the 'tba' logger.",
    ),
    "rank": _Field(
        "TBA_RANK",
        _optional_rank,
        None,
        "Rank used in logs, directory names and metrics. Default: $RANK, else 0.",
        fallback_env=("RANK",),
    ),
}
