"""The Packer alone (no Offloader, no autograd): dedup, each keep reason, capture and write,
a failed write, coalescing, and the write's timing on a fake clock. See tests/_core.py."""

from __future__ import annotations

import errno
import gc

import pytest
import torch

import tba
from tba.records.entry import FAILED, MEMORY, ON_DISK
from tba.records.handle import Handle, KeptHandle, Passed

from .._core import TICK, Core, FailingBackend, GatedBackend, RefusingBackend

KiB = 1 << 10


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


def test_a_second_save_of_the_same_view_is_a_dedup_hit(core):
    c = core()
    st = c.begin()
    x = torch.randn(4096)
    h1, h2 = c.pack(x, st), c.pack(x, st)
    assert isinstance(h1, Handle) and h2 is h1
    assert st.dedup_hits == 1 and st.tensors_offloaded == 1 and st.packs == 2
    assert h1.packs == 2 and h1.entry.uses == 2
    assert st.saved_bytes == x.numel() * 4


def test_equal_shapes_and_strides_are_shared_and_the_tables_bounded(core, monkeypatch):
    """NOTE [Shared geometry]: handles of equal geometry hold one Size and one stride tuple,
    and their tensors come back exact; the tables start over once full."""
    c = core()
    st = c.begin()
    xs = [torch.randn(16, 64) for _ in range(3)] + [torch.randn(64, 16).t()]
    hs = [c.pack(x, st) for x in xs]
    assert all(isinstance(h, Handle) for h in hs)
    assert all(h.size is hs[0].size and h.stride is hs[0].stride for h in hs[1:3])
    assert hs[3].size is hs[0].size and hs[3].stride == (1, 16)
    c.end(st)
    c.settle()
    want = [x.clone() for x in xs]
    del xs
    assert all(torch.equal(c.unpack(h), w) for h, w in zip(hs, want))
    monkeypatch.setattr("tba.datapath.pack._SHARED_MAX", 2)
    st = c.begin()
    ys = [torch.randn(n, 3) for n in range(5, 10)]
    got = [c.pack(y, st) for y in ys]
    assert len(c.packer._shapes) <= 2 and len(c.packer._strides) <= 2
    assert [h.size for h in got] == [y.shape for y in ys]


def test_views_of_one_storage_share_one_capture(core):
    c = core()
    st = c.begin()
    qkv = torch.randn(8, 3 * 64)
    q, k, v = qkv.split(64, dim=-1)  # non-dense views spanning the whole storage
    hs = [c.pack(t, st) for t in (q, k, v)]
    assert len({id(h) for h in hs}) == 3 and len({id(h.entry) for h in hs}) == 1
    c.end(st)
    c.settle()
    assert c.backend.usage()["writes"] == 1 and st.bytes_offloaded == qkv.numel() * 4
    want = [t.clone() for t in (q, k, v)]
    del qkv, q, k, v
    assert all(torch.equal(c.unpack(h), w) for h, w in zip(hs, want))


def test_unsupported_tensors_and_parameters_are_passed_through(core):
    """As themselves, with their version at pack (NOTE [Passed through])."""
    c = core()
    st = c.begin()
    sparse = torch.randn(8, 8).to_sparse()
    param = torch.nn.Parameter(torch.randn(1024))
    got = [c.pack(sparse, st), c.pack(param, st), c.pack(param.t(), st)]
    assert all(type(p) is Passed for p in got)
    assert got[0].tensor is sparse and got[1].tensor is param
    assert got[2].tensor._base is param  # a view of a parameter: itself
    assert got[0].unpack() is sparse and got[1].unpack() is param
    assert dict(st.kept_reasons) == {"unsupported": 1} and st.saved_bytes == 0


def test_small_tensors_are_kept(core):
    c = core(min_offload_bytes="64KiB")
    st = c.begin()
    x = torch.randn(1024)  # 4 KiB
    h = c.pack(x, st)
    assert isinstance(h, KeptHandle) and h.tensor is x
    assert dict(st.kept_reasons) == {"small": 1} and st.tensors_kept == 1
    assert c.index.resident == x.numel() * 4


