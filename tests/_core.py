"""The Packer and the Reader wired by hand, without an Offloader, for tests of each alone.

The parts are the real ones (tba.records.index, tba.datapath.io, tba.datapath.pack,
tba.datapath.unpack, tba.datapath.blocks.groups, tba.datapath.prefetch) over the real memory
backend; only time is fake (a clock that advances 1 ms per reading, so every duration tba measures
is a whole number of readings), and a backend may be swapped for one of the small real backends
below that refuse space, fail, or hold transfers until released.
"""

from __future__ import annotations

import errno
import threading
from concurrent.futures import Future
from typing import Any

import torch

import tba
from tba.datapath.blocks.groups import GroupTracker
from tba.datapath.io import IO
from tba.datapath.pack import Packer
from tba.datapath.prefetch import Prefetcher
from tba.datapath.unpack import Reader
from tba.decide.keep import Policy
from tba.errors import StorageError
from tba.records.index import Index
from tba.records.step import StepState
from tba.storage.memory import MemoryBackend

TICK = 0.001


class FakeClock:
    """``time.perf_counter`` stand-in: each reading is one TICK after the last, and each is
    recorded with the thread that took it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.readings: list[tuple[int, float]] = []
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.now += TICK
            self.readings.append((threading.get_ident(), self.now))
            return self.now

    def of(self, thread: int) -> list[float]:
        """The readings ``thread`` took, in order."""
        return [v for t, v in self.readings if t == thread]


class Sink:
    """Records what tba reports to its metrics (the IOSink protocol of tba/datapath/io.py)."""

    def __init__(self) -> None:
        self.io_log: list[tuple[bool, float, int]] = []
        self.errors: list[tuple[str, BaseException]] = []

    def io_error(self, op: str, err: BaseException) -> None:
        self.errors.append((op, err))


class RefusingBackend(MemoryBackend):
    """A memory backend whose disk is full: every ``allocate`` is refused for ``refusal``."""

    def __init__(self, cfg: tba.Config, refusal: str = "disk_full"):
        super().__init__(cfg)
        self.refusal = refusal

    def allocate(self, nbytes: int) -> Any:
        return None


class FailingBackend(MemoryBackend):
    """A memory backend whose writes (or reads) fail with ``code``, as a disk's would."""

    def __init__(self, cfg: tba.Config, op: str, code: int = errno.EIO):
        super().__init__(cfg)
        self.op = op
        self.code = code

    def _fail(self, op: str, extent: Any, n: int) -> Future:
        f: Future = Future()
        f.set_exception(StorageError(op, f"memory extent {extent.slab}", 0, n, self.code))
        return f

    def write(self, extent, buf, checksum="off", span=None):
        if self.op == "write":
            return self._fail("write", extent, len(buf))
        return super().write(extent, buf, checksum, span)

    def read(self, extent, buf, checksum="off", expect=None, span=None):
        if self.op == "read":
            return self._fail("read", extent, len(buf))
        return super().read(extent, buf, checksum, expect, span)


class GatedBackend(MemoryBackend):
    """A memory backend whose transfers of ``ops`` complete only once :meth:`open` is called
    (the copy itself runs then, on the calling thread, as an I/O thread would)."""

    def __init__(self, cfg: tba.Config, ops: tuple[str, ...] = ("write", "read")):
        super().__init__(cfg)
        self.ops = ops
        self.held: list[tuple[Future, Any]] = []
        self.lock = threading.Lock()
        self.is_open = False

    def _gate(self, op: str, run: Any) -> Future:
        if op not in self.ops or self.is_open:
            return run()
        f: Future = Future()
        with self.lock:
            self.held.append((f, run))
        return f

    def open(self) -> None:
        with self.lock:
            self.is_open = True
            held, self.held = self.held, []
        for f, run in held:
            done = run()
            if done.exception() is not None:
                f.set_exception(done.exception())
            else:
                f.set_result(done.result())

    def write(self, extent, buf, checksum="off", span=None):
        run = lambda: MemoryBackend.write(self, extent, buf, checksum, span)  # noqa: E731
        return self._gate("write", run)

    def read(self, extent, buf, checksum="off", expect=None, span=None):
        run = lambda: MemoryBackend.read(self, extent, buf, checksum, expect, span)  # noqa: E731
        return self._gate("read", run)


class Core:
    """Index, IO, Packer, Reader and Prefetcher, wired as tba/datapath/offloader.py wires them."""

    def __init__(self, backend: Any = None, **cfg: Any):
        cfg.setdefault("backend", "memory")
        cfg.setdefault("min_offload_bytes", 1)
        cfg.setdefault("staging_bytes", "8MiB")
        cfg.setdefault("prefetch_bytes", "8MiB")
        cfg.setdefault("coalesce_bytes", 0)
        cfg.setdefault("keep_last", 0)
        self.config = tba.Config(environ={}, **cfg)
        self.backend = backend(self.config) if callable(backend) else backend
        if self.backend is None:
            self.backend = MemoryBackend(self.config)
        self.clock = FakeClock()
        self.sink = Sink()
        self.peaks: list[int] = []
        self.index = Index(on_resident=self.peaks.append)
        self.io = IO(self.config, self.backend, self.index, self.sink, clock=self.clock)
        self.groups = GroupTracker(0, self.config.group_bytes)
        self.prefetcher = Prefetcher(self.config.prefetch_bytes, start=None)
        self.reader = Reader(self.io, self.index, self.prefetcher)
        self.prefetcher.start = self.reader.start_read
        self.index.on_dead = self.reader.retire
        policy = Policy(self.config.min_offload_bytes)
        self.packer = Packer(self.io, self.index, policy, self.groups)
        self.steps = 0

    def begin(self) -> StepState:
        self.steps += 1
        st = StepState(self.steps, self.clock)
        self.groups.begin(st, None)
        return st

    def end(self, st: StepState, prefetch: bool = True) -> None:
        """The forward is over: batches sealed; with ``prefetch``, the plan's reads start."""
        with self.io.lock:
            self.packer.seal_all()
            self.groups.end()
            st.finish_forward()
            if prefetch:
                self.prefetcher.arm(st)

    def settle(self) -> None:
        """Every write and read issued so far has completed, and dead handles are buried."""
        self.io.drain()

    def pack(self, t: torch.Tensor, st: StepState) -> Any:
        return self.packer.pack(t, st)

    def unpack(self, h: Any) -> torch.Tensor:
        return self.reader.unpack(h)

    def close(self) -> None:
        self.io.drain()
        self.backend.close()
