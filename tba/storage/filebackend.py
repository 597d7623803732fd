"""The shared machinery of the slab-backed backends (posix, buffered).

NOTE [Transfers]
1. Every transfer is checked: a short ``pwrite``/``preadv`` is resubmitted for the remainder
   (from the last DIO-aligned byte under O_DIRECT, which rewrites or rereads a few bytes but keeps
   every request aligned), EAGAIN is retried a few times, and any other failure becomes a
   :class:`StorageError` naming the file, absolute offset, byte count and errno.
2. A read that returns 0 bytes (end of file) is an error: a failed read never yields zeros.
3. The syscalls are instance attributes (``_pwrite``, ``_preadv``, ``_fallocate``,
   ``_statvfs``), looked up on every call, so a test can inject short transfers and errors.
4. Checksums run on the I/O thread: ``write`` resolves to the digest, ``read`` checks ``expect``.
5. Bandwidth caps (NOTE [Rate caps] in ratelimit.py): a capped direction's ops wait for their
   tokens in that direction's :class:`Pacer`, which then hands them to the pool; ``write`` and
   ``read`` never wait, and the pool threads never sleep on tokens.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..config import Config
from ..errors import StorageError, hint_for
from ..host.memory import address_of, aligned_empty, as_memoryview
from .base import Extent, Span
from .checksum import Digest, checksum_fn, digest_for, mismatch_hint
from .nodequota import NodeQuota
from .ratelimit import DIRECTIONS, Pacer, TokenBucket, check_burst, check_rate, describe_caps
from .slab import Slab, SlabSet, open_unnamed
from .spilldir import SpillDir
from .statx import dio_alignment, fs_type, io_alignment

__all__ = ["SlabBackend"]

_MAX_AGAIN = 16  # EAGAIN retries before giving up
_MAX_STALLS = 8  # consecutive transfers that make no progress before giving up
_STAT_KEYS = ("bytes_written", "bytes_read", "writes", "reads", "io_errors", "checksum_errors")


def _release(
    pool: ThreadPoolExecutor,
    slabs: SlabSet,
    spill: SpillDir,
    limits: tuple[tuple[TokenBucket, Pacer], ...] = (),
) -> None:
    for bucket, pacer in limits:
        bucket.drain()  # ops waiting for tokens go now, not at the capped rate
        pacer.close(wait=False)
    pool.shutdown(wait=False)
    slabs.close()
    spill.close()


class SlabBackend:
    """Slab files in a per-process spill directory, served by a thread pool."""

    name = "slab"
    direct = True
    mode = "O_DIRECT"
    device_direct = False  # host buffers only (kvikio with GDS takes device tensors)

    def __init__(self, cfg: Config):
        self.reason = ""
        checksum_fn(cfg.checksum)  # a missing checksum package is a startup error, not a late one
        self._pwrite = os.pwrite
        self._preadv = os.preadv
        self._fallocate = os.posix_fallocate
        self._statvfs = os.statvfs
        self._stats = dict.fromkeys(_STAT_KEYS, 0)
        self._stats_lock = threading.Lock()
        self._closed = False
        # Per direction: the cap in force as (bytes per second, burst), None when uncapped; the
        # token bucket and the pacer (made with the pool) that apply it. The native engine
        # applies caps itself and leaves these two unused.
        self._caps: dict[str, tuple[int, int] | None] = dict.fromkeys(DIRECTIONS)
        self._buckets = {op: TokenBucket() for op in DIRECTIONS}
        self._spill = SpillDir(cfg.spill_dir, cfg.rank)
        node = None
        try:
            self.dio, self.alignment = self._probe()
            self.fs = fs_type(self._spill.path)
            if cfg.node_max_disk_bytes is not None:  # NOTE [Node quota] in nodequota.py
                sp = self._spill
                node = NodeQuota(sp.root_fd, sp.root, sp.name, cfg.node_max_disk_bytes, cfg.rank)
        except BaseException:
            self._spill.close()
            raise
        # Resubmit short direct transfers from a multiple of the device's own DIO unit.
        self._unit = max(self.dio) or self.alignment
        self._slabs = SlabSet(
            self._spill.fd,
            self._spill.path,
            self.direct,
            self.alignment,
            cfg.slab_bytes,
            cfg.max_disk_bytes,
            cfg.min_free_bytes,
            node,
        )
        self._pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="tba-io")
        self._pacers = {
            op: Pacer(self._buckets[op], self._pool, f"tba-{op}-pacer") for op in DIRECTIONS
        }
        limits = tuple((self._buckets[op], self._pacers[op]) for op in DIRECTIONS)
        # Closes files and removes the directory if the backend is dropped without close().
        self._finalizer = weakref.finalize(
            self, _release, self._pool, self._slabs, self._spill, limits
        )
        for op, bps in (("write", cfg.max_write_bps), ("read", cfg.max_read_bps)):
            if bps:
                self._caps[op] = self._apply_rate(op, bps, None)
        self.reason = f"{self.name}: {self.probe_summary()}"

    @property
    def refusal(self) -> str:
        """Why the last ``allocate`` that returned None refused, as a kept reason
        (NOTE [Slabs] 5 in slab.py)."""
        return self._slabs.last_refusal or "disk_full"

    @property
    def refusal_detail(self) -> str:
        """What refused, with the numbers or the errno, and the fix."""
        return self._slabs.refusal_detail

    def register(self, buf: Any) -> bool:
        """Thread-pool I/O has nothing to pin a buffer for (the native engine does)."""
        return False

    @property
    def spill(self) -> SpillDir:
        """The per-process spill directory (the host tier's node ledger is keyed by it)."""
        return self._spill

    @property
    def spill_path(self) -> str:
        """The per-process directory holding this backend's (nameless) slab files."""
        return self._spill.path

    def probe_summary(self) -> str:
        """What the probe found and how I/O runs, then the bandwidth caps in force, if any."""
        caps = describe_caps(self._caps)
        return f"{self._describe()}; {caps}" if caps else self._describe()

    def _describe(self) -> str:
        m, o = self.dio
        return (
            f"{self.mode} write+read probe passed on {self.fs} at {self._spill.root} "
            f"(dio align {m}/{o}, using {self.alignment})"
        )

    def _refresh_reason(self, before: str) -> None:
        # Keep the prefix open_backend gave the reason ("auto: ", "TBA_BACKEND=native: ").
        self.reason = self.reason.replace(before, self.probe_summary())

    # -- bandwidth caps ---------------------------------------------------------------------
    @property
    def caps(self) -> dict[str, int | None]:
        """The cap of each direction in bytes per second, None when uncapped."""
        return {op: cap[0] if cap else None for op, cap in self._caps.items()}

    def set_rate(self, op: str, bps: int | None, *, burst: int | None = None) -> None:
        """Cap ``op`` ("write" or "read") at ``bps`` bytes per second from now on; None or 0
        removes the cap. ``burst``: the bucket's size in bytes (default: 20 ms of the rate, at
        least 1 MiB). Ops already waiting are re-timed at once; removing the cap releases them.
        See NOTE [Rate caps] in tba/storage/ratelimit.py."""
        if op not in DIRECTIONS:
            raise ValueError(f"tba.storage: set_rate({op!r}): the op is 'write' or 'read'")
        bps = check_rate(bps)
        burst = check_burst(burst)
        if self._closed:
            raise ValueError(f"tba.storage: set_rate() on a closed {self.name} backend")
        before = self.probe_summary()
        self._caps[op] = self._apply_rate(op, bps, burst)
        self._refresh_reason(before)

    def _apply_rate(self, op: str, bps: int | None, burst: int | None) -> tuple[int, int] | None:
        """Put the cap in force; returns (rate, burst in force), or None without a cap."""
        bucket = self._buckets[op]
        bucket.set_rate(bps, burst)
        return (bps, bucket.burst or 0) if bps else None

    def _throttle_seconds(self) -> dict[str, float]:
        return {op: self._buckets[op].throttled_seconds for op in DIRECTIONS}

    def _probe(self) -> tuple[tuple[int, int], int]:
        """Write a page of random bytes to a nameless file, read it back, compare."""
        sp = self._spill
        fd = open_unnamed(sp.fd, sp.path, self.direct, "probe")
        shown = f"{sp.path}/probe (unlinked)"
        try:
            dio = dio_alignment(fd)
            align = io_alignment(dio)
            self._unit = max(dio) or align
            out = as_memoryview(aligned_empty(align, align))
            out[:] = os.urandom(align)
            self._write_all(fd, out, 0, shown)
            back = as_memoryview(aligned_empty(align, align))
            self._read_all(fd, back, 0, shown)
            if back != out:
                raise StorageError(
                    "probe read",
                    shown,
                    0,
                    align,
                    errno.EIO,
                    "The bytes read back differ from the bytes written: this filesystem does "
                    f"not honour {self.mode} I/O correctly.",
                )
        finally:
            os.close(fd)
        return dio, align

    # -- transfers --------------------------------------------------------------------------
    def _resume_at(self, pos: int, n: int) -> int:
        if self.direct and pos < n:
            return pos - pos % self._unit
        return pos

    def _write_all(self, fd: int, buf: memoryview, off: int, shown: str) -> None:
        self._transfer("write", lambda view, at: self._pwrite(fd, view, at), buf, off, shown)

    def _read_all(self, fd: int, buf: memoryview, off: int, shown: str) -> None:
        self._transfer("read", lambda view, at: self._preadv(fd, [view], at), buf, off, shown)

    def _transfer(self, op: str, call, buf: memoryview, off: int, shown: str) -> None:
        """Move all of ``buf`` at ``off`` with ``call(view, offset) -> bytes``; see NOTE 1-2."""
        n = len(buf)
        pos = again = stalls = 0
        while pos < n:
            try:
                k = call(buf[pos:], off + pos)
            except OSError as e:
                if e.errno == errno.EAGAIN and again < _MAX_AGAIN:
                    again += 1
                    time.sleep(0.001 * again)
                    continue
                code = e.errno or errno.EIO
                raise StorageError(op, shown, off + pos, n - pos, code, hint_for(code)) from None
            if k == 0 and op == "read":
                raise StorageError(
                    op,
                    shown,
                    off + pos,
                    n - pos,
                    errno.EIO,
                    "Unexpected end of file: the spill file is shorter than the extent. Nothing "
                    "was zero-filled; the tensor cannot be restored.",
                )
            new = self._resume_at(pos + k, n) if k > 0 else pos
            if new <= pos:
                stalls += 1
                if stalls >= _MAX_STALLS:
                    raise StorageError(
                        op,
                        shown,
                        off + pos,
                        n - pos,
                        errno.EIO,
                        f"The device made no progress in {stalls} attempts.",
                    )
            else:
                stalls = 0
            pos = new

    # Hooks for the buffered backend (page-cache control).
    def _after_write(self, slab: Slab, off: int, n: int) -> None:
        pass

    def _after_read(self, slab: Slab, off: int, n: int) -> None:
        pass

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self._stats[k] += v

    def _write_job(
        self, slab: Slab, off: int, buf: memoryview, digest: Digest | None
    ) -> int | None:
        try:
            value = digest(buf) if digest is not None else None
            self._write_all(slab.fd, buf, off, slab.display)
            self._after_write(slab, off, len(buf))
        except StorageError:
            self._count(io_errors=1)
            raise
        self._count(writes=1, bytes_written=len(buf))
        return value

    def _read_job(
        self,
        slab: Slab,
        off: int,
        buf: memoryview,
        name: str,
        digest: Digest | None,
        expect: int | None,
    ) -> None:
        try:
            self._read_all(slab.fd, buf, off, slab.display)
            self._after_read(slab, off, len(buf))
        except StorageError:
            self._count(io_errors=1)
            raise
        if digest is not None and expect is not None:
            got = digest(buf)
            if got != expect:
                self._count(io_errors=1, checksum_errors=1)
                hint = mismatch_hint(name, expect, got)
                raise StorageError("read", slab.display, off, len(buf), errno.EBADMSG, hint)
        self._count(reads=1, bytes_read=len(buf))

    def _check(self, extent: Extent, buf: memoryview) -> Slab:
        if self._closed:
            raise ValueError(f"tba.storage: I/O on a closed {self.name} backend")
        slab = self._slabs.slab_for(extent, len(buf))
        if self.direct and address_of(buf) % self.alignment:
            raise ValueError(
                f"tba.storage: buffer address {address_of(buf):#x} is not a multiple of "
                f"{self.alignment}, as O_DIRECT requires; allocate it with aligned_empty()"
            )
        return slab

    # -- the Backend protocol ---------------------------------------------------------------
    def allocate(self, nbytes: int) -> Extent | None:
        return self._slabs.allocate(nbytes, self._fallocate, self._statvfs)

    def free(self, extent: Extent) -> None:
        self._slabs.free(extent)

    def _submit(self, op: str, nbytes: int, job, *args) -> Future:
        """Run ``job`` on the pool: at once, or through the direction's pacer while a cap (or
        an op queued under one) is there."""
        pacer = self._pacers[op]
        if pacer.idle and self._buckets[op].rate is None:
            return self._pool.submit(job, *args)
        return pacer.submit(nbytes, job, *args)

    def write(
        self, extent: Extent, buf: memoryview, checksum: str = "off", span: Span = None
    ) -> Future:
        digest = digest_for(checksum, span)
        slab = self._check(extent, buf)
        return self._submit("write", len(buf), self._write_job, slab, extent.offset, buf, digest)

    def read(
        self,
        extent: Extent,
        buf: memoryview,
        checksum: str = "off",
        expect: int | None = None,
        span: Span = None,
    ) -> Future:
        digest = digest_for(checksum, span)
        slab = self._check(extent, buf)
        return self._submit(
            "read", len(buf), self._read_job, slab, extent.offset, buf, checksum, digest, expect
        )

    def usage(self) -> dict[str, int | float]:
        s = self._slabs
        with self._stats_lock:
            stats = dict(self._stats)
        throttled = self._throttle_seconds()
        return {
            "disk_bytes_in_use": s.used,
            "slab_bytes": s.reserved,
            "slabs": len(s.slabs),
            "refused_quota": s.refused_quota,
            "refused_space": s.refused_space,
            "refused_error": s.refused_error,
            **stats,
            "throttle_seconds_write": throttled["write"],
            "throttle_seconds_read": throttled["read"],
            "alignment": self.alignment,
        }

    def close(self) -> None:
        """Wait for in-flight I/O, close every slab and remove the per-process directory."""
        if self._closed:
            return
        self._closed = True
        for op in DIRECTIONS:
            self._buckets[op].drain()  # ops waiting for tokens go now, not at the capped rate
            self._pacers[op].close()  # ... into the pool, before it stops taking jobs
        self._pool.shutdown(wait=True)  # in-flight transfers finish before their fds close
        self._finalizer()

    def __enter__(self) -> SlabBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self._spill.path
        return f"<tba.storage {self.name} backend at {state}, alignment {self.alignment}>"
