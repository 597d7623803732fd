"""The Reader alone (no Offloader, no autograd): forwarding, prefetched and synchronous reads,
a failed read, a batch read joined by its members, the end of a use, retirement, and the stall
measured on a fake clock. See tests/_core.py."""

from __future__ import annotations

import errno
import gc
import logging
import threading
import time

import pytest
import torch

import tba
from tba.records.entry import DEAD, FAILED

from .._core import TICK, Core, FailingBackend, GatedBackend


@pytest.fixture
def core():
    made = []

    def make(backend=None, **cfg) -> Core:
        c = Core(backend, **cfg)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def packed(c: Core, n: int = 3, numel: int = 4096, prefetch: bool = True, settle: bool = True):
    """A step that packs ``n`` tensors whose originals are gone by backward; with ``settle``,
    their writes and prefetched reads have completed."""
    st = c.begin()
    xs = [torch.randn(numel) for _ in range(n)]
    want = [x.clone() for x in xs]
    hs = [c.pack(x, st) for x in xs]
    del xs
    gc.collect()
    c.end(st, prefetch=prefetch)
    if settle:
        c.settle()
    return st, hs, want


def test_a_live_original_is_forwarded_without_a_read(core):
    c = core()
    st = c.begin()
    x = torch.randn(4096)
    h = c.pack(x, st)
    c.end(st)  # the plan is armed: it must pass over x, whose original is alive (NOTE [Forwarding])
    c.settle()
    assert c.backend.usage()["reads"] == 0 and c.index.resident == 0
    assert c.unpack(h) is x
    assert st.forwarded == 1 and st.bytes_reloaded == 0 and st.sync_loads == 0
    assert c.backend.usage()["reads"] == 0


def test_an_original_that_dies_after_the_forward_is_read_ahead_of_its_unpack(core):
    c = core()
    st = c.begin()
    xs = [torch.randn(4096) for _ in range(3)]
    want = [x.clone() for x in xs]
    hs = [c.pack(x, st) for x in xs]
    c.end(st)
    c.settle()
    assert c.backend.usage()["reads"] == 0  # all three alive: nothing read
    first = xs.pop()  # backward's first tensor stays alive; the other two die now
    del xs
    gc.collect()
    assert c.unpack(hs[2]) is first  # forwarded; this unpack's pump reads the two others
    c.settle()
    assert c.backend.usage()["reads"] == 2
    assert [torch.equal(c.unpack(h), w) for h, w in zip(hs[1::-1], want[1::-1])] == [True] * 2
    assert st.sync_loads == 0 and st.forwarded == 1 and st.bytes_reloaded == 2 * 4096 * 4
    assert c.backend.usage()["reads"] == 2  # the forwarded one was never read


def test_prefetched_reads_serve_unpack(core):
    c = core()
    st, hs, want = packed(c)
    assert c.backend.usage()["reads"] == 3  # issued when the forward ended
    got = [c.unpack(h) for h in reversed(hs)]
    assert all(map(torch.equal, got, reversed(want)))
    assert st.sync_loads == 0 and st.stall_seconds == 0 and st.bytes_reloaded == 3 * 4096 * 4


def test_an_entry_not_read_ahead_is_a_sync_load(core):
    c = core()
    st, hs, want = packed(c, prefetch=False)
    assert c.backend.usage()["reads"] == 0
    assert torch.equal(c.unpack(hs[0]), want[0])
    assert st.sync_loads == 1 and hs[0].entry.stat.sync_loads == 1


def test_the_stall_is_read_from_the_clock(core):
    c = core(lambda cfg: GatedBackend(cfg, ("read",)))
    st, hs, want = packed(c, n=1, settle=False)  # its read is held at the gate
    me = threading.get_ident()
    n = len(c.clock.of(me))

    def open_once_unpack_waits():  # the gate opens after unpack's reading before its wait
        while len(c.clock.of(me)) < n + 2:
            time.sleep(0.001)
        c.backend.open()

    threading.Thread(target=open_once_unpack_waits, daemon=True).start()
    assert torch.equal(c.unpack(hs[0]), want[0])
    # unpack read the clock on entry, then just before and just after its wait (other
    # threads' readings in between, e.g. the read's completion, advance the fake clock too)
    _, before, after, *_ = c.clock.of(me)[n:]
    assert st.stall_seconds == pytest.approx(after - before) and after - before >= TICK
    assert hs[0].entry.stat.stall_seconds == st.stall_seconds


