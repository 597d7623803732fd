"""The host tier (``TBA_HOST_BYTES``): pinned host memory in front of the spill disk.

NOTE [Host tier]
1. On a CUDA host, offloaded bytes go to pinned host memory first: PCIe moves them many times
   faster than one NVMe drive, and such hosts carry far more RAM than GPU memory. The disk is
   the capacity tier, for what the host budget does not hold. On a CPU-only run there is no
   tier: the saved tensors are in RAM already, and copying them to RAM frees nothing. Nor with
   the ``memory`` backend (everything stays in RAM anyway) or GPUDirect Storage (device memory
   goes straight to the drive).
2. :class:`TieredBackend` wraps the disk backend behind the same Protocol. ``allocate`` is the
   disk's; ``allocate_host`` takes host memory. A :class:`HostExtent` marks host-tier extents,
   and ``write``/``read``/``free`` go to the tier the extent belongs to. Which tier a tensor
   takes is the data path's choice (NOTE [Tier order] in tba/decide/tiers.py).
3. The budget is the node's: a fraction of what the node can spare at start, or a size, shared
   by the ranks through a ledger beside the node disk quota's (``.tba-host-tier`` under the
   spill root, the same rules: NOTE [Node quota] in nodequota.py), reserved in chunks of
   :data:`CHUNK` bytes. The bytes in the tier never exceed this rank's reservation, nor the
   reservation the budget. Pinned extents are charged at the size torch's pinned allocator
   takes for them (the next power of two), so the charge is what is pinned.
4. Never swap, never the OOM killer. What the node can spare is MemAvailable within the
   cgroup's limit less its usage (:func:`memory_room`); a size beyond it is a ConfigError at
   start naming the figures. Each reservation reads it again and refuses (the bytes go to disk)
   when it would leave less than :data:`GUARD` bytes, saying so once.
5. A device tensor is copied from the device straight into its extent (NOTE [Host capture] in
   tba/datapath/pack.py); what comes through staging (a full tier's fallback, the tier's
   checksums on) is written by a copy on the tier's thread. A read-back is the extent's buffer
   itself, no copy:
   the device prefetch uploads straight from it (the CUDA adapter holds it until its H2D copy
   has completed, NOTE [CUDA ordering] 4), and freeing the extent only drops the tier's
   reference. So each extent is a buffer of its own: a range of a shared arena could be handed
   to a new write while a copy still reads the old bytes, and torch's pinned allocator, which
   records the copies that read a block, does not hand a block out again before they are done.
6. Checksums guard the disk. The host tier's bytes are process memory, as the device's are, and
   hashing them costs two passes over every byte on one thread (on an H200 host, with xxh3, most
   of a 3.4 s step that moved 7 GB through the tier): the default ``TBA_CHECKSUM=auto`` leaves
   them out; naming an algorithm (``xxh3``, ``crc32c``, ``crc32``) verifies this tier too.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..config import Config, format_size
from ..errors import ConfigError, StorageError, internal_error
from ..host.memory import PAGE, align_up, aligned_empty, as_memoryview, available_memory
from .base import Backend, Extent, Span
from .checksum import digest_for, mismatch_hint
from .nodequota import NodeQuota

__all__ = [
    "CHUNK",
    "GUARD",
    "HOST_LEDGER",
    "HostExtent",
    "HostTier",
    "Room",
    "TieredBackend",
    "memory_room",
    "with_host_tier",
]

log = logging.getLogger("tba.storage")

HOST_LEDGER = ".tba-host-tier"
CHUNK = 64 << 20  # a reservation grows by at least this (rule 3)
GUARD = 1 << 30  # a reservation never leaves the node less than this (rule 4)
_SETTING = "TBA_HOST_BYTES"
_UNLIMITED = 1 << 60  # a cgroup limit at or above this is "max"


@dataclasses.dataclass(frozen=True, slots=True)
class HostExtent(Extent):
    """An extent of the host tier (NOTE [Host tier] 2)."""


@dataclasses.dataclass(frozen=True)
class Room:
    """What the node can spare now (NOTE [Host tier] 4); None where it is not known."""

    available: int | None  # MemAvailable
    cgroup_limit: int | None  # memory.max (v2) or memory.limit_in_bytes (v1); None: no limit
    cgroup_used: int | None

    @property
    def bytes(self) -> int | None:
        rooms = [self.available] if self.available is not None else []
        if self.cgroup_limit is not None:
            rooms.append(max(0, self.cgroup_limit - (self.cgroup_used or 0)))
        return min(rooms) if rooms else None

    def describe(self) -> str:
        parts = []
        if self.available is not None:
            parts.append(f"MemAvailable {format_size(self.available)}")
        if self.cgroup_limit is not None:
            parts.append(
                f"cgroup limit {format_size(self.cgroup_limit)} with "
                f"{format_size(self.cgroup_used or 0)} in use"
            )
        return "; ".join(parts) or "nothing readable"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        n = int(text)
    except ValueError:
        return None
    return None if n >= _UNLIMITED else n


def memory_room(
    meminfo: str = "/proc/meminfo",
    cgroup_root: str = "/sys/fs/cgroup",
    self_cgroup: str = "/proc/self/cgroup",
) -> Room:
    """MemAvailable and this process's cgroup memory limit and usage (v2, else v1)."""
    limit = used = None
    try:
        with open(self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        path = path.lstrip("/")
        if hier == "0" and controllers == "":  # cgroup v2
            base = f"{cgroup_root}/{path}".rstrip("/")
            limit, used = _read_int(f"{base}/memory.max"), _read_int(f"{base}/memory.current")
            break
        if "memory" in controllers.split(","):  # cgroup v1
            base = f"{cgroup_root}/memory/{path}".rstrip("/")
            limit = _read_int(f"{base}/memory.limit_in_bytes")
            used = _read_int(f"{base}/memory.usage_in_bytes")
            break
    return Room(available_memory(meminfo), limit, used if limit is not None else None)


def host_limit(value: int | float, room: Room, source: str) -> int:
    """The node's host-tier budget in bytes for TBA_HOST_BYTES ``value`` (NOTE [Host tier] 3
    and 4); ConfigError when a size is more than the node can spare now."""
    spare = room.bytes
    if isinstance(value, float):
        return 0 if spare is None else int(value * spare)
    if spare is not None and value > spare:
        where = "" if source == "default" else f" ({source})"
        raise ConfigError(
            f"{_SETTING}{where} = {format_size(value)} is more pinned host memory than this "
            f"node can spare now: {format_size(spare)} ({room.describe()}). Pinning it would "
            f"push the host into swap or the OOM killer. Lower {_SETTING}, give it as a "
            f"fraction of what the node can spare (e.g. 0.5), or set it to 0 for no host tier."
        )
    return int(value)


class HostTier:
    """Extents in (pinned) host memory within this rank's share of the node budget."""

    def __init__(
        self,
        limit: int,
        align: int = PAGE,
        pin: bool = False,
        ledger: NodeQuota | None = None,
        room: Any = memory_room,
        guard: int = GUARD,
        chunk: int = CHUNK,
        verify: bool = True,
    ):
        self.limit = limit  # the node's budget (one rank alone: all of it)
        self.align = align
        self.pin = pin
        self.ledger = ledger
        self.room = room  # () -> Room: read at each reservation (rule 4)
        self.guard = guard
        self.chunk = chunk
        self.verify_bytes = verify  # checksums over this tier's bytes (rule 6)
        self.reserved = 0  # this rank's reservation
        self._looked = 0  # the surplus (reserved - used) at the last look at the ledger
        self.used = 0  # bytes of live host extents
        self.peak = 0
        self.refusals = 0  # allocations sent to the disk: no room in the tier
        self.refused_memory = 0  # of those, refused because the node's memory is short
        self._bufs: dict[int, torch.Tensor] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._warned = False
        self._closed = False
        self._stats = dict.fromkeys(("host_tier_writes", "host_tier_reads"), 0)

    # -- space ------------------------------------------------------------------------------------
    def share(self) -> int:
        """The bytes this rank may expect to hold: its fair share of the node budget."""
        return self.limit if self.ledger is None else min(self.limit, self.ledger.share())

    def charge(self, nbytes: int) -> int:
        """The bytes an extent of ``nbytes`` takes from the budget (rule 3): pinned, the power
        of two torch's pinned allocator rounds it up to."""
        n = align_up(max(nbytes, 1), self.align)
        return 1 << (n - 1).bit_length() if self.pin else n

    def allocate(self, nbytes: int) -> HostExtent | None:
        n = align_up(max(nbytes, 1), self.align)
        cost = self.charge(n)
        with self._lock:
            if self._closed:
                return None
            if self.used + cost > self.reserved and not self._grow(
                self.used + cost - self.reserved
            ):
                self.refusals += 1
                return None
            try:
                buf = aligned_empty(n, self.align, pin=self.pin)
            except (RuntimeError, MemoryError) as e:  # pinning refused: the disk takes it
                self.refusals += 1
                self._warn(f"pinning {format_size(n)} of host memory failed ({e})")
                return None
            key = next(self._ids)
            self._bufs[key] = buf
            self.used += cost
            self.peak = max(self.peak, self.used)
            self._looked = min(self._looked, self.reserved - self.used)
        return HostExtent(key, 0, n)

    def _grow(self, need: int) -> bool:
        """Reserve at least ``need`` more bytes (lock held)."""
        need = align_up(need, PAGE)
        want = max(need, min(self.chunk, self.limit))
        if self.ledger is None:
            grant = min(want, self.limit - self.reserved)
            if grant < need:
                return False
        else:
            grant = self.ledger.grow(self.reserved, need, want, PAGE)
            if grant == 0:
                return False
        spare = self.room().bytes
        if spare is not None and spare - grant < self.guard:
            if spare - need >= self.guard:
                grant = need
            else:
                if self.ledger is not None:
                    self.ledger.set(self.reserved)
                self.refused_memory += 1
                self._warn(
                    f"the node has {format_size(spare)} of memory to spare, and the tier keeps "
                    f"{format_size(self.guard)} of it free"
                )
                return False
        if self.ledger is not None and grant != want:
            self.ledger.set(self.reserved + grant)
        self.reserved += grant
        return True

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "tba.storage: the host tier holds %s and takes no more for now: %s. Offloaded "
                "bytes go to the spill disk instead. Lower %s or free host memory.",
                format_size(self.used),
                why,
                _SETTING,
            )

    def free(self, extent: Extent) -> None:
        with self._lock:
            if self._closed:
                return
            buf = self._bufs.pop(extent.slab, None)
            if buf is None:
                raise internal_error(
                    "storage", f"free of an unknown host-tier extent {extent.slab}: double free"
                )
            self.used -= self.charge(buf.numel())
            surplus = self.reserved - self.used
            # NOTE [Node quota] 6: give back what is over the share when another rank wants
            # it. Reading the ledger is a locked file read, and backward frees on the thread
            # that launches its kernels: once per chunk of surplus, not at every free
            if self.ledger is not None and surplus >= max(
                2 * self.chunk, self._looked + self.chunk
            ):
                self._looked = surplus
                excess = self.ledger.excess(self.reserved)
                cut = min(excess, surplus) // PAGE * PAGE
                if cut > 0:
                    self.reserved -= cut
                    self._looked = self.reserved - self.used
                    self.ledger.set(self.reserved)

    # -- bytes ------------------------------------------------------------------------------------
    def view(self, extent: Extent) -> torch.Tensor:
        """The extent's own buffer (a read-back with no copy, rule 5)."""
        with self._lock:
            t = self._bufs.get(extent.slab)
        if t is None or t.numel() != extent.length:
            raise ValueError(
                f"tba.storage: host-tier extent {extent.slab} of {extent.length} bytes is not "
                "allocated; it was freed or belongs to another tier"
            )
        return t

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="tba-host")
            return self._pool

    def write(self, extent: Extent, buf: Any, checksum: str = "off", span: Span = None) -> Future:
        dst = self.view(extent)
        if len(buf) != extent.length:
            raise ValueError(
                f"tba.storage: buffer of {len(buf)} bytes for a host-tier extent of "
                f"{extent.length} bytes"
            )
        digest = digest_for(checksum if self.verify_bytes else "off", span)

        def job() -> int | None:
            value = digest(buf) if digest is not None else None
            dst.copy_(torch.frombuffer(buf, dtype=torch.uint8))
            self._count("host_tier_writes")
            return value

        return self._executor().submit(job)

    def verify(
        self,
        extent: Extent,
        fut: Future,
        checksum: str = "off",
        expect: int | None = None,
        span: Span = None,
    ) -> None:
        """Resolve ``fut`` once the extent's bytes match ``expect`` (at once without a
        checksum), else fail it with StorageError(EBADMSG)."""
        digest = digest_for(checksum if self.verify_bytes else "off", span)
        self._count("host_tier_reads")
        if digest is None or expect is None:
            fut.set_result(None)
            return
        src = self.view(extent)

        def job() -> None:
            got = digest(as_memoryview(src))
            if got != expect:
                fut.set_exception(
                    StorageError(
                        "read",
                        f"host-tier extent {extent.slab}",
                        0,
                        extent.length,
                        errno.EBADMSG,
                        mismatch_hint(
                            checksum, expect, got, "Host memory was overwritten while it was held."
                        ),
                    )
                )
            else:
                fut.set_result(None)

        self._executor().submit(job)

    def read(
        self,
        extent: Extent,
        buf: Any,
        checksum: str = "off",
        expect: int | None = None,
        span: Span = None,
    ) -> Future:
        """The Protocol's read: a copy into ``buf``, verified."""
        src = self.view(extent)
        torch.frombuffer(buf, dtype=torch.uint8).copy_(src)
        fut: Future = Future()
        self.verify(extent, fut, checksum, expect, span)
        return fut

    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {
                "host_tier_bytes_in_use": self.used,
                "host_tier_reserved_bytes": self.reserved,
                "host_tier_limit_bytes": self.limit,
                "host_tier_refusals": self.refusals,
                **self._stats,
            }

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._lock:
            self._bufs.clear()
            self.used = self.reserved = 0
        if self.ledger is not None:
            self.ledger.close()


