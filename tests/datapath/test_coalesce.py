"""Small tensors coalesced into batches (NOTE [Coalescing]): one write per batch, split on read."""

from __future__ import annotations

import errno
import os

import pytest
import torch
import torch.nn as nn

import tba
from tba.datapath.capture.coalesce import MIN_BATCH_BYTES, batch_bytes

KIB = 1 << 10


def make(spill_dir, **kw) -> tba.Offloader:
    kw.setdefault("spill_dir", spill_dir)
    kw.setdefault("min_offload_bytes", 1)
    kw.setdefault("staging_bytes", "64MiB")
    kw.setdefault("prefetch_bytes", "64MiB")
    kw.setdefault("slab_bytes", "64MiB")
    kw.setdefault("min_free_bytes", 0)
    kw.setdefault("keep_last", 0)
    kw.setdefault("backend", "posix")
    return tba.Offloader(tba.Config(environ={}, **kw))


class Chain(nn.Module):
    """``n`` blocks, each saving ``per_block`` tensors of ``numel`` fp32 elements."""

    def __init__(self, n: int, per_block: int, numel: int):
        super().__init__()
        self.blocks = nn.ModuleList(Scales(per_block, numel) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.sum()


class Scales(nn.Module):
    def __init__(self, k: int, numel: int):
        super().__init__()
        self.w = nn.Parameter(torch.rand(k, numel) + 0.5)

    def forward(self, x):
        for row in self.w:
            x = torch.sin(x * row)  # saves x*row (for sin) and x (for the multiply)
        return x


def run(model, off=None, seed=0, settle=False):
    torch.manual_seed(seed)
    x = torch.randn(model.blocks[0].w.shape[1], requires_grad=True)
    model.zero_grad(set_to_none=True)
    if off is None:
        loss = model(x)
    else:
        with off.step(model):
            loss = model(x)
            if settle:  # every batch on disk before the prefetch starts (none from staging)
                off.synchronize()
    loss.backward()
    return [loss.detach(), x.grad.clone()] + [p.grad.clone() for p in model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_batch_size_rule():
    assert batch_bytes(1 << 20, 256 << 20, 4096) == MIN_BATCH_BYTES
    assert batch_bytes(4 << 20, 256 << 20, 4096) == 16 << 20
    assert batch_bytes(1 << 20, 4 << 20, 4096) == 1 << 20  # at most a quarter of staging
    assert batch_bytes(1 << 20, 8 << 20, 4096) % 4096 == 0


def test_small_tensors_are_written_in_few_requests_and_exact(spill_dir):
    torch.manual_seed(0)
    model = Chain(n=4, per_block=16, numel=16 * KIB)  # 64 KiB tensors, 32 saves per block
    want = run(model)
    with make(spill_dir) as off:
        got = run(model, off, settle=True)
        off.synchronize()
        st = off.stats()
        use = off.backend.usage()
    assert same(got, want)
    assert st["tensors_offloaded"] == st["coalesced_tensors"] > 100
    # One write per group (each block's 2 MiB of small tensors fits one 4 MiB batch), plus the
    # groups between blocks: far fewer requests than tensors.
    assert st["coalesced_writes"] == use["writes"] <= st["groups"]
    assert use["writes"] < st["tensors_offloaded"] // 8
    # Reads split batches back out: one read per batch, not one per tensor.
    assert use["reads"] == use["writes"]
    assert st["bytes_reloaded"] == st["bytes_offloaded"]
    assert st["sync_loads"] <= st["coalesced_writes"]


def test_full_batches_are_sealed_and_members_never_straddle(spill_dir):
    torch.manual_seed(0)
    model = Chain(n=1, per_block=40, numel=64 * KIB)  # 256 KiB tensors, 80 per group: 20 MiB
    want = run(model)
    with make(spill_dir) as off:
        got = run(model, off)
        off.synchronize()  # writes are counted once they land (NOTE [Counted once])
        st = off.stats()
    assert same(got, want)
    assert st["coalesced_tensors"] == st["tensors_offloaded"]
    assert 5 <= st["coalesced_writes"] <= 7  # 20 MiB in 4 MiB batches


def test_coalescing_off_writes_each_tensor(spill_dir):
    torch.manual_seed(0)
    model = Chain(n=2, per_block=4, numel=16 * KIB)
    want = run(model)
    with make(spill_dir, coalesce_bytes=0) as off:
        got = run(model, off)
        off.synchronize()
        st, use = off.stats(), off.backend.usage()
    assert same(got, want)
    assert st["coalesced_tensors"] == 0 and use["writes"] == st["tensors_offloaded"]


def test_big_and_small_tensors_mix(spill_dir):
    torch.manual_seed(0)
    model = Chain(n=3, per_block=3, numel=16 * KIB)
    big = nn.Linear(1024, 1024)
    want_in = torch.randn(512, 1024)

    def both(off=None):
        model.zero_grad(set_to_none=True)
        big.zero_grad(set_to_none=True)
        ctx = off.step() if off is not None else torch.enable_grad()
        with ctx:
            h = torch.relu(big(want_in))  # 2 MiB saves: stand-alone entries
            loss = h.sum() * model(h[0, :1].repeat(16 * KIB))  # small saves: coalesced
        loss.backward()
        return [loss.detach(), big.weight.grad.clone()] + [p.grad for p in model.parameters()]

    want = both()
    with make(spill_dir) as off:
        got = both(off)
        off.synchronize()  # writes are counted once they land (NOTE [Counted once])
        st = off.stats()
    assert same(got, want)
    assert 0 < st["coalesced_tensors"] < st["tensors_offloaded"]


def test_failed_batch_write_keeps_every_member_exact(spill_dir):
    torch.manual_seed(0)
    model = Chain(n=2, per_block=8, numel=16 * KIB)
    want = run(model)
    with make(spill_dir) as off:

        def fail(*args):
            raise OSError(errno.EIO, "injected")

        off.backend._pwrite = fail
        # settle: every batch's write is tried (and fails) before backward, which would
        # otherwise consume members still in staging before a write fails (a busy host)
        got = run(model, off, settle=True)
        off.synchronize()
        st = off.stats()
    assert same(got, want)
    assert st["io_errors"] > 0 and st["coalesced_tensors"] > 0
    assert st["disk_bytes_in_use"] == 0


def test_disk_full_at_seal_keeps_members_in_memory(spill_dir):
    torch.manual_seed(0)
    model = Chain(n=2, per_block=8, numel=64 * KIB)  # 16 x 256 KiB saves per block
    want = run(model)
    with make(spill_dir, max_disk_bytes="1MiB") as off:  # not even one 4 MiB batch
        got = run(model, off)
        off.synchronize()
        st, use = off.stats(), off.backend.usage()
    assert same(got, want)
    # The first full batch was refused at its seal; the rest of the step then stays resident.
    assert use["refused_quota"] >= 1 and st["kept_reasons"].get("quota", 0) > 0
    assert st["peak_disk_bytes"] <= 1 << 20 and st["disk_bytes_in_use"] == 0


def test_failed_batch_read_raises_for_its_members(spill_dir):
    torch.manual_seed(0)
    model = Chain(n=1, per_block=4, numel=16 * KIB)
    with make(spill_dir) as off:
        x = torch.randn(16 * KIB, requires_grad=True)
        with off.step(model):
            loss = model(x)
            off.synchronize()

            def fail(*args):
                raise OSError(errno.EIO, "injected")

            off.backend._preadv = fail
        with pytest.raises(tba.StorageError) as got:
            loss.backward()
        assert got.value.errno == errno.EIO
        off.backend._preadv = os.preadv


def test_modified_member_raises_and_the_rest_survive(spill_dir):
    with make(spill_dir) as off:
        a = torch.randn(16 * KIB, requires_grad=True)
        with off.step():
            h = a * 2
            y1 = torch.sin(h)  # saves h
            g = a * 3
            y2 = torch.cos(g)  # saves g
            h.add_(1)  # modifies a saved member before the batch is sealed
        y2.sum().backward(retain_graph=True)
        assert torch.equal(a.grad, -torch.sin(a.detach() * 3) * 3)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y1.sum().backward()


def test_dropped_graphs_free_batches(spill_dir):
    torch.manual_seed(0)
    model = Chain(n=3, per_block=8, numel=16 * KIB)
    with make(spill_dir) as off:
        x = torch.randn(16 * KIB, requires_grad=True)
        with off.step(model):
            loss = model(x)
        del loss  # graph dropped without backward: members die before or during the write
        off.synchronize()
        assert off.backend.usage()["disk_bytes_in_use"] == 0
        ((_, pool),) = off.io.adapters.values()
        assert pool.in_use == 0
        assert off.index.resident == 0
        # The same offloader keeps working.
        run(model, off)
        off.synchronize()
        assert off.backend.usage()["disk_bytes_in_use"] == 0 and pool.in_use == 0


def test_retained_graph_reads_batches_again(spill_dir):
    torch.manual_seed(0)
    model = Chain(n=2, per_block=4, numel=16 * KIB)
    x = torch.randn(16 * KIB, requires_grad=True)
    want = torch.autograd.grad(model(x), x, retain_graph=False)[0]
    with make(spill_dir) as off:
        with off.step(model):
            loss = model(x)
        first = torch.autograd.grad(loss, x, retain_graph=True)[0]
        second = torch.autograd.grad(loss, x)[0]
    assert torch.equal(first, want) and torch.equal(second, want)


def test_checksummed_batches(spill_dir):
    torch.manual_seed(0)
    model = Chain(n=2, per_block=4, numel=16 * KIB)
    want = run(model)
    with make(spill_dir, checksum="crc32") as off:
        assert same(run(model, off), want)
        assert off.stats()["coalesced_writes"] > 0


def test_a_read_that_completes_at_once_serves_the_whole_batch(spill_dir):
    """The memory backend completes reads inside read(): one read per batch all the same."""
    torch.manual_seed(0)
    model = Chain(n=2, per_block=16, numel=16 * KIB)
    want = run(model)
    with make(spill_dir, backend="memory") as off:
        got = run(model, off, settle=True)
        off.synchronize()
        use = off.backend.usage()
    assert same(got, want)
    assert use["reads"] == use["writes"] < 8


@pytest.mark.parametrize("coalesce", ["1MiB", "0"])
def test_views_are_captured_exactly_whichever_copy_takes_them(spill_dir, coalesce):
    """NOTE [Byte capture]: a whole storage and a dense view (one memmove each, even with its
    strides transposed), and a view that is not dense (the adapter's copy), come back exact,
    coalesced or in blocks of their own (under the direct-capture size either way)."""
    torch.manual_seed(0)
    big = torch.randn(64, 48)  # 12 KiB: no grad, outlives the step, its views do not
    cuts = [
        lambda: big.clone(),  # a storage of its own, whole
        lambda: big[8:40].t(),  # dense, not contiguous, not whole
        lambda: big[8:40],  # dense and contiguous, not whole
        lambda: big[:10, ::3],  # neither dense nor half the storage: copied contiguously
    ]

    def grads(off):
        ws = [torch.ones(cut().shape[-1], 2, requires_grad=True) for cut in cuts]
        with off.step() if off is not None else torch.enable_grad():
            loss = sum((cut() @ w).sum() for cut, w in zip(cuts, ws))  # saves each view
            if off is not None:
                off.synchronize()  # on disk before backward: read back, not forwarded
        loss.backward()
        return [w.grad for w in ws]

    want = grads(None)
    with make(spill_dir, coalesce_bytes=coalesce) as off:
        got = grads(off)
        st = off.stats()
    assert st["tensors_offloaded"] >= len(cuts)
    assert st["bytes_reloaded"] == st["bytes_offloaded"]
    assert same(got, want)
