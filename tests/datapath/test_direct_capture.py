"""NOTE [Direct capture]: large CPU tensors are written from their own memory, not copied.

Each test drives a real posix (O_DIRECT) backend on the test's spill dir, and blocks or fails
its ``_pwrite`` where the order of events matters.
"""

from __future__ import annotations

import errno
import os
import weakref

import pytest
import torch

from tba.datapath.capture.staging import DirectBlock
from tba.errors import UnpackError
from tba.records.entry import MEMORY

from .test_offloader import gate

MiB = 1 << 20


def make(make_offloader, **kw):
    kw.setdefault("backend", "posix")
    kw.setdefault("coalesce_bytes", 0)  # every tensor takes the stand-alone path
    kw.setdefault("min_offload_bytes", "64KiB")
    return make_offloader(**kw)


def pool_of(off):
    (_, pool), *_ = off.io.adapters.values()
    return pool


def direct_entries(off):
    return [e for e in off.io.live if isinstance(e.staging, DirectBlock)]


def gated(make_offloader, **kw):
    """An offloader whose writes block until the event is set, and two 1 MiB tensors."""
    off = make(make_offloader, **kw)
    off.backend._pwrite, ev = gate(os.pwrite)
    return off, ev, torch.randn(MiB // 4, requires_grad=True), torch.randn(MiB // 4)


def test_no_staging_copy_and_sources_released_after_the_write(make_offloader):
    off, ev, w, x = gated(make_offloader)
    with off.step():
        y = x.exp()
        alive = weakref.ref(y)
        loss = (y * w).sum()  # saves exp(x), 1 MiB
        assert len(direct_entries(off)) == 1
        del y
        assert alive() is not None  # held for the write
        ev.set()
        off.synchronize()  # the write is done: the entry lets its source go
    assert alive() is None
    assert pool_of(off).held == 0
    assert pool_of(off).peak == 0  # the staging pool was never written to
    loss.backward()
    assert torch.equal(w.grad, x.exp())
    st = off.stats()
    assert st["bytes_reloaded"] == st["bytes_offloaded"] > 0


@pytest.mark.parametrize("start", [1, 7, 1000, 1024])
def test_unaligned_sources_read_back_exact(make_offloader, start):
    """A view starting ``start`` floats into its storage: the write covers whole pages around
    it and the read-back tensor starts ``skew`` bytes into its buffer."""
    off = make(make_offloader)
    off.backend._pwrite, ev = gate(os.pwrite)
    base = torch.randn(MiB // 4 + 2048)
    x = base[start : start + MiB // 4]  # dense, not the whole storage
    want = x.clone()
    w = torch.randn(MiB // 4, requires_grad=True)
    with off.step():
        loss = (x * w).sum()  # saves x itself
        (e,) = direct_entries(off)
        assert e.skew == x.data_ptr() % off.io.align
        assert e.padded % off.io.align == 0 and e.padded >= e.skew + x.numel() * 4
        ev.set()
        off.synchronize()
    del x
    base.data.zero_()  # bytes change behind the version counter: the gradient must come from disk
    loss.backward()
    assert torch.equal(w.grad, want)
    assert off.stats()["bytes_reloaded"] > 0


def test_whole_storage_views_share_one_direct_write(make_offloader):
    """q, k and v style: three strided views of one projection, one capture and one write."""
    off = make(make_offloader)
    off.backend._pwrite, ev = gate(os.pwrite)
    qkv = torch.randn(64, 3 * 1024)
    w = torch.randn(1024, requires_grad=True)
    q, k, v = qkv.split(1024, dim=1)

    def run(q, k, v):
        return (q * w).sum() + (k * w).sum() * 2 + (v * w).sum() * 3

    run(q, k, v).backward()
    want, w.grad = w.grad, None
    with off.step():
        loss = run(q, k, v)
        assert len(direct_entries(off)) == 1
        ev.set()
        off.synchronize()
    del q, k, v
    qkv.data.zero_()  # behind the version counter (an in-place op would raise, as in stock)
    loss.backward()
    assert torch.equal(w.grad, want)


def test_in_place_update_while_the_write_runs_fails_the_entry(make_offloader):
    """Rule 2: the source changes before its bytes reach the disk. Without the check at write
    completion the read-back would hold the new values and the gradient would be silently
    wrong; stock PyTorch raises here, and so does tba."""
    off, ev, w, x = gated(make_offloader)
    with off.step():
        loss = (x * w).sum()
    x.add_(1)  # the write has not read the memory yet
    ev.set()
    off.synchronize()
    (e,) = [e for e in off.io.live if e.error is not None]
    assert e.staging is None  # failed and released: the source is no longer held
    del x  # the original is gone, so unpack must rely on the entry's own state
    with pytest.raises(UnpackError, match="modified by an inplace operation"):
        loss.backward()
    assert pool_of(off).held == 0


def test_storage_resized_while_the_write_runs_reads_it_as_stock_pytorch(make_offloader):
    """Rule 2, FSDP's pattern: the storage is freed and allocated again, then refilled (no
    version bump) before the write read it. What was written is not the tensor; stock PyTorch's
    backward reads the storage as it is by then, and so does tba."""
    off, ev, w, x = gated(make_offloader)
    want = x.clone()
    with off.step():
        loss = (x * w).sum()
    nbytes = x.untyped_storage().nbytes()
    old, blockers = x.data_ptr(), []
    x.untyped_storage().resize_(0)  # frees the memory the blocked write points at
    x.untyped_storage().resize_(nbytes)
    while x.data_ptr() == old:  # the allocator handed the same block back: make it move
        blockers.append(torch.empty(nbytes, dtype=torch.uint8))
        x.untyped_storage().resize_(0)
        x.untyped_storage().resize_(nbytes)
    x.data.copy_(want)  # refilled without a version bump, at a new address
    ev.set()
    off.synchronize()
    (e,) = list(off.io.live)
    assert e.state == MEMORY and e.extent is None  # nothing it wrote is used
    del x
    loss.backward()
    assert torch.equal(w.grad, want)
    assert pool_of(off).held == 0 and off.stats()["disk_bytes_in_use"] == 0


def test_unpack_while_the_write_runs_returns_the_source(make_offloader):
    off, ev, w, x = gated(make_offloader)
    with off.step():
        loss = (x.exp() * w).sum()  # exp(x) is held only by its entry now
    loss.backward()  # the write is still blocked
    assert torch.equal(w.grad, x.exp())
    st = off.stats()
    assert st["forwarded"] == 1 and st["bytes_reloaded"] == 0
    ev.set()
    off.synchronize()
    assert pool_of(off).held == 0 and off.stats()["disk_bytes_in_use"] == 0


def test_failed_write_keeps_the_source_in_memory_exact(make_offloader):
    off = make(make_offloader)

    def fail(*args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    off.backend._pwrite = fail
    w = torch.randn(MiB // 4, requires_grad=True)
    x = torch.randn(MiB // 4)
    with off.step():
        loss = (x.exp() * w).sum()
        off.synchronize()
    assert pool_of(off).held == 0 and off.stats()["io_errors"] >= 1
    loss.backward()
    assert torch.equal(w.grad, x.exp())


def test_held_sources_count_against_the_staging_budget(make_offloader):
    """Rule 4: with writes blocked, sources past TBA_STAGING_BYTES stay resident as
    staging_full instead of being held for a write."""
    w = torch.randn(MiB // 4, requires_grad=True)
    xs = [torch.randn(MiB // 4) for _ in range(5)]
    sum((x.exp() * w).sum() for x in xs).backward()
    want, w.grad = w.grad, None
    off = make(make_offloader, staging_bytes="3MiB")
    off.backend._pwrite, ev = gate(os.pwrite)
    with off.step():
        loss = sum((x.exp() * w).sum() for x in xs)
        held = pool_of(off).held
    st = off.stats()
    assert 0 < held <= 3 * MiB
    assert st["kept_reasons"].get("staging_full", 0) >= 2
    ev.set()
    off.synchronize()
    loss.backward()
    assert torch.equal(w.grad, want)


@pytest.mark.parametrize("checksum", ["crc32", "auto"])
def test_checksums_cover_the_tensor_not_the_pages_around_it(make_offloader, checksum):
    """Rule 3: a checksummed tensor is still written from its own memory; the bytes around it
    in the same pages (another tensor's) change after the write, and the read still verifies,
    because the digest covers only the tensor's own bytes."""
    off, ev, w, _ = gated(make_offloader, checksum=checksum)
    base = torch.randn(MiB // 4 + 2048)
    x = base[1000 : 1000 + MiB // 4]  # starts inside a page: the write covers its neighbours
    want = x.clone()
    with off.step():
        loss = (x * w).sum()
        (e,) = direct_entries(off)
        assert e.span == (e.skew, e.skew + MiB) and e.skew > 0
        ev.set()
        off.synchronize()
    assert pool_of(off).peak == 0  # no staging copy
    base.data[:1000] = 7.0  # the neighbours' bytes, behind the version counter
    base.data[1000 + MiB // 4 :] = 7.0
    del x
    loss.backward()
    assert torch.equal(w.grad, want) and off.stats()["bytes_reloaded"] > 0


def test_read_ahead_served_when_the_write_lands_is_charged_once(make_offloader):
    """The read-ahead asked for a tensor whose write still ran; when the write lands, its own
    bytes become the read buffer: peak_resident_bytes counts them once, not as staging and a
    read buffer at the same time (on a language model, the logits doubled the peak)."""
    off, ev, w, x = gated(make_offloader, prefetch_bytes="8MiB")
    with off.step():
        loss = (x.exp() * w).sum()
    (e,) = direct_entries(off)
    assert e.want  # the plan reached it while its write was blocked
    ev.set()
    off.synchronize()  # the write lands: served from its own bytes, no read
    assert e.host is not None and pool_of(off).held == 0
    loss.backward()
    assert torch.equal(w.grad, x.exp())
    st = off.stats()
    assert st["bytes_reloaded"] == 0 and st["bytes_offloaded"] == MiB
    assert MiB <= st["peak_resident_bytes"] <= MiB + 8192  # one tensor, its pages rounded up