class TieredBackend:
    """The disk backend with a host tier in front (NOTE [Host tier] 2). Every attribute not
    named here is the disk backend's."""

    def __init__(self, disk: Backend, host: HostTier):
        self.disk = disk
        self.host = host
        self.name = disk.name
        self.alignment = disk.alignment
        self.device_direct = disk.device_direct
        self.reason = (
            f"{disk.reason}; host tier of up to {format_size(host.limit)} of pinned memory "
            "in front of it"
        )

    def __getattr__(self, name: str) -> Any:
        if name in ("disk", "host"):  # not set yet (during construction or unpickling)
            raise AttributeError(name)
        return getattr(self.disk, name)

    @property
    def refusal(self) -> str:
        return self.disk.refusal

    @property
    def refusal_detail(self) -> str:
        return self.disk.refusal_detail

    @property
    def spill_path(self) -> str | None:
        return self.disk.spill_path

    def register(self, buf: Any) -> bool:
        return self.disk.register(buf)

    def allocate(self, nbytes: int) -> Extent | None:
        return self.disk.allocate(nbytes)

    def allocate_host(self, nbytes: int) -> Extent | None:
        return self.host.allocate(nbytes)

    def free(self, extent: Extent) -> None:
        if isinstance(extent, HostExtent):
            self.host.free(extent)
        else:
            self.disk.free(extent)

    def write(
        self, extent: Extent, buf: memoryview, checksum: str = "off", span: Span = None
    ) -> Future:
        if isinstance(extent, HostExtent):
            return self.host.write(extent, buf, checksum, span)
        return self.disk.write(extent, buf, checksum, span)

    def read(
        self,
        extent: Extent,
        buf: memoryview,
        checksum: str = "off",
        expect: int | None = None,
        span: Span = None,
    ) -> Future:
        if isinstance(extent, HostExtent):
            return self.host.read(extent, buf, checksum, expect, span)
        return self.disk.read(extent, buf, checksum, expect, span)

    def set_rate(self, op: str, bps: int | None, *, burst: int | None = None) -> None:
        self.disk.set_rate(op, bps, burst=burst)

    def usage(self) -> dict[str, int | float]:
        return {**self.disk.usage(), **self.host.usage()}

    def close(self) -> None:
        try:
            self.host.close()
        finally:
            self.disk.close()


