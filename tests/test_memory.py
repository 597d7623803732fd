"""Host memory helpers: aligned buffers and the read-buffer pool (NOTE [Read buffer reuse])."""

from __future__ import annotations

import gc

import torch

from tba._memory import PAGE, MappedPool, as_memoryview, size_class
from tba.device import CpuAdapter

MIB = 1 << 20


def test_size_class_rounds_up_by_at_most_an_eighth():
    for n in (1, 4095, 4096, MIB, MIB + 1, 3 * MIB + 7, 8 * MIB, 100 * MIB + 12345):
        c = size_class(n)
        assert c >= n and c % PAGE == 0
        assert c - n <= max(PAGE, n // 8)
    assert size_class(8 * MIB) == 8 * MIB


def test_a_buffer_is_reused_only_after_its_last_view_dies():
    pool = MappedPool(64 * MIB)
    a = pool.get(8 * MIB)
    addr = a.data_ptr()
    assert addr % PAGE == 0 and a.numel() == 8 * MIB
    view = a[100:200].view(torch.int32)
    del a
    b = pool.get(8 * MIB)
    assert b.data_ptr() != addr and pool.reused == 0  # the view still holds the first one
    del view
    gc.collect()
    c = pool.get(8 * MIB)
    assert c.data_ptr() == addr and pool.reused == 1
    del b, c


def test_a_memoryview_and_numpy_array_keep_the_buffer_busy():
    pool = MappedPool(64 * MIB)
    a = pool.get(2 * MIB)
    addr = a.data_ptr()
    mv = as_memoryview(a)  # what a backend holds while its I/O is in flight
    del a
    assert pool.get(2 * MIB).data_ptr() != addr
    del mv
    assert pool.get(2 * MIB).data_ptr() == addr


def test_reused_bytes_are_the_new_readers_not_the_old():
    pool = MappedPool(64 * MIB)
    a = pool.get(MIB)
    a.fill_(7)
    del a
    b = pool.get(MIB)
    b.fill_(9)
    assert int(b.min()) == 9 and pool.reused == 1


def test_pool_holds_at_most_its_limit_and_trim_unmaps_free_ones():
    pool = MappedPool(16 * MIB)
    bufs = [pool.get(8 * MIB) for _ in range(3)]  # the third is a one-off mapping
    assert pool.pooled_bytes == 16 * MIB
    assert pool.trim() == 0  # all busy
    del bufs[0]
    assert pool.trim() == 8 * MIB and pool.pooled_bytes == 8 * MIB
    del bufs
    assert pool.trim() == 8 * MIB and pool.pooled_bytes == 0


def test_cpu_adapter_pools_large_buffers_only():
    a = CpuAdapter(pool_bytes=32 * MIB)
    small = a.host_buffer(64 << 10, 4096)
    assert small.data_ptr() % 4096 == 0 and a.pool.pooled_bytes == 0
    big = a.host_buffer(4 * MIB, 4096)
    assert big.data_ptr() % 4096 == 0 and a.pool.pooled_bytes == 4 * MIB
    del big
    a.trim()
    assert a.pool.pooled_bytes == 0


def test_offloader_reuses_read_buffers_and_stays_exact(make_offloader):
    """Backward reads land in recycled mappings; gradients equal the no-offload ones."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])
    x = torch.randn(1024, 512)  # each saved activation is 2 MiB: pooled reads

    def grads(off):
        model.zero_grad(set_to_none=True)
        if off is None:
            model(x).square().mean().backward()
        else:
            with off.step():
                loss = model(x).square().mean()
            loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    want = grads(None)
    off = make_offloader(prefetch_bytes="4MiB", group_bytes="2MiB")
    for _ in range(3):
        got = grads(off)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert off.stats()["bytes_reloaded"] > 0
    adapter = off.io.adapters[torch.device("cpu")][0]
    assert adapter.pool.reused > 0
    assert adapter.pool.pooled_bytes <= adapter.pool.limit == 8 * MIB
