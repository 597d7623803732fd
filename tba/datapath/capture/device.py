"""Device adapters: the only place in tba with streams, events and pinned memory.

An adapter moves bytes between a saved tensor's device and aligned host memory:

- ``capture(dst, src)`` copies a saved tensor (or its storage bytes) into a staging view and
  returns a :class:`Ticket`; the bytes may be written to disk only after ``ticket.wait()``.
- ``host_buffer(n)`` allocates the aligned memory a read lands in (host memory, or device memory
  in device-direct mode).
- ``upload(host, device)`` starts the copy of read bytes to the device (CUDA: on the side
  stream, ahead of the unpack that needs them; NOTE [Device prefetch] in tba/datapath/prefetch.py)
  and returns an :class:`Upload`; ``hand_out(x)`` (an Upload, or the read buffer itself where
  ``uploads`` is False) returns the device-side uint8 tensor, ordered so that the *current*
  stream may use it at once. ``to_device(host, device)`` is the two in one.

The CPU adapter is synchronous and zero-copy on the read side. The CUDA adapter follows the
ordering rules below; it cannot run in this project's CI (no GPU) and is tested for ordering
with fakes (``tests/datapath/test_device.py``) and for real by ``gpu``-marked tests.

# NOTE [CUDA ordering]
1. Capture: an event is recorded on the producer (current) stream at pack time and the side
   stream waits on it before the D2H copy, so the copy reads finished values.
2. The source tensor is referenced by the ticket until the copy's completion event has fired, so
   the caching allocator cannot hand its memory to another tensor while the copy reads it.
3. The staging bytes are written to disk only after the copy's event completed (``Ticket.wait``).
   That event is created with ``blocking=True``, so the waiting thread sleeps instead of
   spinning a core.
4. Read-back (``upload``, possibly on an I/O thread, ahead of the unpack): the device buffer
   is allocated under the side stream and the H2D copy runs there, followed by an event. The
   pinned source is kept alive until that event completes (pruned at later captures and
   uploads). Allocating under the side stream is what lets the copy start before any consumer
   exists: the caching allocator hands the side stream only memory whose earlier uses on it
   are ordered before the copy, so no ``wait_stream`` on the consumer is needed.
4a. Hand-out (``hand_out``, at unpack, on the training thread): the consumer (current) stream
   waits on the copy's event before any kernel it runs later (no host sync), and the buffer is
   ``record_stream``-ed on the consumer, once per consumer stream. The rule this follows: a
   block used on a stream other than the one it was allocated under must be recorded on that
   stream, else, once freed, the allocator gives it back to the side stream at once and a
   later upload can overwrite it while the consumer's kernels queued before the free still
   read it. (Holding a Python reference until the consumer finishes would need a host sync.)

Device-direct mode (``direct=True``, for GPUDirect Storage): the staging arena and the read
buffers are device memory. cuFile moves bytes between them and the drive by DMA, and that DMA is
ordered on no CUDA stream (before a transfer, kvikio synchronizes only the legacy default
stream). Therefore:

5. Capture is a D2D copy on the side stream under rules 1-3. The GDS write may start only after
   ``Ticket.wait``: the event is the only thing that orders the copy before the DMA.
6. A read buffer is allocated under the side stream, and the host then waits for the side stream
   up to that point. If the allocator recycled memory from a side-stream temporary (a copy's
   contiguous source), no queued copy still touches it when the DMA lands. The side stream only
   carries copies, so the wait is short.
7. A GDS read has completed when its future resolves: cuFileRead returns after its DMA, and
   kvikio's POSIX fallback synchronizes its own bounce copy. So ``hand_out`` returns the buffer
   itself, with no copy and no event: any kernel queued later sees the bytes. It calls
   ``record_stream(consumer)``, so that once the buffer is freed the allocator does not give the
   block to a later read (whose DMA would overwrite it) before the consumer's kernels queued
   ahead of the free have finished.
8. Bytes still in staging when backward wants them are copied D2D on the side stream into a
   read buffer, and the host waits for that copy's event before the buffer is handed out.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from ...host.malloc import CACHING_MALLOCS, malloc_name
from ...host.memory import MAPPED_BYTES, PAGE, MappedPool, aligned_empty


def _device_empty(nbytes: int, align: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` on ``device`` whose address is a multiple of ``align``."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8, device=device)
    start = (-raw.data_ptr()) % align
    return raw[start : start + nbytes]


class Upload:
    """Read bytes being copied to the device: ``buf`` once ``event`` has completed; ``streams``
    are the consumer streams ``buf`` was recorded on (NOTE [CUDA ordering] 4a)."""

    __slots__ = ("buf", "event", "streams")

    def __init__(self, buf: torch.Tensor, event: Any):
        self.buf = buf
        self.event = event
        self.streams: list[Any] = []


class Ticket:
    """Completion of a device→host capture. CPU captures are complete on return."""

    __slots__ = ()

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = Ticket()


class DeviceAdapter(Protocol):
    name: str

    def staging_arena(self, nbytes: int, align: int) -> torch.Tensor: ...

    def host_buffer(self, nbytes: int, align: int) -> torch.Tensor: ...

    def capture(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket: ...

    uploads: bool  # True: read bytes reach the device through upload() (NOTE [Device prefetch])

    def upload(self, host: torch.Tensor, device: torch.device) -> Upload: ...

    def hand_out(self, got: Any) -> torch.Tensor: ...

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor: ...

    def copy_staged(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def trim(self) -> None: ...


class CpuAdapter:
    """Host memory is device memory: captures are memcpy, read-backs are zero-copy.

    Read buffers of 1 MiB and more come from a :class:`MappedPool` of at most ``pool_bytes``
    (NOTE [Read buffer reuse]); ``trim()`` unmaps its free mappings. Under an allocator that
    keeps what is freed (``heap``, by default when :func:`malloc_name` names one) they come
    from torch's allocator instead (NOTE [Read buffers from the heap]).
    """

    name = "cpu"
    uploads = False

    def __init__(self, pool_bytes: int = 0, heap: bool | None = None):
        self.heap = malloc_name() in CACHING_MALLOCS if heap is None else heap
        self.pool = MappedPool(pool_bytes)

    def staging_arena(self, nbytes: int, align: int) -> torch.Tensor:
        return aligned_empty(nbytes, align)

    def host_buffer(self, nbytes: int, align: int) -> torch.Tensor:
        if self.heap:
            return aligned_empty(nbytes, align, heap=True)
        if nbytes >= MAPPED_BYTES and PAGE % align == 0:
            return self.pool.get(nbytes)
        return aligned_empty(nbytes, align)

    def trim(self) -> None:
        self.pool.trim()

    def capture(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        # Synchronous on the packing thread: no later in-place op can race with this copy.
        dst.copy_(src)
        return DONE

    def upload(self, host: torch.Tensor, device: torch.device) -> Upload:
        return Upload(host, None)

    def hand_out(self, got: Any) -> torch.Tensor:
        return got.buf if isinstance(got, Upload) else got

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host

    def copy_staged(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy captured staging bytes into a buffer of :meth:`host_buffer`; done on return."""
        dst.copy_(src)


