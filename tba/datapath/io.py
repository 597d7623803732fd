"""The I/O state both sides of the data path share: the lock, the backend, the futures in
flight, a device adapter and staging pool per device, the bytes on disk, and the timing of
each transfer.

The Packer (tba/datapath/pack.py) captures and writes through it, the Reader
(tba/datapath/unpack.py) reads back through it. It knows entries and their resources, but not
autograd, the prefetch plan, nor why a tensor is kept.

Locking: one re-entrant lock (:attr:`IO.lock`) guards the index, the entries' states, the
budgets and the counters. I/O completions arrive on I/O threads and take it too. Waiting on
I/O (stalls) and ``Ticket.wait`` happen outside it.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Protocol

import torch

from ..config import Config, format_size
from ..errors import CapacityError, ConfigError
from ..host.clock import SYSTEM, Clock, Timeline
from ..host.memory import available_memory, io_buffer
from ..records.entry import Entry
from ..records.index import Index
from ..records.step import GroupStat, StepState
from ..storage.base import Backend, Extent, Span
from ..storage.checksum import resolve
from ..storage.hosttier import HostExtent, TieredBackend
from .capture.device import CpuAdapter, DeviceAdapter, DeviceClock, adapter_for
from .capture.staging import DirectBlock, HostBlock, StagingPool

log = logging.getLogger("tba")


class IOSink(Protocol):
    """Where transfers are reported (tba.metrics.RankMetrics): one append per successful
    transfer, one call per failed one (NOTE [Metrics] in tba/metrics/__init__.py)."""

    io_log: list[tuple[bool, float, int]]

    def io_error(self, op: str, err: BaseException) -> None: ...


class IO:
    """The shared I/O state of one Offloader. Methods marked "lock held" expect :attr:`lock`."""

    slow_io_s = 60.0  # seconds a wait on I/O lasts before :meth:`wait` logs it

    def __init__(
        self,
        config: Config,
        backend: Backend,
        index: Index,
        sink: IOSink,
        clock: Clock = SYSTEM,
    ):
        self.lock = threading.RLock()
        self.config = config = with_budget_backpressure(config)
        self.backend = backend
        self.align = backend.alignment
        self.checksum = resolve(config.checksum)  # "auto" -> the algorithm in use
        self.index = index
        self.sink = sink
        self.clock = clock
        self.pending: set[Future] = set()  # every write and read not yet completed
        self.live: set[Entry] = set()  # entries not yet dead
        self.adapters: dict[torch.device, tuple[DeviceAdapter, StagingPool]] = {}
        self.staging_limit: int | None = None  # NOTE [Staging within the budget]
        self.uploading: set[torch.device] = set()  # devices whose adapter uploads read bytes
        # per device a step runs on: its timeline (NOTE [Device clock]); None: the host clock
        self.timelines: dict[torch.device, Timeline | None] = {}
        # Called (lock held) when an entry's bytes have come back to host memory: the Reader
        # sets it to the device window's pump (NOTE [Device prefetch] in tba/datapath/prefetch.py).
        self.on_host: Callable[[], None] = lambda: None
        self.disk_in_use = 0
        # NOTE [Host tier] in tba/storage/hosttier.py: the tier when this process has one, and
        # the leading groups of this step that go to the disk first (NOTE [Tier order])
        self.tier = backend if isinstance(backend, TieredBackend) else None
        self.spill_groups = 0
        self._warned: set[str] = set()
        self._capture_pool: ThreadPoolExecutor | None = None

    # -- devices ------------------------------------------------------------------------------
    def device(self, device: torch.device) -> tuple[DeviceAdapter, StagingPool]:
        """The adapter and staging pool for tensors on ``device``, made on first use."""
        got = self.adapters.get(device)
        if got is None:
            cfg = self.config
            if device.type == "cpu":
                adapter: DeviceAdapter = CpuAdapter(2 * cfg.prefetch_bytes)
            else:  # device memory straight to disk when the backend can (kvikio with GDS)
                adapter = adapter_for(device, direct=self.backend.device_direct)
            try:
                arena = adapter.staging_arena(cfg.staging_bytes, self.align)
            except (OSError, RuntimeError, MemoryError) as e:
                raise _no_memory("the staging arena", "staging_bytes", cfg.staging_bytes, e) from e
            # Registering pins (and so faults in) the whole arena. With direct capture the CPU
            # arena serves only coalesced small tensors, and its untouched pages should cost
            # nothing (NOTE [Direct capture]).
            if not isinstance(adapter, CpuAdapter):
                self.backend.register(arena)  # long-lived: pinned/mapped once (False: cannot)
            self.add_adapter(device, adapter, StagingPool(arena, self.align))
            got = self.adapters[device]
        return got

    def add_adapter(self, device: torch.device, adapter: DeviceAdapter, pool: StagingPool) -> None:
        """Use ``adapter`` and ``pool`` for tensors on ``device`` (tests put fakes in here); a
        device adapter's clock times the steps that run there, unless one does already."""
        self.adapters[device] = (adapter, pool)
        pool.limit = self.staging_limit
        clock = getattr(adapter, "clock", None)
        if clock is not None and self.timelines.get(device) is None:
            self.timelines[device] = clock
        if adapter.uploads:
            self.uploading.add(device)
        else:
            self.uploading.discard(device)

    def limit_staging(self, nbytes: int | None) -> None:
        """Each staging pool's bytes in flight at most ``nbytes`` (None: its capacity), for the
        step about to run (NOTE [Staging within the budget] in tba/datapath/capture/staging.py).
        Lock held."""
        self.staging_limit = nbytes
        for _, pool in self.adapters.values():
            pool.limit = nbytes

    def timeline(self, device: torch.device | None) -> Timeline | None:
        """The timeline of a step that runs on ``device`` (NOTE [Device clock]): its events on a
        CUDA device, None (the host clock) on the CPU. ``device`` None (no model given): the
        one device timeline in use, if there is exactly one."""
        if device is None:
            found = [t for t in self.timelines.values() if t is not None]
            return found[0] if len(found) == 1 else None
        if device not in self.timelines:
            self.timelines[device] = DeviceClock(device) if device.type == "cuda" else None
        return self.timelines[device]

    def copy_rates(self) -> tuple[float | None, float | None]:
        """Bytes per second of the copies to and from the devices since the last call, as the
        devices timed them (NOTE [Copy timing]); None: none timed."""
        sums = {True: [0, 0.0], False: [0, 0.0]}
        for adapter, _ in self.adapters.values():
            take = getattr(adapter, "take_copies", None)
            for to_host, nbytes, seconds in take() if take is not None else ():
                sums[to_host][0] += nbytes
                sums[to_host][1] += seconds
        rate = {k: (n / s if s > 0 else None) for k, (n, s) in sums.items()}
        return rate[True], rate[False]

    def staging_in_use(self) -> int:
        return sum(pool.in_use for _, pool in self.adapters.values())

    def trim(self) -> None:
        """Let the adapters return their spare read buffers (forward runs without them)."""
        for adapter, _ in self.adapters.values():
            adapter.trim()

    def copy_out(self, e: Entry) -> torch.Tensor:
        """``e``'s bytes, still in staging, as a read buffer of its own (charged). Lock held."""
        blk = e.staging
        if isinstance(blk, DirectBlock):  # the source itself: no copy
            self.index.charge(e.padded)
            return blk.tensor
        adapter, _ = self.device(e.device)
        host = adapter.host_buffer(e.padded, self.align)
        adapter.copy_staged(host, blk.tensor)
        self.index.charge(e.padded)
        return host

    def staged_to_host(self, e: Entry) -> None:
        """``e``'s write completed while the read-ahead wanted it: its bytes leave staging for a
        read buffer of their own. A direct block's bytes are that buffer already, so the charge
        moves from staging to the buffer and is never counted twice (a whole-step spike of
        ``peak_resident_bytes`` for a large last tensor, e.g. a language model's logits). Lock
        held."""
        blk = e.staging
        # the source itself, or the host tier's own buffer (NOTE [Host capture] in pack.py)
        if isinstance(blk, (DirectBlock, HostBlock)):
            buf = blk.tensor  # before the release: a HostBlock's drops its buffer
            self.free_staging(e)
            self.index.charge(e.padded)
            e.hold(buf, from_disk=False)
            return
        e.hold(self.copy_out(e), from_disk=False)
        self.free_staging(e)

    # -- transfers ----------------------------------------------------------------------------
    def allocate(self, nbytes: int, device: torch.device, stat: GroupStat | None) -> Extent | None:
        """An extent for ``nbytes`` of a tensor on ``device`` saved by group ``stat``: on the
        disk, or, with a host tier and a device whose bytes are uploaded back (CUDA), in host
        memory first, the leading :attr:`spill_groups` groups on the disk first (NOTE [Tier
        order] in tba/decide/tiers.py). None when every tier refuses. Lock held."""
        tier = self.tier
        if tier is None or device not in self.uploading:
            return self.backend.allocate(nbytes)
        if stat is not None and stat.group < self.spill_groups:
            got = self.backend.allocate(nbytes)
            return got if got is not None else tier.allocate_host(nbytes)
        got = tier.allocate_host(nbytes)
        return got if got is not None else self.backend.allocate(nbytes)

    def write(
        self, extent: Extent, buf: Any, stat: GroupStat, span: Span = None
    ) -> tuple[Future, float]:
        """Start a write of ``buf`` to ``extent``, checksummed over ``span`` (None: all of it);
        returns its future and its start time."""
        t0 = self.clock()
        stat.io_started(True, t0)
        fut = self.backend.write(extent, buf, self.checksum, span)
        self.pending.add(fut)
        return fut, t0

    def read(self, extent: Extent, device: torch.device, e: Entry) -> Future:
        """Start a read of ``extent`` into a new buffer for ``device``, verified against
        ``e.digest``. The future carries ``tba_buffer`` and ``tba_t0``."""
        if isinstance(extent, HostExtent) and self.tier is not None:
            return self._read_host(self.tier, extent, e)
        adapter, _ = self.device(device)
        try:
            buf = adapter.host_buffer(extent.length, self.align)
        except (OSError, RuntimeError, MemoryError) as e:
            raise _no_memory("a read-back buffer", "prefetch_bytes", extent.length, e) from e
        t0 = self.clock()
        e.stat.io_started(False, t0)
        fut = self.backend.read(extent, io_buffer(buf), self.checksum, e.digest, e.span)
        fut.tba_buffer = buf  # type: ignore[attr-defined]
        fut.tba_t0 = t0  # type: ignore[attr-defined]
        self.pending.add(fut)
        return fut

    def _read_host(self, tier: TieredBackend, extent: HostExtent, e: Entry) -> Future:
        """A read-back from the host tier: the extent's own buffer, no copy (NOTE [Host tier]
        5), once its checksum (if any) matched. The future carries ``tba_buffer`` and
        ``tba_t0`` as :meth:`read`'s does."""
        t0 = self.clock()
        e.stat.io_started(False, t0)
        fut: Future = Future()
        fut.tba_buffer = tier.host.view(extent)  # type: ignore[attr-defined]
        fut.tba_t0 = t0  # type: ignore[attr-defined]
        self.pending.add(fut)
        tier.host.verify(extent, fut, self.checksum, e.digest, e.span)
        return fut

    def finished(self, write: bool, e: Entry, t0: float, nbytes: int) -> None:
        """A write or read of ``nbytes`` issued at ``t0`` succeeded: the group's and the step's
        I/O times (adaptive keep, trace) and the metrics. A host-tier transfer times the
        tier, not the disk, and the metrics' disk figures leave it out. Lock held."""
        now = self.clock()
        e.stat.io_done(write, nbytes, now)
        if isinstance(e.extent, HostExtent):
            e.step.host_span(write, t0, now, nbytes)
            return
        e.step.io_span(write, t0, now, nbytes)
        self.sink.io_log.append((write, now - t0, nbytes))

    def failed(self, op: str, err: BaseException, st: StepState) -> None:
        """A transfer of ``st``'s failed: counted in its stats and the metrics. Lock held."""
        st.io_errors += 1
        self.sink.io_error(op, err)

    def settled(self, fut: Future) -> None:
        self.pending.discard(fut)

    def drain(self) -> None:
        """Wait until no write or read is in flight."""
        while True:
            with self.lock:
                self.index.bury()
                pending = list(self.pending)
            if not pending:
                return
            self.wait(pending, f"for {len(pending)} writes and reads in flight")

    def wait(self, futures: list[Future], what: str) -> None:
        """Waits for every one of ``futures`` (lock not held). Once it has waited
        :attr:`slow_io_s`, and again each time the wait doubles, it logs ``what`` it waits for
        and on which backend: a run that hangs on I/O says so rather than go quiet for good."""
        limit, waited = self.slow_io_s, 0.0
        while wait_futures(futures, timeout=limit).not_done:
            waited += limit
            limit = waited
            b = self.backend
            u = b.usage()
            log.warning(
                "tba: waited %.0f s %s (backend %s; %s; caps held writes %.0f s and reads "
                "%.0f s so far); still waiting. A capped or very slow disk can take this long; "
                "I/O that never ends is a bug: please report it with a stack dump of this "
                "process (py-spy dump --pid %d).",
                waited,
                what,
                b.name,
                b.reason,
                u.get("throttle_seconds_write", 0.0),
                u.get("throttle_seconds_read", 0.0),
                os.getpid(),
            )

    def capture_executor(self) -> ThreadPoolExecutor:
        """The thread that waits for device captures before their writes start."""
        if self._capture_pool is None:
            self._capture_pool = ThreadPoolExecutor(1, thread_name_prefix="tba-capture")
        return self._capture_pool

    # -- resources ------------------------------------------------------------------------------
    def count_disk(
        self, st: StepState, extent: Extent | None, stat: GroupStat | None = None
    ) -> None:
        """``extent`` now holds bytes of ``st`` (of group ``stat``): counted in its tier."""
        if extent is None:
            return
        nbytes = extent.length
        if isinstance(extent, HostExtent):
            st.host_tier_bytes += nbytes
            if stat is not None:
                stat.host_bytes += nbytes
            if self.tier is not None:
                st.host_tier_peak_bytes = max(st.host_tier_peak_bytes, self.tier.host.used)
            return
        st.ssd_tier_bytes += nbytes
        if stat is not None:
            stat.ssd_bytes += nbytes
        self.disk_in_use += nbytes
        st.peak_disk_bytes = max(st.peak_disk_bytes, self.disk_in_use)

    def release(self, e: Entry) -> None:
        """Free ``e``'s staging and extent (no I/O on them in flight). Lock held."""
        self.free_staging(e)
        self.free_extent(e)

    def free_staging(self, e: Entry) -> None:
        blk = e.take_staging()
        if blk is not None:
            blk.release()
            self.index.uncharge(e.padded)

    def free_extent(self, e: Entry) -> None:
        ext = e.take_extent()
        if ext is None:
            return
        if e.batch is not None:
            ext = e.batch.release_extent()
            if ext is None:
                return  # other members' bytes are still on it
        self.backend.free(ext)
        if not isinstance(ext, HostExtent):
            self.disk_in_use -= ext.length

    def warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg)

    def close(self) -> None:
        """After the last drain: stop the capture thread, trim the adapters, close the files."""
        if self._capture_pool is not None:
            self._capture_pool.shutdown(wait=True)
        self.trim()
        self.backend.close()


