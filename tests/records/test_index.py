"""Dedup, layouts, round trips, lifetimes and the in-place check."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn

import tba
from tba.records.handle import contiguous_stride, is_dense, layout


class SaveForBackward(torch.autograd.Function):
    """Saves ``t`` and, in backward, records what autograd handed back."""

    got: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx, anchor, t):
        ctx.save_for_backward(t)
        return anchor.clone()

    @staticmethod
    def backward(ctx, g):
        (t,) = ctx.saved_tensors
        SaveForBackward.got.append(t)
        return g, None


def round_trip(off, t: torch.Tensor) -> torch.Tensor:
    """Save ``t`` (the caller's last reference) and return what backward received."""
    SaveForBackward.got.clear()
    anchor = torch.zeros(1, requires_grad=True)
    with off.step():
        out = SaveForBackward.apply(anchor, t)
        del t  # nothing else holds it, so backward cannot be served the original
        off.synchronize()  # written before backward, so the bytes come back from disk
    out.sum().backward()
    return SaveForBackward.got[0]


def make_like(t: torch.Tensor) -> torch.Tensor:
    """A copy of the view ``t`` with the same strides and offset, on a storage of its own."""
    base = t.untyped_storage()
    copy = torch.empty(0, dtype=t.dtype).set_(base.clone(), t.storage_offset(), t.shape, t.stride())
    return copy


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def special_floats(dtype, n=1024):
    x = torch.randn(n).to(dtype)
    x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]).to(dtype)
    return x


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.rand(999) > 0.5,
        lambda: torch.randint(0, 256, (1001,), dtype=torch.uint8),
        lambda: torch.randint(-(2**62), 2**62, (333,), dtype=torch.int64),
        lambda: special_floats(torch.float16),
        lambda: special_floats(torch.bfloat16),
        lambda: special_floats(torch.float32),
        lambda: special_floats(torch.float64),
        lambda: torch.randn(3, 5, dtype=torch.complex64),
    ],
    ids=["bool", "uint8", "int64", "fp16", "bf16", "fp32", "fp64", "complex64"],
)
def test_dtype_round_trip_bit_exact(make, make_offloader):
    off = make_offloader()
    t = make()
    got = round_trip(off, t.clone())
    assert same_bits(got, t)
    assert off.stats()["bytes_reloaded"] > 0


@pytest.mark.parametrize(
    "make,keeps_stride",
    [
        (lambda: torch.randn(64, 48).t(), True),  # transpose: dense, permuted strides
        (lambda: torch.randn(8, 3, 16)[:, 1], True),  # slice at a non-zero offset, > half
        (lambda: torch.randn(1, 40).expand(30, 40), True),  # stride-0 broadcast
        (lambda: torch.randn(4, 8, 16).permute(2, 0, 1), True),
        (lambda: torch.randn(32, 96).split(32, dim=1)[2], True),  # a k/v-like chunk
        (lambda: torch.randn(256, 256)[:32:2, :32:2], False),  # small strided view: compact
        (lambda: torch.randn(100)[10:30], True),  # dense piece of a bigger storage
    ],
    ids=[
        "transpose",
        "offset_slice",
        "broadcast",
        "permute",
        "split_chunk",
        "sparse_view",
        "piece",
    ],
)
def test_non_contiguous_round_trip(make, keeps_stride, make_offloader):
    off = make_offloader()
    t = make()
    got = round_trip(off, t.clone() if t.is_contiguous() else make_like(t))
    assert torch.equal(got, t)
    if keeps_stride:
        assert got.stride() == t.stride()
    else:
        assert got.is_contiguous()


def test_layout_choices():
    base = torch.randn(8, 96)
    q, k, v = base.split(32, dim=1)
    assert layout(base, base.untyped_storage().nbytes())[0] is True
    whole, nbytes, stride, offset = layout(v, base.untyped_storage().nbytes())
    assert whole and nbytes == base.numel() * 4 and stride == v.stride() and offset == 64
    spread = torch.randn(256, 256)[::16, ::16]  # spans most of its storage: whole
    assert layout(spread, 256 * 256 * 4)[0] is True
    small = torch.randn(256, 256)[:32:2, :32:2]
    whole, nbytes, stride, _ = layout(small, 256 * 256 * 4)
    assert not whole and nbytes == 16 * 16 * 4 and stride == (16, 1)
    assert is_dense((4, 1, 3), (3, 99, 1)) and not is_dense((4, 3), (4, 1))
    assert contiguous_stride((2, 3, 4)) == (12, 4, 1)