class DeviceClock:
    """A step's timeline on a CUDA device (NOTE [Device clock] in tba/host/clock.py): a mark
    is a timing event recorded on the current stream, taken from a pool that passed marks go
    back to. ``cuda`` is ``torch.cuda`` or a fake with the same few names."""

    def __init__(self, device: torch.device, cuda: Any = None):
        self.cuda = torch.cuda if cuda is None else cuda
        self.device = device
        self._spare: list[Any] = []
        self.made = 0  # events made: a steady run stops making them

    def mark(self, again: Any = None) -> Any:
        ev = again
        if ev is None:
            try:
                ev = self._spare.pop()  # atomic: backward's device thread marks too
            except IndexError:
                ev = self.cuda.Event(enable_timing=True)
                self.made += 1
        ev.record(self.cuda.current_stream(self.device))
        return ev

    def passed(self, marks: Any) -> bool:
        return all(ev.query() for ev in marks)

    def wait(self, marks: Any) -> None:
        for ev in marks:
            ev.synchronize()  # close only: no step runs

    def elapsed(self, a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) / 1000.0  # milliseconds

    def release(self, marks: Any) -> None:
        self._spare.extend(marks)


# NOTE [Copy timing]
# The copies to and from the device are timed by the device too: an event is recorded on the
# side stream just before each copy and its completion event after it (both timing events), and
# the copy's seconds are read once the completion event is known to have fired: when its ticket
# sees it (``query`` true, or the capture thread's wait returned) or when ``_prune`` finds an
# upload done. No wait is added. Each reading goes to ``copies`` ((to_host, bytes, seconds)),
# which the Offloader drains between steps: the copy bandwidth bounds the tier's, since a
# transfer is a copy and then a disk's write (or a read and then a copy), pipelined. A step
# that sent nothing to the disk (the host tier held it all) has no disk rate: the host tier's
# copies give the rates instead, or the controllers would wait for a disk figure that never
# comes (auto, on an H200, offloaded every block step after step and never decided). The
# start events are pooled as the copy events are (NOTE [Capture events]).


