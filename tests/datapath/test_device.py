"""The CUDA adapter's ordering, checked against a fake CUDA whose copies run late.

The fake queues every copy on its stream and runs it only when something synchronizes: an
event's ``synchronize``/``query`` runs its stream up to the event, and a stream's
``synchronize`` first runs whatever it waits on. So a missing event, wait or reference makes the
bytes stale and the test fails, as it would on a GPU.

Device-direct mode (GDS) is run with ``device=cpu``: "device memory" is then host memory, so the
tests check where it is allocated (under which stream, through which helper) and that no host
staging or H2D copy is made. The ``gpu``-marked tests at the end run both modes for real.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

import tba.datapath.capture.device as device_mod
from tba.config import Config
from tba.datapath.capture.device import CpuAdapter, CudaAdapter, adapter_for
from tba.datapath.capture.staging import StagingPool
from tba.storage.memory import MemoryBackend

from .._fake_cuda import FakeCuda


@pytest.fixture
def fake():
    return FakeCuda()


@pytest.fixture
def adapter(fake):
    return CudaAdapter(
        torch.device("cpu"), cuda=fake, copy=fake.copy, pin=False, record_stream=fake.record_stream
    )


def test_capture_orders_producer_event_wait_copy_event(adapter, fake):
    src = torch.arange(16, dtype=torch.float32)
    dst = torch.zeros(16)
    ticket = adapter.capture(dst, src)
    kinds = [entry[0] for entry in fake.log]
    # producer event on the default stream, side waits on it, the copy between its start
    # event (NOTE [Copy timing]) and the copy's event
    assert kinds == ["record", "wait_event", "op", "record", "op", "record"]
    assert fake.log[0][1] == "default" and fake.log[1][1] == "side0"
    assert fake.log[3][1] == fake.log[5][1] == "side0"
    assert not ticket.done() and torch.isnan(dst).all()  # nothing ran yet: the fake's garbage
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


def test_upload_allocates_under_the_side_stream_and_hand_out_records_the_consumer(
    adapter, fake, monkeypatch
):
    """NOTE [CUDA ordering] 4 and 4a: the buffer is made under the side stream (so the copy
    needs no wait on a consumer that may not exist yet), and recorded on each consumer once."""
    made = []
    real_empty = torch.empty

    def empty(*a, **kw):
        made.append(fake.active.name)
        return real_empty(*a, **kw)

    monkeypatch.setattr(device_mod.torch, "empty", empty)
    up = adapter.upload(torch.ones(4, dtype=torch.uint8), torch.device("cpu"))
    monkeypatch.undo()
    assert made == ["side0"]
    assert not any(e[0] == "wait_stream" for e in fake.log)
    assert fake.recorded_streams == []  # nothing uses it yet
    out = adapter.hand_out(up)
    adapter.hand_out(up)  # a second use on the same stream: waits again, records once
    assert out is up.buf and fake.recorded_streams == [(up.buf, fake.default)]
    waits = [e for e in fake.log if e[0] == "wait_event"]
    assert waits == [("wait_event", "default", up.event.id)] * 2


def offloader_with_fake_cuda(make_offloader, fake, **kw):
    """An Offloader whose "device" (the CPU) goes through the CUDA adapter over ``fake``; the
    consumer stream is eager (autograd's CPU kernels use an unpacked tensor at once)."""
    fake.default.eager = True
    off = make_offloader(**kw)
    adapter = CudaAdapter(
        torch.device("cpu"), cuda=fake, copy=fake.copy, pin=False, record_stream=fake.record_stream
    )
    arena = adapter.staging_arena(off.config.staging_bytes, off.io.align)
    off.io.add_adapter(torch.device("cpu"), adapter, StagingPool(arena, off.io.align))
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


def test_producer_event_is_recorded_before_the_copy_and_waited_on(adapter, fake):
    adapter.capture(torch.zeros(4), torch.ones(4))
    produced = fake.events[0]
    record = fake.log.index(("record", "default", produced.id))
    wait = fake.log.index(("wait_event", "side0", produced.id))
    copy = max(i for i, e in enumerate(fake.log) if e == ("op", "side0"))
    assert record < wait < copy  # the side stream runs the copy only after the producer's work
    assert produced.stream is fake.default


def test_capture_events_are_reused_only_once_fired(adapter, fake):
    """NOTE [Capture events]: one producer event; a copy event serves again only after its
    ticket saw it fire, and every capture still copies its own bytes, in order."""
    srcs = [torch.full((256,), float(i)) for i in range(4)]
    dsts = [torch.zeros(256) for _ in srcs]
    first = adapter.capture(dsts[0], srcs[0])
    second = adapter.capture(dsts[1], srcs[1])  # the first is still queued: a new copy event
    assert second.event is not first.event
    second.wait()  # runs the side stream through both copies
    assert first.done()
    third = adapter.capture(dsts[2], srcs[2])
    fourth = adapter.capture(dsts[3], srcs[3])
    assert {third.event, fourth.event} == {first.event, second.event}  # both fired: reused
    assert all(ev.blocking for ev in (third.event, fourth.event))
    assert {third.began, fourth.began} == {first.began, second.began}  # NOTE [Copy timing]
    produced = [ev for ev in fake.events if not ev.timing]
    # one producer, two copy events and their two start events
    assert len(produced) == 1 and len(fake.events) == 5
    assert not third.done() and not fourth.done()  # recorded again: pending until they run
    fourth.wait()
    assert third.done()
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_copy_event_blocks_instead_of_spinning(adapter, fake):
    ticket = adapter.capture(torch.zeros(4), torch.ones(4))
    assert ticket.event.blocking and ticket.event.stream is adapter.side


def test_source_is_not_released_before_the_copys_event(adapter, fake):
    src = torch.arange(1024, dtype=torch.float32)
    want = src.clone()
    ref = weakref.ref(src)
    dst = torch.zeros(1024)
    ticket = adapter.capture(dst, src)
    del src
    gc.collect()
    assert ref() is not None  # the allocator cannot hand the memory out: the copy has not run
    assert not ticket.done() and ref() is not None  # polling keeps it too
    adapter.side.run_to(ticket.event.pos)  # the copy's event fires
    assert ticket.done()
    gc.collect()
    assert ref() is None  # released only now
    assert torch.equal(dst, want)


def test_consumer_waits_on_the_h2d_copys_event(adapter, fake):
    host = torch.randint(0, 256, (8192,), dtype=torch.uint8)
    out = adapter.to_device(host, torch.device("cpu"))
    copied = fake.events[-1]
    assert copied.stream is adapter.side
    copy = max(i for i, e in enumerate(fake.log) if e == ("op", "side0"))
    assert fake.log.index(("record", "side0", copied.id)) > copy  # recorded after the copy
    assert ("wait_event", "default", copied.id) in fake.log
    # The consumer's queue waits on that event before anything enqueued later.
    fake.default.enqueue(lambda: None)  # the next kernel
    fake.default.synchronize()
    assert torch.equal(out, host)


def test_two_captures_in_flight_in_two_staging_blocks(fake):
    """The first capture is written while the second copy is still queued on the side stream."""
    adapter = CudaAdapter(
        torch.device("cpu"), cuda=fake, copy=fake.copy, pin=False, record_stream=fake.record_stream
    )
    arena = adapter.staging_arena(1 << 20, 4096)
    arena.zero_()
    pool = StagingPool(arena, 4096)
    a, b = pool.alloc(65536), pool.alloc(65536)
    assert a.offset != b.offset
    src_a = torch.randint(0, 256, (65536,), dtype=torch.uint8)
    src_b = torch.randint(0, 256, (65536,), dtype=torch.uint8)
    want_a, want_b = src_a.clone(), src_b.clone()
    t_a = adapter.capture(a.tensor, src_a)
    t_b = adapter.capture(b.tensor, src_b)
    t_a.wait()  # the writer thread waits for the first copy only
    assert torch.equal(a.tensor, want_a)
    assert not t_b.done() and bool((b.tensor == 0x5A).all())  # still queued: the fake's garbage
    backend = MemoryBackend(Config(environ={}, backend="memory"))
    ext = backend.allocate(65536)
    written = backend.write(ext, a.view)  # the first block goes to "disk" now
    src_a.add_(1)  # the first source may be reused: its bytes are already final
    written.result()
    back = bytearray(65536)
    backend.read(ext, memoryview(back)).result()
    assert bytes(back) == want_a.numpy().tobytes()
    t_b.wait()
    assert torch.equal(b.tensor, want_b)
    backend.close()


def test_finished_h2d_sources_are_dropped_at_the_next_capture(adapter, fake):
    host = torch.ones(4096, dtype=torch.uint8)
    adapter.to_device(host, torch.device("cpu"))
    assert adapter._inflight[-1][1] is host
    fake.default.synchronize()  # the copy ran
    adapter.capture(torch.zeros(4), torch.ones(4))
    assert adapter._inflight == []


@pytest.fixture
def direct(fake):
    return CudaAdapter(
        torch.device("cpu"),
        cuda=fake,
        copy=fake.copy,
        pin=False,
        direct=True,
        record_stream=fake.record_stream,
    )


@pytest.fixture
def no_host_staging(monkeypatch, fake):
    """Fail on any host staging allocation; record where device buffers are made."""

    def host_alloc(*a, **kw):
        raise AssertionError("direct mode made a host staging buffer")

    made = []
    real = device_mod._device_empty

    def device_alloc(nbytes, align, device):
        made.append((nbytes, align, device, fake.active.name))
        return real(nbytes, align, device)

    monkeypatch.setattr(device_mod, "aligned_empty", host_alloc)
    monkeypatch.setattr(device_mod, "_device_empty", device_alloc)
    return made


def test_direct_mode_allocates_on_the_device(direct, fake, no_host_staging):
    assert direct.name == "cuda-direct" and direct.direct
    arena = direct.staging_arena(1 << 20, 4096)
    assert arena.device == direct.device and arena.dtype == torch.uint8
    assert arena.numel() == 1 << 20 and arena.data_ptr() % 4096 == 0
    buf = direct.host_buffer(8192, 4096)
    assert buf.device == direct.device and buf.data_ptr() % 4096 == 0
    assert no_host_staging == [
        (1 << 20, 4096, direct.device, "default"),
        (8192, 4096, direct.device, "side0"),
    ]
    # The read buffer was made under the side stream, and the host waited for it (rule 6).
    ready = fake.events[-1]
    assert ready.stream is direct.side and ready.blocking and ready.synced


def test_direct_capture_is_an_ordered_device_copy(direct, fake, no_host_staging):
    arena = direct.staging_arena(1 << 20, 4096)
    src = torch.randn(4096)
    want = src.clone()
    dst = arena[: 4096 * 4].view(torch.float32)
    ticket = direct.capture(dst, src)
    kinds = [entry[0] for entry in fake.log]
    assert kinds == ["record", "wait_event", "op", "record", "op", "record"]  # as staged
    assert not ticket.done() and ticket.source is src
    src.mul_(0)  # would show up if the copy ran late without the event
    src.copy_(want)
    ticket.wait()  # the GDS write may start only now
    assert torch.equal(dst, want) and ticket.source is None


def test_direct_read_back_is_the_buffer_itself(direct, fake, no_host_staging):
    buf = direct.host_buffer(8192, 4096)
    buf.copy_(torch.randint(0, 256, (8192,), dtype=torch.uint8))  # "the GDS read landed"
    before = len(fake.log)
    out = direct.to_device(buf, torch.device("cpu"))
    assert out is buf  # no H2D copy, no host round trip
    assert fake.log[before:] == [("record_stream", "default")]  # only the allocator is told
    assert fake.recorded_streams == [(buf, fake.default)]
    assert direct._inflight == []


def test_offloader_in_direct_mode_copies_staged_bytes_on_the_side_stream(
    make_offloader, fake, direct
):
    """Backward reaches a tensor whose write is still in flight: its bytes come from the
    (device) staging block by a side-stream copy that is waited for (rule 8), not stale."""
    import os

    off = make_offloader(backend="posix")
    adapter = direct
    arena = adapter.staging_arena(off.config.staging_bytes, off.io.align)
    off.io.add_adapter(torch.device("cpu"), adapter, StagingPool(arena, off.io.align))
    release = threading.Event()

    def slow_write(*args):
        release.wait(30)
        return os.pwrite(*args)

    off.backend._pwrite = slow_write
    w = torch.randn(4096, requires_grad=True)
    x = torch.randn(4096)
    want = x.exp()
    with off.step():
        y = x.exp()
        alive = weakref.ref(y)
        loss = (y * w).sum()  # saves exp(x); its write blocks until released
        del x, y
    deadline = time.monotonic() + 10
    while alive() is not None and time.monotonic() < deadline:
        time.sleep(0.001)  # the capture thread drops the source once its copy's event fired
    assert alive() is None  # so backward cannot be served by the original tensor
    loss.backward()
    release.set()
    off.synchronize()
    assert torch.equal(w.grad, want)  # a staged copy not waited for would give stale bytes
    assert off.stats()["forwarded"] >= 1 and off.stats()["bytes_reloaded"] == 0


def test_adapter_for_ignores_direct_on_the_cpu():
    assert isinstance(adapter_for(torch.device("cpu"), direct=True), CpuAdapter)


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


@pytest.mark.gpu
@pytest.mark.parametrize("direct", [False, True], ids=["staged", "direct"])
def test_real_cuda_adapter_round_trip(direct):
    dev = torch.device("cuda", torch.cuda.current_device())
    adapter = adapter_for(dev, direct=direct)
    assert isinstance(adapter, CudaAdapter) and adapter.direct is direct
    arena = adapter.staging_arena(8 << 20, 4096)
    assert arena.data_ptr() % 4096 == 0
    assert arena.device.type == ("cuda" if direct else "cpu")
    if not direct:
        assert arena.is_pinned()
    n = 1 << 20
    x = torch.randn(n, device=dev)
    src = x * 3  # produced by a kernel on the current stream just before the capture
    want = src.clone()
    dst = arena[: n * 4].view(torch.float32)
    ticket = adapter.capture(dst, src)
    del src  # the ticket keeps it alive until the copy is done
    ticket.wait()
    assert torch.equal(dst.to(dev), want)
    landing = adapter.host_buffer(n * 4, 4096)
    landing.copy_(arena[: n * 4])  # stands in for the read from disk
    torch.cuda.synchronize()
    out = adapter.to_device(landing, dev)
    assert out.device.type == "cuda"
    assert torch.equal(out.view(torch.float32) * 1, want)  # a kernel on the consumer stream
