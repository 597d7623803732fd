"""The backend tba would use here, and its write and read rates (NOTE [Doctor] 3)."""

from __future__ import annotations

import collections
import concurrent.futures
import math
import os
import time
from concurrent.futures import Future

import numpy as np

from ..config import Config, format_size
from ..host.memory import align_up, aligned_empty, as_memoryview
from ..storage import open_backend
from .report import EXTENT_BYTES, GIB, MIB, SWEEP
from .state import Run, _ProbeFailed, _strip_prefix, _why

_SLOW_GIB_S = 0.5  # below this a measured rate gets a warning (a SATA SSD does about 0.5)


# -- backend and throughput -------------------------------------------------------------
def _probe_cfg(d: Run, backend: str) -> Config:
    # One slab holds the whole probe; no quota and no free-space floor (free space was
    # checked against the probe size above); enough threads for the widest sweep.
    fields = d.cfg.as_dict()
    fields.update(
        backend=backend,
        slab_bytes=max(MIB, d.probe_total()),
        max_disk_bytes=None,
        min_free_bytes=0,
        io_threads=max(d.cfg.io_threads, max(SWEEP)),
        io_depth=max(d.cfg.io_depth, max(SWEEP)),
    )
    return Config(environ={}, **fields)


def _open(d: Run, name: str):
    b = open_backend(_probe_cfg(d, name))
    path = getattr(b, "spill_path", None)
    if path:
        d.made_dirs.append(path)
    return b


def check_backend(d: Run):
    """Open auto (and the requested backend if another); return the one to measure."""
    facts = d.facts["backend"]
    requested = d.cfg.backend
    auto = None
    try:
        auto = _open(d, "auto")
        facts.update(auto=auto.name, auto_reason=auto.reason)
    except Exception as e:  # a broken backend module must not stop the doctor
        facts["auto_reason"] = _why(e)
        if requested == "auto":
            facts["error"] = _why(e)
            d.set("backend", "FAIL", f"auto: {_why(e)}")
            _no_backend(d)
            return None
    if requested == "auto":
        b = auto
        detail = f"auto picks {b.name}: {_strip_prefix(b.reason).removeprefix('auto: ')}"
    else:
        if auto is not None:
            auto.close()
        try:
            b = _open(d, requested)
        except Exception as e:
            facts["error"] = _why(e)
            d.set("backend", "FAIL", f"TBA_BACKEND={requested}: {_why(e)}")
            _no_backend(d)
            return None
        reason = _strip_prefix(b.reason).removeprefix(f"TBA_BACKEND={requested}: ")
        detail = f"{b.name} (TBA_BACKEND={requested}; auto would pick {facts['auto']}): {reason}"
    facts.update(name=b.name, reason=b.reason, alignment=b.alignment)
    if b.name == "buffered":
        d.set(
            "backend",
            "warn",
            f"{detail}. O_DIRECT does not work here, so spill I/O goes through the page cache.",
        )
    elif b.name == "memory":
        d.set("backend", "warn", f"{detail}. Nothing is written to disk.")
    else:
        d.set("backend", "ok", detail)
    return b


def _no_backend(d: Run) -> None:
    d.set("write", "skip", "no backend to measure")
    d.set("read", "skip", "no backend to measure")