def test_the_last_window_is_kept_from_the_second_step(core):
    c = core(group_bytes="1MiB")
    c.groups.keep_last = 1

    def forward():
        st = c.begin()
        hs = [c.pack(torch.randn(128 * KiB), st) for _ in range(4)]  # 512 KiB: 2 windows
        c.end(st)
        return st, hs

    st1, _ = forward()
    assert "group" not in st1.kept_reasons  # nothing is known about the windows yet
    st2, hs = forward()
    assert [type(h) for h in hs] == [Handle, Handle, KeptHandle, KeptHandle]
    assert st2.kept_reasons["group"] == 2


def test_a_full_staging_budget_keeps(core):
    c = core(staging_bytes="1MiB")
    st = c.begin()
    big = torch.randn(512 * KiB)  # 2 MiB: more than the whole budget
    assert isinstance(c.pack(big, st), KeptHandle)
    assert dict(st.kept_reasons) == {"staging_full": 1}


@pytest.mark.parametrize("refusal", ["disk_full", "node_quota"])
def test_a_refused_extent_keeps_for_the_rest_of_the_step(core, refusal):
    c = core(lambda cfg: RefusingBackend(cfg, refusal))
    st = c.begin()
    hs = [c.pack(torch.randn(4096), st) for _ in range(3)]
    assert all(isinstance(h, KeptHandle) for h in hs)
    assert dict(st.kept_reasons) == {refusal: 3} and c.io.staging_in_use() == 0


def test_a_failed_write_keeps_the_bytes_in_memory(core):
    c = core(lambda cfg: FailingBackend(cfg, "write", errno.ENOSPC))
    st = c.begin()
    x = torch.randn(4096)
    want = x.clone()
    h = c.pack(x, st)
    assert h.entry.state is MEMORY and h.entry.host is not None
    assert st.io_errors == 1 and [op for op, _ in c.sink.errors] == ["write"]
    assert isinstance(c.pack(torch.randn(4096), st), KeptHandle)  # the disk is full: keep
    assert st.kept_reasons == {"disk_full": 2} and st.tensors_offloaded == 0  # counted once
    del x
    gc.collect()
    assert torch.equal(c.unpack(h), want)


def test_a_source_modified_while_it_is_written_fails_the_entry(core):
    c = core(GatedBackend)
    st = c.begin()
    x = torch.randn(4096)
    h = c.pack(x, st)  # written from x's own memory (direct capture)
    x.add_(1)
    c.backend.open()
    assert h.entry.state is FAILED
    with pytest.raises(tba.UnpackError, match="modified by an inplace operation"):
        c.unpack(h)


def test_small_tensors_share_one_write(core):
    c = core(coalesce_bytes="64KiB")
    st = c.begin()
    xs = [torch.randn(1024) for _ in range(5)]
    hs = [c.pack(x, st) for x in xs]
    assert c.backend.usage()["writes"] == 0  # the batch is still open
    c.end(st)
    c.settle()
    assert c.backend.usage()["writes"] == 1 and st.coalesced_writes == 1
    assert st.coalesced_tensors == 5 and all(h.entry.state is ON_DISK for h in hs)
    assert len({h.entry.batch for h in hs}) == 1


def test_the_write_time_is_read_from_the_clock(core):
    c = core(GatedBackend)
    st = c.begin()
    h = c.pack(torch.randn(4096), st)
    c.backend.open()  # issued at one reading, completed at the next
    ((t0, t1, n),) = st.io_spans[0]
    assert t1 - t0 == pytest.approx(TICK) and n == h.entry.padded
    assert c.sink.io_log == [(True, pytest.approx(TICK), h.entry.padded)]
    assert st.bandwidth(True) == pytest.approx(h.entry.padded / TICK)


def test_a_staging_arena_that_cannot_be_allocated_names_the_setting(core, monkeypatch):
    import tba.datapath.io

    class NoMemory(tba.datapath.io.CpuAdapter):
        def staging_arena(self, nbytes, align):
            raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: {nbytes} bytes")

    monkeypatch.setattr(tba.datapath.io, "CpuAdapter", NoMemory)
    c = core()
    st = c.begin()
    with pytest.raises(tba.CapacityError, match=r"staging arena of 8\.0 MiB .*TBA_STAGING_BYTES"):
        c.pack(torch.randn(4096), st)


def test_memory_settings_beyond_the_machine_are_refused_at_start(spill_dir):
    with pytest.raises(tba.ConfigError, match=r"prefetch_bytes \(TBA_PREFETCH_BYTES\) = 64\.0 TiB"):
        tba.Offloader(tba.Config(environ={}, spill_dir=spill_dir, prefetch_bytes="64TiB"))