# NOTE [Capture events]
# A CUDA capture needs two events (NOTE [CUDA ordering] rules 1 and 3); making two per saved
# tensor cost the packing thread their creation and, later, the GC their objects. They are
# reused instead. The producer event is one per adapter: a stream's ``wait_event`` waits for the
# work the event had recorded when it was called, so recording the same event again for the next
# capture cannot shorten an earlier wait (only the packing thread records it). A copy event goes
# back to the adapter's spares once its ticket has seen it fire (``query`` true, or
# ``synchronize`` returned), and a later capture records it again; the ticket never reads it
# after that, and nothing else holds it (an Upload's event and the direct-mode read and copy
# events are made for their one use, as before).
class _CudaTicket(Ticket):
    __slots__ = ("event", "source", "spare", "began", "adapter", "nbytes")

    def __init__(
        self,
        event: Any,
        source: torch.Tensor,
        spare: list[Any],
        began: Any = None,
        adapter: CudaAdapter | None = None,
        nbytes: int = 0,
    ):
        self.event = event
        self.source = source  # NOTE [CUDA ordering] rule 2: keeps the source's memory alive
        self.spare = spare  # the adapter's free copy events: this one goes back there once fired
        self.began = began  # recorded before the copy (NOTE [Copy timing])
        self.adapter = adapter
        self.nbytes = nbytes

    def done(self) -> bool:
        if self.source is None:
            return True
        if self.event.query():
            self._fired()
            return True
        return False

    def wait(self) -> None:
        if self.source is not None:
            self.event.synchronize()  # rule 3: bytes are final only after the copy's event
            self._fired()

    def _fired(self) -> None:
        """The copy completed: the source may go, and the event serves a later capture (the
        ticket never looks at it again: ``source`` is None from now on)."""
        self.source = None
        a, began = self.adapter, self.began
        if a is not None and began is not None:  # NOTE [Copy timing]: both have fired
            a.copied(True, self.nbytes, began, self.event)
            a._began.append(began)
        self.spare.append(self.event)  # list.append: atomic, from whichever thread waited