def measure(d: Run, backend) -> None:
    t = d.facts["throughput"]
    align = backend.alignment
    # Whole 4 KiB blocks, for the tags (see NOTE 3).
    extent = min(EXTENT_BYTES, align_up(d.probe_bytes, max(align, 4096)))
    count = math.ceil(d.probe_bytes / extent)
    total = count * extent
    native = backend.name == "native"
    configured = d.cfg.io_depth if native else d.cfg.io_threads
    nbufs = min(max(SWEEP), count)
    window = max(1, min(configured, nbufs))
    t.update(bytes=total, extent_bytes=extent, extents=count, in_flight=window)
    extents = []
    try:
        for _ in range(count):
            e = backend.allocate(extent)
            if e is None:
                why = backend.refusal_detail or f"quota or free space: {backend.usage()}"
                raise _ProbeFailed(
                    f"could not allocate {format_size(extent)} for the probe ({backend.refusal}): "
                    f"{why}"
                )
            extents.append(e)
        tensors = [aligned_empty(extent, align) for _ in range(nbufs)]
        for x in tensors:
            x.random_(0, 256)
        bufs = [as_memoryview(x) for x in tensors]
        tag = int.from_bytes(os.urandom(8), "little") | 1
        dt = _pass(backend, extents, bufs, window, True, tag)
        t.update(write_gib_s=round(total / dt / GIB, 3), write_seconds=round(dt, 3))
        sweep = sorted({w for w in SWEEP if w <= nbufs} | {window})
        rates: dict[int, float] = {}
        for w in sweep:
            dt_r = _pass(backend, extents, bufs, w, False, tag)
            rates[w] = total / dt_r / GIB
            if w == window:
                t.update(read_gib_s=round(rates[w], 3), read_seconds=round(dt_r, 3))
        t["read_sweep_gib_s"] = {str(w): round(r, 3) for w, r in rates.items()}
    except Exception as e:  # StorageError, _ProbeFailed, or a backend's own bug
        t["error"] = _why(e)
        done = "write" if t["write_gib_s"] is None else "read"
        d.set(done, "FAIL", f"probe failed: {_why(e)}")
        if done == "write":
            d.set("read", "skip", "the write probe failed")
        return
    finally:
        for e in extents:
            backend.free(e)
    how = f"{format_size(total)} in {count} x {format_size(extent)}, {window} in flight"
    w_rate, r_rate = t["write_gib_s"], t["read_gib_s"]
    d.set(
        "write",
        _rate_status(w_rate),
        f"{w_rate:.2f} GiB/s: {how}, {t['write_seconds']:.2f} s (first write into "
        "preallocated space)" + _slow_note(w_rate),
    )
    source = (
        "from the device (O_DIRECT)"
        if getattr(backend, "direct", False) or backend.name in ("native", "kvikio")
        else "partly from the page cache"
        if backend.name == "buffered"
        else "from host memory"
    )
    sweep_s = ", ".join(f"{w}: {r:.2f}" for w, r in rates.items())
    d.set(
        "read",
        _rate_status(r_rate),
        f"{r_rate:.2f} GiB/s: {how}, {t['read_seconds']:.2f} s, {source}; GiB/s by requests "
        f"in flight: {sweep_s}" + _slow_note(r_rate),
    )


def _rate_status(rate: float) -> str:
    return "warn" if rate < _SLOW_GIB_S else "ok"


def _slow_note(rate: float) -> str:
    if rate >= _SLOW_GIB_S:
        return ""
    return f"; slow for offload: each GiB takes {1 / max(rate, 1e-9):.1f} s"


def _pass(backend, extents, bufs, window: int, write: bool, tag: int) -> float:
    """Seconds to write (or read and verify) every extent, ``window`` requests in flight."""
    inflight: collections.deque[tuple[Future, int]] = collections.deque()

    def finish() -> None:
        fut, i = inflight.popleft()
        fut.result()
        if not write and not _tag_ok(bufs[i % window], tag, i):
            raise _ProbeFailed(
                f"extent {i} read back other bytes than were written to it (stale or misplaced "
                "blocks): do not trust this filesystem with spill files"
            )

    t0 = time.perf_counter()
    try:
        for i, ext in enumerate(extents):
            if len(inflight) == window:
                finish()
            buf = bufs[i % window][: ext.length]
            if write:
                _tag(buf, tag, i)
                inflight.append((backend.write(ext, buf), i))
            else:
                inflight.append((backend.read(ext, buf), i))
        while inflight:
            finish()
    finally:
        # Never free extents or buffers under I/O still in flight. wait() raises nothing: what
        # those requests end with does not matter once the pass has failed with the first error.
        concurrent.futures.wait([fut for fut, _ in inflight])
    return time.perf_counter() - t0


def _tags(buf: memoryview) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint64).reshape(-1, 512)  # one row per 4 KiB block


def _expected(tag: int, index: int, blocks: int) -> tuple[int, np.ndarray]:
    return tag, (np.uint64(index) << np.uint64(32)) | np.arange(blocks, dtype=np.uint64)


def _tag(buf: memoryview, tag: int, index: int) -> None:
    rows = _tags(buf)
    first, second = _expected(tag, index, len(rows))
    rows[:, 0] = first
    rows[:, 1] = second


def _tag_ok(buf: memoryview, tag: int, index: int) -> bool:
    rows = _tags(buf)
    first, second = _expected(tag, index, len(rows))
    return bool((rows[:, 0] == np.uint64(first)).all() and np.array_equal(rows[:, 1], second))
