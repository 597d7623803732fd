"""A fake ``torch.cuda`` whose copies run late (tests/datapath/test_device.py explains it).

Every copy is queued on its stream and runs only when something synchronizes: an event's
``synchronize`` runs its stream up to the event, and a stream's ``synchronize`` first runs
whatever it waits on (``query`` only looks). So a missing event, wait or reference makes the
bytes stale.

The device has a clock of its own (``now_ms``), which only running work moves: each copy takes
``copy_ms``, and the kernels the host queued before a mark on the consumer (default) stream
take ``kernel_ms`` when the stream reaches it. An event records the device clock when its
stream reaches it, and ``elapsed_time`` raises, as CUDA does, unless both events are timing
events that completed. ``syncs`` counts the host's waits on timing events and on streams;
``catch_up`` runs everything queued, as a device does on its own, without counting.
"""

from __future__ import annotations

import contextlib
import threading


class FakeStream:
    def __init__(self, cuda, name, eager=False):
        self.cuda = cuda
        self.name = name
        self.eager = eager  # runs each op when enqueued, as the CPU runs the test's kernels
        self.ops: list = []  # callables, run in order
        self.done = 0
        self.waits: list = []  # (event) this stream must see complete before its next ops

    def run_to(self, n):
        with self.cuda.lock:
            while self.done < n:
                op = self.ops[self.done]
                self.ops[self.done] = None  # finished work holds no tensors, as on a GPU
                self.done += 1
                op()

    def enqueue(self, fn):
        self.ops.append(fn)
        self.cuda.log.append(("op", self.name))
        if self.eager:
            self.synchronize()

    def wait_event(self, ev):
        # the work the event had recorded now (a later record does not change this wait); a
        # device-side wait, not the host's
        self.cuda.log.append(("wait_event", self.name, ev.id))
        stream, pos = ev.stream, ev.pos
        self.enqueue(lambda: stream is not None and stream.run_to(pos))

    def wait_stream(self, other):
        self.cuda.log.append(("wait_stream", self.name, other.name))
        n = len(other.ops)
        self.enqueue(lambda: other.run_to(n))

    def synchronize(self):
        self.cuda.syncs.append(("stream", self.name))
        self.run_to(len(self.ops))


class FakeEvent:
    count = 0

    def __init__(self, cuda, blocking=False, enable_timing=False):
        FakeEvent.count += 1
        self.id = FakeEvent.count
        self.cuda = cuda
        self.blocking = blocking
        self.timing = enable_timing
        self.stream = None
        self.pos = 0
        self.synced = False
        self.time_ms = None  # the device clock when the stream reached this event
        self.records = 0

    def record(self, stream):
        # a stamp, queued like any work but not logged as an op: the device clock when the
        # stream reaches it (after the kernels queued before it, on the consumer stream)
        self.records += 1
        recorded = self.records
        self.time_ms = None

        def stamp():
            cuda = self.cuda
            if stream is cuda.default:
                cuda.now_ms += cuda.kernel_ms
            if self.records == recorded:  # a later record moved the event: that one counts
                self.time_ms = cuda.now_ms

        stream.ops.append(stamp)
        self.stream, self.pos = stream, len(stream.ops)
        self.cuda.log.append(("record", stream.name, self.id))
        if stream.eager:
            stream.run_to(self.pos)

    def query(self):
        return self.stream is not None and self.stream.done >= self.pos

    def synchronize(self):
        self.synced = True
        if self.timing:
            self.cuda.syncs.append(("event", self.id))
        if self.stream is not None:
            self.stream.run_to(self.pos)

    def elapsed_time(self, end):
        if not (self.timing and end.timing):
            raise RuntimeError("fake cuda: elapsed_time needs two events with enable_timing=True")
        if not (self.query() and end.query()) or self.time_ms is None or end.time_ms is None:
            raise RuntimeError("fake cuda: elapsed_time on an event that has not completed")
        self.cuda.elapsed_reads += 1
        return end.time_ms - self.time_ms


class FakeCuda:
    """The few ``torch.cuda`` names the adapter uses."""

    def __init__(self, eager_default=False, kernel_ms=0.0, copy_ms=0.0):
        self.lock = threading.RLock()
        self.log: list = []
        self.now_ms = 0.0  # the device's clock
        self.kernel_ms = kernel_ms  # what the kernels queued before each consumer mark take
        self.copy_ms = copy_ms  # what each copy takes
        self.syncs: list = []  # host waits: ("event", id) of timing events, ("stream", name)
        self.elapsed_reads = 0
        # eager_default: the consumer (default) stream is the CPU running autograd's kernels,
        # which use a tensor as soon as unpack returns it: a wait_event on it blocks until the
        # event's work ran; without that wait, a late copy leaves the bytes stale.
        self.default = FakeStream(self, "default", eager=eager_default)
        self.active = self.default
        self.created: list[FakeStream] = []
        self.events: list[FakeEvent] = []
        self.recorded_streams: list = []  # (tensor, stream) given to record_stream

    def Stream(self, device=None):  # noqa: N802 - mirrors torch.cuda.Stream
        s = FakeStream(self, f"side{len(self.created)}")
        self.created.append(s)
        return s

    def Event(self, blocking=False, enable_timing=False):  # noqa: N802
        event = FakeEvent(self, blocking, enable_timing)
        self.events.append(event)
        return event

    def catch_up(self):
        """Run everything queued, as the device does by itself; not a host wait."""
        for s in (self.default, *self.created):
            s.run_to(len(s.ops))

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
        # Reads the source when the stream runs, not now: a late read sees later changes. Until
        # then the destination holds garbage, as fresh device memory does: poisoned now, so that
        # a use before the copy ran never finds the right bytes by chance (an allocator that
        # hands back the chunk an earlier, identical tensor was freed from would leave them).
        dst.fill_(float("nan") if dst.is_floating_point() else 0x5A)

        def run():
            self.now_ms += self.copy_ms
            dst.copy_(src)

        self.active.enqueue(run)

    def record_stream(self, tensor, stream):
        self.log.append(("record_stream", stream.name))
        self.recorded_streams.append((tensor, stream))
