"""The CUDA adapter's ordering, checked against a fake CUDA whose copies run late.

The fake queues every copy on its stream and runs it only when something synchronizes: an
event's ``synchronize``/``query`` runs its stream up to the event, and a stream's
``synchronize`` first runs whatever it waits on. So a missing event, wait or reference makes the
bytes stale and the test fails, as it would on a GPU.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from tba.device import CpuAdapter, CudaAdapter, adapter_for
from tba.staging import StagingPool


class FakeStream:
    def __init__(self, cuda, name):
        self.cuda = cuda
        self.name = name
        self.ops: list = []  # callables, run in order
        self.done = 0
        self.waits: list = []  # (event) this stream must see complete before its next ops

    def run_to(self, n):
        with self.cuda.lock:
            while self.done < n:
                op = self.ops[self.done]
                self.done += 1
                op()

    def enqueue(self, fn):
        self.ops.append(fn)
        self.cuda.log.append(("op", self.name))

    def wait_event(self, ev):
        self.cuda.log.append(("wait_event", self.name, ev.id))
        self.enqueue(ev.synchronize)

    def wait_stream(self, other):
        self.cuda.log.append(("wait_stream", self.name, other.name))
        n = len(other.ops)
        self.enqueue(lambda: other.run_to(n))

    def synchronize(self):
        self.run_to(len(self.ops))


class FakeEvent:
    count = 0

    def __init__(self, cuda):
        FakeEvent.count += 1
        self.id = FakeEvent.count
        self.cuda = cuda
        self.stream = None
        self.pos = 0

    def record(self, stream):
        self.stream, self.pos = stream, len(stream.ops)
        self.cuda.log.append(("record", stream.name, self.id))

    def query(self):
        return self.stream is not None and self.stream.done >= self.pos

    def synchronize(self):
        if self.stream is not None:
            self.stream.run_to(self.pos)


class FakeCuda:
    """The few ``torch.cuda`` names the adapter uses."""

    def __init__(self):
        self.lock = threading.RLock()
        self.log: list = []
        self.default = FakeStream(self, "default")
        self.active = self.default
        self.created: list[FakeStream] = []

    def Stream(self, device=None):  # noqa: N802 - mirrors torch.cuda.Stream
        s = FakeStream(self, f"side{len(self.created)}")
        self.created.append(s)
        return s

    def Event(self):  # noqa: N802
        return FakeEvent(self)

    def current_stream(self, device=None):
        return self.default

    @contextlib.contextmanager
    def stream(self, s):
        prev, self.active = self.active, s
        try:
            yield
        finally:
            self.active = prev

    def copy(self, dst, src):
        # Reads the source when the stream runs, not now: a late read sees later changes.
        self.active.enqueue(lambda: dst.copy_(src))


@pytest.fixture
def fake():
    return FakeCuda()


@pytest.fixture
def adapter(fake):
    return CudaAdapter(torch.device("cpu"), cuda=fake, copy=fake.copy, pin=False)


def test_capture_orders_producer_event_wait_copy_event(adapter, fake):
    src = torch.arange(16, dtype=torch.float32)
    dst = torch.zeros(16)
    ticket = adapter.capture(dst, src)
    kinds = [entry[0] for entry in fake.log]
    # producer event on the default stream, side waits on it, the copy, then the copy's event
    assert kinds == ["record", "wait_event", "op", "op", "record"]
    assert fake.log[0][1] == "default" and fake.log[1][1] == "side0"
    assert fake.log[4][1] == "side0"
    assert not ticket.done() and torch.equal(dst, torch.zeros(16))  # nothing ran yet
    ticket.wait()
    assert torch.equal(dst, src)


def test_ticket_holds_source_until_copy_done(adapter):
    src = torch.ones(8)
    ticket = adapter.capture(torch.zeros(8), src)
    assert ticket.source is src  # the allocator cannot reuse it while the copy may read it
    ticket.wait()
    assert ticket.source is None


def test_to_device_consumer_waits_on_copy(adapter, fake):
    host = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    out = adapter.to_device(host, torch.device("cpu"))
    assert not torch.equal(out, host)  # the copy has not run yet
    waits = [e for e in fake.log if e[0] == "wait_event" and e[1] == "default"]
    assert waits, "the consumer stream must wait on the H2D copy's event"
    fake.default.synchronize()  # the consumer's next kernel would run here
    assert torch.equal(out, host)
    assert adapter._inflight and adapter._inflight[-1][1] is host  # pinned source kept alive


def test_side_stream_waits_for_consumer_before_h2d(adapter, fake):
    adapter.to_device(torch.ones(4, dtype=torch.uint8), torch.device("cpu"))
    first = next(e for e in fake.log if e[0] in ("wait_stream", "op"))
    assert first == ("wait_stream", "side0", "default")


def offloader_with_fake_cuda(make_offloader, fake, **kw):
    off = make_offloader(**kw)
    adapter = CudaAdapter(torch.device("cpu"), cuda=fake, copy=fake.copy, pin=False)
    arena = adapter.staging_arena(off.config.staging_bytes, off.align)
    off._adapters[torch.device("cpu")] = (adapter, StagingPool(arena, off.align))
    return off


def test_offloader_writes_only_after_capture_completes(make_offloader, fake):
    off = offloader_with_fake_cuda(make_offloader, fake)
    w = torch.randn(4096, requires_grad=True)
    x = torch.randn(4096)
    want = x.exp()
    with off.step():
        loss = (x.exp() * w).sum()  # saves exp(x): captured by the fake side stream
        del x
        off.synchronize()  # the capture thread waits for the copy's event, then writes
    loss.backward()
    assert off.stats()["bytes_reloaded"] > 0
    assert torch.equal(w.grad, want)  # stale (zero) staging would have been written otherwise


def test_inplace_before_capture_is_an_error(make_offloader, fake):
    import tba

    off = offloader_with_fake_cuda(make_offloader, fake)
    w = torch.randn(4096, requires_grad=True)
    hold = threading.Event()
    real_wait = CudaAdapter.capture

    # Keep the side stream from running until the in-place op has happened.
    def gated_capture(self, dst, src):
        ticket = real_wait(self, dst, src)
        event_sync = ticket.event.synchronize

        def late():
            hold.wait(10)
            event_sync()

        ticket.event.synchronize = late
        return ticket

    CudaAdapter.capture = gated_capture
    try:
        with off.step():
            y = torch.randn(4096).exp()
            loss = (y * w).sum()
        y.mul_(2)  # modified before its bytes were captured
        hold.set()
        off.synchronize()
        del y
        with pytest.raises(tba.UnpackError, match="modified by an inplace operation"):
            loss.backward()
    finally:
        CudaAdapter.capture = real_wait


def test_cpu_adapter_is_synchronous_and_zero_copy():
    a = CpuAdapter()
    src = torch.randn(10)
    dst = torch.empty(10)
    assert a.capture(dst, src).done() and torch.equal(dst, src)
    host = a.host_buffer(8192, 4096)
    assert host.data_ptr() % 4096 == 0 and a.to_device(host, torch.device("cpu")) is host
    assert isinstance(adapter_for(torch.device("cpu")), CpuAdapter)


@pytest.mark.gpu
def test_real_cuda_round_trip(make_offloader):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()
    x = torch.randn(64, 256, device="cuda")
    model(x).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    off = make_offloader()
    with off.step(model):
        loss = model(x).square().sum()
    loss.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want))
    assert off.stats()["tensors_offloaded"] > 0