def test_a_read_that_does_not_end_is_logged_while_unpack_waits(core, caplog, monkeypatch):
    c = core(lambda cfg: GatedBackend(cfg, ("read",)))
    monkeypatch.setattr(c.io, "slow_io_s", 0.05)
    st, hs, want = packed(c, n=1, settle=False)  # its read is held at the gate

    class OpenAtTheSecond(logging.Handler):  # the gate opens once the wait was logged twice
        def emit(self, record):
            if "still waiting" in record.getMessage():
                self.seen = getattr(self, "seen", 0) + 1
                if self.seen == 2:
                    c.backend.open()

    opener = OpenAtTheSecond()
    logging.getLogger("tba").addHandler(opener)
    try:
        with caplog.at_level(logging.WARNING, logger="tba"):
            got = c.unpack(hs[0])
    finally:
        logging.getLogger("tba").removeHandler(opener)
    assert torch.equal(got, want[0])  # it kept waiting, and the bytes are the right ones
    said = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    # logged after 0.05 and 0.1 s (each wait doubles the last); the gate opened at the second
    assert len(said) >= 2, said
    assert "s to read back a saved tensor of 16.0 KiB (backend memory; " in said[0], said
    assert "caps held writes 0 s and reads 0 s" in said[0] and "py-spy dump --pid" in said[0]


def test_a_drain_that_waits_long_is_logged_too(core, caplog, monkeypatch):
    c = core(lambda cfg: GatedBackend(cfg, ("write",)))
    monkeypatch.setattr(c.io, "slow_io_s", 0.05)
    st, hs, want = packed(c, n=2, settle=False)  # both writes held at the gate
    threading.Timer(0.3, c.backend.open).start()
    with caplog.at_level(logging.WARNING, logger="tba"):
        c.settle()  # what synchronize() and close() wait with
    said = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert said and "s for 2 writes and reads in flight (backend memory; " in said[0], said
    assert all(map(torch.equal, [c.unpack(h) for h in reversed(hs)], reversed(want)))


def test_a_failed_read_raises_on_every_unpack(core):
    c = core(lambda cfg: FailingBackend(cfg, "read", errno.EIO))
    st, hs, _ = packed(c, n=1)
    e = hs[0].entry
    assert e.state is FAILED and st.io_errors == 1
    for _ in range(2):
        with pytest.raises(tba.StorageError, match="EIO"):
            c.unpack(hs[0])
    assert [op for op, _ in c.sink.errors] == ["read"] and c.index.resident == 0


def test_one_batch_read_serves_every_member(core):
    c = core(coalesce_bytes="64KiB")
    st, hs, want = packed(c, n=4, numel=1024)
    assert len({h.entry.batch for h in hs}) == 1
    got = [c.unpack(h) for h in reversed(hs)]
    assert all(map(torch.equal, got, reversed(want)))
    assert c.backend.usage()["reads"] == 1 and st.sync_loads == 0


def test_the_last_use_lets_the_bytes_go_and_a_retained_graph_reads_again(core):
    c = core()
    st, hs, want = packed(c, n=1)
    (h,) = hs
    base = c.index.resident
    assert base >= h.entry.padded  # the prefetched read is held
    assert torch.equal(c.unpack(h), want[0])
    assert h.entry.host is None and c.index.resident == base - h.entry.padded
    assert torch.equal(c.unpack(h), want[0])  # a second backward of the same graph
    assert st.sync_loads == 1 and c.backend.usage()["reads"] == 2


def test_a_dead_entry_frees_its_extent(core):
    c = core()
    st, hs, _ = packed(c, n=2)
    entries = [h.entry for h in hs]
    assert c.io.disk_in_use > 0 and len(c.io.live) == 2
    del hs
    gc.collect()
    with c.io.lock:
        c.index.bury()
    assert all(e.state is DEAD for e in entries)
    assert c.io.disk_in_use == 0 == c.backend.usage()["disk_bytes_in_use"]
    assert not c.io.live and c.index.resident == 0 and c.prefetcher.inflight == 0
