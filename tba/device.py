"""Device adapters: the only place in tba with streams, events and pinned memory.

An adapter moves bytes between a saved tensor's device and aligned host memory:

- ``capture(dst, src)`` copies a saved tensor (or its storage bytes) into a staging view and
  returns a :class:`Ticket`; the bytes may be written to disk only after ``ticket.wait()``.
- ``host_buffer(n)`` allocates the aligned host memory a read lands in.
- ``to_device(host, device)`` returns a device-side uint8 tensor holding the host bytes, ordered
  so that the *current* stream may use it at once.

The CPU adapter is synchronous and zero-copy on the read side. The CUDA adapter follows the
ordering rules below; it cannot run in this project's CI (no GPU) and is tested for ordering
with fakes (``tests/test_device.py``) and for real by ``gpu``-marked tests.

# NOTE [CUDA ordering]
1. Capture: an event is recorded on the producer (current) stream at pack time and the side
   stream waits on it before the D2H copy, so the copy reads finished values.
2. The source tensor is referenced by the ticket until the copy's completion event has fired, so
   the caching allocator cannot hand its memory to another tensor while the copy reads it.
3. The staging bytes are written to disk only after the copy's event completed (``Ticket.wait``).
4. Read-back: the device buffer is allocated on the consumer (current) stream; the side stream
   first waits for the consumer's pending work (the allocator may reuse memory freed there),
   then copies H2D; the consumer stream waits on the copy's event before any kernel reads it.
   The pinned source is kept alive until that event completes.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from ._memory import aligned_empty


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

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor: ...


class CpuAdapter:
    """Host memory is device memory: captures are memcpy, read-backs are zero-copy."""

    name = "cpu"

    def staging_arena(self, nbytes: int, align: int) -> torch.Tensor:
        return aligned_empty(nbytes, align)

    def host_buffer(self, nbytes: int, align: int) -> torch.Tensor:
        return aligned_empty(nbytes, align)

    def capture(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        # Synchronous on the packing thread: no later in-place op can race with this copy.
        dst.copy_(src)
        return DONE

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host


class _CudaTicket(Ticket):
    __slots__ = ("event", "source")

    def __init__(self, event: Any, source: torch.Tensor):
        self.event = event
        self.source = source  # NOTE [CUDA ordering] rule 2: keeps the source's memory alive

    def done(self) -> bool:
        if self.source is None:
            return True
        if self.event.query():
            self.source = None
            return True
        return False

    def wait(self) -> None:
        if self.source is not None:
            self.event.synchronize()  # rule 3: bytes are final only after the copy's event
            self.source = None


class CudaAdapter:
    """D2H on a side stream into pinned staging; H2D ordered before the consumer's kernels.

    ``cuda`` is the ``torch.cuda`` module, or a fake with the same few names in tests; ``copy``
    performs ``dst.copy_(src, non_blocking=True)`` under the active stream.
    """

    name = "cuda"

    def __init__(self, device: torch.device, cuda: Any = None, copy: Any = None, pin=True):
        self.cuda = torch.cuda if cuda is None else cuda
        self.pin = pin
        self.device = device
        self.side = self.cuda.Stream(device=device)
        self._copy = copy or (lambda dst, src: dst.copy_(src, non_blocking=True))
        self._inflight: list[tuple[Any, torch.Tensor]] = []  # (event, pinned source) of H2D
        self._lock = threading.Lock()

    def staging_arena(self, nbytes: int, align: int) -> torch.Tensor:
        return aligned_empty(nbytes, align, pin=self.pin)

    def host_buffer(self, nbytes: int, align: int) -> torch.Tensor:
        return aligned_empty(nbytes, align, pin=self.pin)

    def capture(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        produced = self.cuda.Event()
        produced.record(self.cuda.current_stream(self.device))  # rule 1
        self.side.wait_event(produced)
        with self.cuda.stream(self.side):
            self._copy(dst, src)
            copied = self.cuda.Event()
            copied.record(self.side)
        return _CudaTicket(copied, src)

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        consumer = self.cuda.current_stream(device)
        out = torch.empty(host.shape, dtype=host.dtype, device=device)  # on the consumer stream
        self.side.wait_stream(consumer)  # rule 4: memory may be reused from consumer-side frees
        with self.cuda.stream(self.side):
            self._copy(out, host)
            copied = self.cuda.Event()
            copied.record(self.side)
        # The consumer waits before anything else it runs, so a later free of ``out`` on the
        # consumer stream is ordered after the copy: no record_stream is needed.
        consumer.wait_event(copied)
        with self._lock:
            self._inflight = [(e, h) for e, h in self._inflight if not e.query()]
            self._inflight.append((copied, host))  # rule 4: pinned source outlives the copy
        return out


def adapter_for(device: torch.device) -> DeviceAdapter:
    """The adapter for tensors on ``device``."""
    if device.type == "cuda":
        return CudaAdapter(device)
    return CpuAdapter()