_said: set[str] = set()  # what this process has said about its tier: once each


def _say(level: int, msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        log.log(level, msg)


@dataclasses.dataclass(frozen=True)
class TierStatus:
    """Whether this process has a host tier, and why (``stats()["host_tier"]``)."""

    on: bool
    reason: str


def with_host_tier(
    cfg: Config, backend: Backend, cuda: bool, room: Any = None
) -> tuple[Backend, TierStatus]:
    """``backend`` with the host tier in front where NOTE [Host tier] 1 allows it, and why.
    Warns once when TBA_HOST_BYTES was set and the tier is off. ``room`` reads what the node
    can spare (default :func:`memory_room`)."""
    room = room or memory_room
    value = cfg.host_bytes
    source = cfg.sources.get("host_bytes", "default")
    explicit = source != "default"
    off = None
    if value == 0:
        off = f"{_SETTING}=0"
    elif not cuda:
        off = (
            "no CUDA device: the saved tensors are in host memory already, and a host tier "
            "would free nothing"
        )
    elif backend.name == "memory":
        off = "TBA_BACKEND=memory keeps every offloaded byte in host memory already"
    elif backend.device_direct:
        off = "GPUDirect Storage moves device memory straight to the drive"
    spare = room() if off is None else Room(None, None, None)
    limit = 0
    if off is None:
        limit = host_limit(value, spare, source)
        if limit < PAGE:
            off = f"the node can spare nothing for it ({spare.describe()})"
    if off is not None:
        if explicit and value != 0:
            _say(logging.WARNING, f"tba.storage: {_SETTING} is set but the host tier is off: {off}")
        else:
            _say(logging.DEBUG, f"tba.storage: host tier off: {off}")
        return backend, TierStatus(False, off)
    ledger = None
    sp = getattr(backend, "spill", None)
    if sp is not None:
        ledger = NodeQuota(
            sp.root_fd, sp.root, sp.name, limit, cfg.rank or 0, ledger=HOST_LEDGER, setting=_SETTING
        )
    pin = torch.cuda.is_available()  # a fake CUDA (tests) runs on unpinned memory
    verify = cfg.checksum not in ("auto", "off")  # rule 6: a named algorithm only
    host = HostTier(limit, backend.alignment, pin=pin, ledger=ledger, room=room, verify=verify)
    why = f"up to {format_size(limit)} of pinned host memory for the node ({spare.describe()})"
    _say(logging.INFO, f"tba.storage: host tier on: {why}")
    return TieredBackend(backend, host), TierStatus(True, why)
