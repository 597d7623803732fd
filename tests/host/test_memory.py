"""Host memory helpers: aligned buffers, the read-buffer pool (NOTE [Read buffer reuse]) and
read buffers from the heap under a caching malloc (NOTE [Read buffers from the heap])."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tba.datapath.capture.device
import tba.host.memory as memory_mod
from tba.datapath.capture.device import CpuAdapter
from tba.doctor import find_tcmalloc
from tba.host.memory import PAGE, MappedPool, aligned_empty, as_memoryview, size_class

MIB = 1 << 20


class PinnedBlocks:
    """torch's pinned allocator as it hands blocks out: a whole block of the next power of two,
    page-aligned (``skew`` bytes off, to stand for an allocator that does not align)."""

    def __init__(self, skew=0):
        self.asked: list[int] = []
        self.skew = skew
        self.real = torch.empty

    def __call__(self, n, dtype=None, pin_memory=False):
        if not pin_memory:
            return self.real(n, dtype=dtype)
        self.asked.append(n)
        block = 1 << (n - 1).bit_length()
        raw = self.real(block + 2 * PAGE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % PAGE + self.skew
        return raw[start : start + n]


@pytest.mark.parametrize("skew", [0, 64])
def test_a_pinned_buffer_asks_for_its_own_size_first(monkeypatch, skew):
    """A pinned buffer of a power-of-two size takes one block of that size, not of the next
    power (torch rounds ``nbytes + align`` up to twice ``nbytes``); only a misaligned block
    is traded for an over-allocation."""
    fake = PinnedBlocks(skew)
    monkeypatch.setattr(memory_mod.torch, "empty", fake)
    buf = aligned_empty(64 * MIB, PAGE, pin=True)
    assert buf.numel() == 64 * MIB and buf.data_ptr() % PAGE == 0
    assert fake.asked == ([64 * MIB] if skew == 0 else [64 * MIB, 64 * MIB + PAGE])


@pytest.mark.gpu
def test_on_a_gpu_a_pinned_power_of_two_takes_one_block_of_its_size():
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        pytest.skip(f"torch {torch.__version__} has no torch.cuda.host_memory_stats")
    before = stats().get("allocated_bytes.current", 0)
    buf = aligned_empty(64 * MIB, PAGE, pin=True)
    assert buf.is_pinned() and buf.data_ptr() % PAGE == 0
    assert stats()["allocated_bytes.current"] - before == 64 * MIB


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
    a = CpuAdapter(pool_bytes=32 * MIB, heap=False)
    small = a.host_buffer(64 << 10, 4096)
    assert small.data_ptr() % 4096 == 0 and a.pool.pooled_bytes == 0
    big = a.host_buffer(4 * MIB, 4096)
    assert big.data_ptr() % 4096 == 0 and a.pool.pooled_bytes == 4 * MIB
    del big
    a.trim()
    assert a.pool.pooled_bytes == 0


def _six_linears():
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

    return grads


def _offload_three_steps(make_offloader):
    """Three offloaded steps of six linears, each checked bit-identical to no offload; returns
    the Offloader and its CPU adapter."""
    grads = _six_linears()
    want = grads(None)
    off = make_offloader(prefetch_bytes="4MiB", group_bytes="2MiB")
    for _ in range(3):
        got = grads(off)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert off.stats()["bytes_reloaded"] > 0
    return off, off.io.adapters[torch.device("cpu")][0]


def test_offloader_reuses_read_buffers_and_stays_exact(make_offloader, monkeypatch):
    """Backward reads land in recycled mappings; gradients equal the no-offload ones."""
    monkeypatch.setattr(tba.datapath.capture.device, "malloc_name", lambda: "glibc")
    _, adapter = _offload_three_steps(make_offloader)
    assert not adapter.heap
    assert adapter.pool.reused > 0
    assert adapter.pool.pooled_bytes <= adapter.pool.limit == 8 * MIB


def test_cpu_adapter_reads_into_the_heap_under_a_caching_malloc():
    a = CpuAdapter(pool_bytes=32 * MIB, heap=True)
    for n in (64 << 10, 4 * MIB, 4 * MIB + 123):
        t = a.host_buffer(n, 4096)
        assert t.data_ptr() % 4096 == 0 and t.numel() == n
        assert t.untyped_storage().nbytes() == n + 4096  # torch's allocator, not a mapping
    assert a.pool.pooled_bytes == 0


@pytest.mark.parametrize("name", ["tcmalloc", "jemalloc", "mimalloc", "glibc"])
def test_the_offloader_reads_into_the_heap_only_under_a_caching_malloc(
    make_offloader, monkeypatch, name
):
    monkeypatch.setattr(tba.datapath.capture.device, "malloc_name", lambda: name)
    _, adapter = _offload_three_steps(make_offloader)
    heap = name != "glibc"
    assert adapter.heap is heap
    assert (adapter.pool.reused > 0) is not heap
    assert (adapter.pool.pooled_bytes == 0) is heap


_UNDER_TCMALLOC = textwrap.dedent(
    """
    import tempfile, torch, tba
    from tba.host.malloc import malloc_name
    from tba.testing import GPT, GPTConfig, random_batch
    print(malloc_name())
    cfg = GPTConfig(seq=256, hidden=256, heads=4, layers=3)  # MLP activations of 4 MiB
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = random_batch(cfg, 4)

    def grads(off):
        model.zero_grad(set_to_none=True)
        if off is None:
            model(*batch).backward()
        else:
            with off.step(model):
                loss = model(*batch)
            loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    want = grads(None)
    with tempfile.TemporaryDirectory() as d:
        off = tba.Offloader(tba.Config(environ={}, spill_dir=d, keep_last=0))
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(want, grads(off))), "gradients differ"
        adapter = off.io.adapters[torch.device("cpu")][0]
        print(adapter.heap, adapter.pool.pooled_bytes, off.stats()["bytes_reloaded"] > 0)
        off.close()
    """
)


def test_malloc_name_and_exact_reads_under_a_preloaded_tcmalloc():
    """The real thing: a process with libtcmalloc preloaded says so, reads back into its heap,
    and its gradients are bit-identical to no offload; without the preload it says glibc."""
    lib = find_tcmalloc()
    if lib is None:
        pytest.skip("libtcmalloc_minimal.so.4 is not installed (.ci/run installs it)")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    plain = subprocess.run(
        [sys.executable, "-c", "from tba.host.malloc import malloc_name; print(malloc_name())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert plain.stdout.split() == ["glibc"]
    got = subprocess.run(
        [sys.executable, "-c", _UNDER_TCMALLOC],
        env={**env, "LD_PRELOAD": lib},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.split()[-4:] == ["tcmalloc", "True", "0", "True"]