def test_tensor_saved_twice_written_once(make_offloader):
    off = make_offloader()
    x = torch.randn(64, 64, requires_grad=True)
    with off.step():
        y = x.exp()  # saves y (its output)
        z = (y * y).sum()  # saves y twice more
        off.synchronize()
        writes = off.backend.usage()["writes"]
    z.backward()
    st = off.stats()
    assert writes == 1 and st["tensors_offloaded"] == 1 and st["dedup_hits"] == 2
    assert torch.allclose(x.grad, 2 * torch.exp(2 * x) + 0 * x)


def test_qkv_views_share_one_write(make_offloader):
    off = make_offloader()
    lin = nn.Linear(16, 48)
    x = torch.randn(8, 16)
    with off.step():
        q, k, v = lin(x).split(16, dim=1)
        out = ((q @ k.t()) * 1.0) @ v  # saves q, k.t() and v: three views, one storage
        off.synchronize()
    out.sum().backward()
    st = off.stats()
    # x (saved by the projection), the qkv storage once for q, k.t() and v, and q @ k.t()
    assert st["tensors_offloaded"] == 3
    assert st["dedup_hits"] == 2


def test_parameters_are_never_written(make_offloader):
    off = make_offloader()
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    x = torch.randn(4, 32, requires_grad=True)
    with off.step(model):
        loss = (x @ model[0].weight.t()).sum() + (model[1].weight * model[1].weight).sum()
        off.synchronize()
    loss.backward()
    assert off.backend.usage()["writes"] == 0
    st = off.stats()
    assert st["tensors_offloaded"] == 0 and st["saved_bytes"] == 0


def test_activations_written_but_weights_not(make_offloader):
    off = make_offloader()
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    written: list[int] = []
    real_offload = off.packer.offload

    def spy(t, storage, *args):
        written.append(storage._cdata)
        return real_offload(t, storage, *args)

    off.packer.offload = spy
    with off.step(model):
        loss = model(torch.randn(16, 32)).square().sum()
        off.synchronize()
    loss.backward()
    assert written and not params.intersection(written)
    assert off.backend.usage()["writes"] == off.stats()["tensors_offloaded"]


def test_freed_storage_never_aliases_an_old_entry(make_offloader):
    """A storage freed while its entry lives must not let a new storage match that entry.

    The allocator hands a freed block of the same size straight back, so without the entry's
    weak reference pinning the StorageImpl, the new storage would get the old address and the
    same dedup key, and backward would receive the old values.
    """
    off = make_offloader()
    w = torch.ones(1024, requires_grad=True)
    losses = []
    with off.step():
        for i in range(20):
            a = torch.full((1024,), float(i))
            losses.append((w * a).sum())  # saves a; only the graph (the handle) keeps it
            del a
        off.synchronize()
    sum(losses).backward()
    assert torch.equal(w.grad, torch.full((1024,), float(sum(range(20)))))
    assert off.stats()["dedup_hits"] == 0 and off.stats()["tensors_offloaded"] == 20


def test_entry_outliving_its_step_is_not_aliased(make_offloader):
    """Graphs of earlier steps stay alive (accumulation): their entries must keep their keys."""
    off = make_offloader()
    w = torch.ones(1024, requires_grad=True)
    losses = []
    for i in range(10):
        with off.step():
            a = torch.full((1024,), float(i))
            losses.append((w * a).sum())
            del a
            off.synchronize()
    sum(losses).backward()
    assert torch.equal(w.grad, torch.full((1024,), float(sum(range(10)))))