# the source of that staging_full
BUDGET_WAITS = "default (TBA_MEMORY_BUDGET is set, or TBA_POLICY=auto, which always has one)"


def memory_bounded(config: Config) -> bool:
    """Whether the run bounds tba's memory: TBA_MEMORY_BUDGET is set, or TBA_POLICY=auto, whose
    chooser holds to a budget when it has one and otherwise to TBA_MAX_SLOWDOWN."""
    return config.memory_budget is not None or config.policy == "auto"


def with_budget_backpressure(config: Config) -> Config:
    """``config`` with TBA_STAGING_FULL=wait when TBA_MEMORY_BUDGET is set (or TBA_POLICY=auto,
    whose default budget is DEFAULT_BUDGET_SHARE) and TBA_STAGING_FULL was left at its default,
    else ``config`` itself (NOTE [Staging backpressure]). The copy's
    ``sources`` say why (:data:`BUDGET_WAITS`); the given Config is not changed."""
    if not memory_bounded(config) or config.sources.get("staging_full") != "default":
        return config
    out = copy.copy(config)  # not replace(): that would resolve every field afresh
    object.__setattr__(out, "staging_full", "wait")
    object.__setattr__(out, "sources", {**config.sources, "staging_full": BUDGET_WAITS})
    return out


def check_host_memory(config: Config) -> None:
    """Refuse, at start, memory settings this machine cannot give: each of the staging budget
    and the read-ahead cap must fit in the memory available now (/proc/meminfo)."""
    avail = available_memory()
    if avail is None:
        return
    problems = []
    for field, env, default in (
        ("staging_bytes", "TBA_STAGING_BYTES", "256 MiB"),
        ("prefetch_bytes", "TBA_PREFETCH_BYTES", "128 MiB"),
    ):
        value = getattr(config, field)
        if value > avail:
            problems.append(
                f"{field} ({env}) = {format_size(value)} is more than the memory available on "
                f"this machine now ({format_size(avail)}, MemAvailable in /proc/meminfo). "
                f"Lower {env} (the default is {default})."
            )
    if problems:
        raise ConfigError(problems)


def _no_memory(what: str, field: str, nbytes: int, err: BaseException) -> CapacityError:
    env = "TBA_" + field.upper()
    return CapacityError(
        f"tba.io: cannot allocate {what} of {format_size(nbytes)} ({err}). Host memory is "
        f"short: lower {field} ({env}) or free memory, or run with TBA_ENABLED=0."
    )
