"""A fake ``torch.cuda`` whose copies run late (tests/datapath/test_device.py explains it).

Every copy is queued on its stream and runs only when something synchronizes: an event's
``synchronize``/``query`` runs its stream up to the event, and a stream's ``synchronize``
first runs whatever it waits on. So a missing event, wait or reference makes the bytes stale.
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

    def __init__(self, cuda, blocking=False):
        FakeEvent.count += 1
        self.id = FakeEvent.count
        self.cuda = cuda
        self.blocking = blocking
        self.stream = None
        self.pos = 0
        self.synced = False

    def record(self, stream):
        self.stream, self.pos = stream, len(stream.ops)
        self.cuda.log.append(("record", stream.name, self.id))

    def query(self):
        return self.stream is not None and self.stream.done >= self.pos

    def synchronize(self):
        self.synced = True
        if self.stream is not None:
            self.stream.run_to(self.pos)


class FakeCuda:
    """The few ``torch.cuda`` names the adapter uses."""

    def __init__(self, eager_default=False):
        self.lock = threading.RLock()
        self.log: list = []
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

    def Event(self, blocking=False):  # noqa: N802
        event = FakeEvent(self, blocking)
        self.events.append(event)
        return event

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

    def record_stream(self, tensor, stream):
        self.log.append(("record_stream", stream.name))
        self.recorded_streams.append((tensor, stream))