def test_dropped_graph_leaves_nothing(make_offloader):
    off = make_offloader()
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    with off.step(model):
        loss = model(torch.randn(32, 64)).square().sum()
    off.synchronize()  # writes are counted once they land (NOTE [Counted once])
    assert off.stats()["tensors_offloaded"] > 0
    del loss
    gc.collect()
    off.synchronize()
    assert off.backend.usage()["disk_bytes_in_use"] == 0
    assert off.stats()["disk_bytes_in_use"] == 0
    assert off.index.resident == 0 and off.stats()["live_entries"] == 0
    for _, pool in off.io.adapters.values():
        assert pool.in_use == 0


@pytest.mark.parametrize("min_offload", [1, 1 << 30], ids=["offloaded", "kept"])
def test_inplace_after_pack_raises(min_offload, make_offloader):
    off = make_offloader(min_offload_bytes=min_offload)
    x = torch.randn(64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    with off.step():
        y = x.sigmoid()  # saves y
        z = (y * w).sum()  # saves y again
        off.synchronize()
    y.add_(1)
    with pytest.raises(tba.UnpackError, match="modified by an inplace operation"):
        z.backward()


def test_stock_pytorch_raises_the_same_way():
    x = torch.randn(64, requires_grad=True)
    y = x.sigmoid()
    z = (y * 2).sum()
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_inplace_on_a_dead_tensor_raises_like_stock(make_offloader):
    """A tensor modified in place and gone by backward: stock PyTorch raises (its saved
    variable keeps the version counter), and so does tba (NOTE [Version witness])."""
    off = make_offloader()
    w = torch.randn(64, requires_grad=True)
    x = torch.randn(64)
    with off.step():
        y = x.exp()
        z = (y * w).sum()
        off.synchronize()
    y.add_(1)
    del y
    with pytest.raises(tba.UnpackError, match="modified by an inplace operation"):
        z.backward()


def test_a_dead_tensor_left_alone_gives_its_pack_time_values(make_offloader):
    off = make_offloader()
    w = torch.randn(64, requires_grad=True)
    x = torch.randn(64)
    with off.step():
        y = x.exp()
        z = (y * w).sum()
        off.synchronize()
    del y
    z.backward()
    assert torch.equal(w.grad, x.exp())


def test_handles_freed_by_cyclic_gc_are_released_at_a_safe_point(make_offloader):
    """NOTE [Deferred release]: __del__ only queues; the next safe point frees the extent."""
    off = make_offloader()
    w = torch.randn(4096, requires_grad=True)

    class Holder:
        pass

    with off.step():
        holder = Holder()
        holder.loss = (torch.randn(4096).exp() * w).sum()
        holder.me = holder  # a reference cycle: only the cyclic GC can free the graph
        off.synchronize()
    off.synchronize()  # the prefetch read too: no I/O callback (also a safe point) may run now
    assert off.backend.usage()["disk_bytes_in_use"] > 0
    del holder
    gc.collect()  # may run anywhere in real code, e.g. under the slab lock
    assert len(off.index.graveyard) == 1  # queued, nothing freed inside __del__
    assert off.backend.usage()["disk_bytes_in_use"] > 0
    off.stats()  # a safe point: the entry is retired (its prefetch read may still be running)
    assert not off.index.graveyard and off.stats()["live_entries"] == 0
    off.synchronize()
    assert off.backend.usage()["disk_bytes_in_use"] == 0 == off.stats()["disk_bytes_in_use"]


def test_storage_ref_keeps_the_storage_impl_not_its_data():
    """NOTE [Storage identity]: while a StorageRef lives, the StorageImpl's address is not
    reused; it reports expired once the storage is gone, and frees its weak reference."""
    from tba.records.step import StorageRef

    t = torch.randn(1 << 16)
    ref = StorageRef(t.untyped_storage())
    cdata = t.untyped_storage()._cdata
    assert ref.cdata == cdata and not ref.expired()
    del t
    assert ref.expired()
    fresh = [torch.randn(1 << 16) for _ in range(64)]  # same size: would reuse a freed impl
    assert all(x.untyped_storage()._cdata != cdata for x in fresh)
    del ref  # drops the weak reference (no crash, no leak of the impl past this point)