class CudaAdapter:
    """D2H on a side stream into pinned staging; H2D ordered before the consumer's kernels.

    With ``direct=True`` (GDS) staging and read buffers live on the device instead: captures are
    D2D copies and read-backs need no copy (NOTE [CUDA ordering] 5-7).

    ``cuda`` is the ``torch.cuda`` module, or a fake with the same few names in tests; ``copy``
    performs ``dst.copy_(src, non_blocking=True)`` under the active stream, and
    ``record_stream`` performs ``tensor.record_stream(stream)``.
    """

    def __init__(
        self,
        device: torch.device,
        cuda: Any = None,
        copy: Any = None,
        pin=True,
        direct: bool = False,
        record_stream: Any = None,
    ):
        self.cuda = torch.cuda if cuda is None else cuda
        self.pin = pin
        self.direct = direct
        self.uploads = not direct  # direct: the read lands on the device (rule 7)
        self.name = "cuda-direct" if direct else "cuda"
        self.device = device
        self.side = self.cuda.Stream(device=device)
        self._copy = copy or (lambda dst, src: dst.copy_(src, non_blocking=True))
        self._record_stream = record_stream or (lambda t, stream: t.record_stream(stream))
        # (event, pinned source, start event) of H2D copies in flight
        self._inflight: list[tuple[Any, torch.Tensor, Any]] = []
        self._lock = threading.Lock()
        # NOTE [Capture events]: the producer event rule 1 records at every capture, and the
        # blocking copy events whose captures have completed, ready for the next ones
        self._produced: Any = None
        self._spare: list[Any] = []
        self._began: list[Any] = []  # free start events of copies (NOTE [Copy timing])
        self.copies: list[tuple[bool, int, float]] = []  # (to host, bytes, device seconds)
        self.clock = DeviceClock(device, self.cuda)  # a step's timeline on this device

    def staging_arena(self, nbytes: int, align: int) -> torch.Tensor:
        if self.direct:
            return _device_empty(nbytes, align, self.device)
        return aligned_empty(nbytes, align, pin=self.pin)

    def host_buffer(self, nbytes: int, align: int) -> torch.Tensor:
        if not self.direct:
            return aligned_empty(nbytes, align, pin=self.pin)
        with self.cuda.stream(self.side):  # rule 6
            buf = _device_empty(nbytes, align, self.device)
            ready = self.cuda.Event(blocking=True)
            ready.record(self.side)
        ready.synchronize()
        return buf

    def capture(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        """Packing thread only (the producer event is this adapter's one, NOTE [Capture
        events])."""
        self._prune()
        produced = self._produced
        if produced is None:
            produced = self._produced = self.cuda.Event()
        produced.record(self.cuda.current_stream(self.device))  # rule 1
        self.side.wait_event(produced)
        spare = self._spare
        with self.cuda.stream(self.side):
            began = self._start_event()
            self._copy(dst, src)  # D2H into pinned staging, or D2D in direct mode (rule 5)
            # a host thread waits on it (rule 3), hence blocking; timed (NOTE [Copy timing])
            copied = spare.pop() if spare else self.cuda.Event(blocking=True, enable_timing=True)
            copied.record(self.side)
        return _CudaTicket(copied, src, spare, began, self, dst.numel() * dst.element_size())

    def _start_event(self) -> Any:
        """A timing event recorded on the side stream now, before a copy (NOTE [Copy
        timing])."""
        try:
            began = self._began.pop()
        except IndexError:
            began = self.cuda.Event(enable_timing=True)
        began.record(self.side)
        return began

    def copied(self, to_host: bool, nbytes: int, began: Any, done: Any) -> None:
        """A copy of ``nbytes`` ran from ``began`` to ``done``, both fired (NOTE [Copy
        timing])."""
        seconds = float(began.elapsed_time(done)) / 1000.0
        with self._lock:
            self.copies.append((to_host, nbytes, seconds))

    def take_copies(self) -> list[tuple[bool, int, float]]:
        """The copies timed since the last call."""
        with self._lock:
            got, self.copies = self.copies, []
        return got

    def upload(self, host: torch.Tensor, device: torch.device) -> Upload:
        """Start the H2D copy of ``host`` on the side stream (rule 4); any thread."""
        with self.cuda.stream(self.side):
            out = torch.empty(host.shape, dtype=host.dtype, device=device)  # under the side
            began = self._start_event()
            self._copy(out, host)
            copied = self.cuda.Event(enable_timing=True)
            copied.record(self.side)
        self._prune()
        with self._lock:
            # rule 4: pinned source outlives the copy; timed once done (NOTE [Copy timing])
            self._inflight.append((copied, host, began))
        return Upload(out, copied)

    def hand_out(self, got: Any) -> torch.Tensor:
        """The device bytes, usable by the current stream's next kernels (rules 4a and 7)."""
        consumer = self.cuda.current_stream(self.device)
        if not isinstance(got, Upload):  # direct mode: the read buffer itself (rule 7)
            self._record_stream(got, consumer)
            return got
        consumer.wait_event(got.event)
        if not any(s == consumer for s in got.streams):
            self._record_stream(got.buf, consumer)  # rule 4a
            got.streams.append(consumer)
        return got.buf

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return self.hand_out(host if self.direct else self.upload(host, device))

    def copy_staged(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy captured staging bytes into a :meth:`host_buffer` buffer; done on return.

        Staged mode: both are pinned host memory, so a CPU copy. Direct mode: a D2D copy on the
        side stream, waited for, since it may run on an I/O thread whose current stream no
        consumer is ordered with (rule 8); ``to_device`` then hands out ``dst`` as it is.
        """
        if not self.direct:
            dst.copy_(src)
            return
        with self.cuda.stream(self.side):
            self._copy(dst, src)
            copied = self.cuda.Event(blocking=True)
            copied.record(self.side)
        copied.synchronize()

    def trim(self) -> None:
        """Pinned buffers are cached by torch's host allocator; nothing of tba's to release."""

    def _prune(self) -> None:
        """Drop the pinned sources whose H2D copies have completed."""
        with self._lock:
            if not self._inflight:
                return
            left = []
            for e, h, began in self._inflight:
                if not e.query():
                    left.append((e, h, began))
                    continue
                seconds = float(began.elapsed_time(e)) / 1000.0  # NOTE [Copy timing]
                self.copies.append((False, h.numel() * h.element_size(), seconds))
                self._began.append(began)
            self._inflight = left


def adapter_for(device: torch.device, direct: bool = False) -> DeviceAdapter:
    """The adapter for tensors on ``device``; ``direct`` keeps CUDA staging on the device (GDS)."""
    if device.type == "cuda":
        return CudaAdapter(device, direct=direct)
    return CpuAdapter()
