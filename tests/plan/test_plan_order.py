"""NOTE [Plan order]: which forward's reads the prefetcher serves first.

Pipeline schedules (1F1B) run several micro-batches' forwards before the first backward, which
belongs to the oldest; a graph kept alive without a backward must not hold the budget that the
running backward needs. Each test settles the I/O (``synchronize``) before a backward, so a
sync load means "no read had been issued for it", not a race.
"""

from __future__ import annotations

import torch
import torch.nn as nn

MiB = 1 << 20


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(512, 512), nn.Tanh())])


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(128, 512, generator=g) for _ in range(n)]


def reference(xs, order):
    model = mlp()
    losses = [model(x).square().mean() for x in xs]
    for i in order:
        losses[i].backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_grads_equal(model, want, steps):
    """Bit-identical gradients; on a mismatch, say which parameters differ and by how much, and
    what each step read and loaded, so that a rare failure leaves its evidence. The one caught
    (2026-11-28, about 1 in 100 runs with two CPU hogs beside it: every parameter off by at most
    ~1e-10, no sync load or stall) was the reference's, not tba's: it was the process's first
    torch.tanh, which MKL's vector math computes less accurately on the OpenMP worker's half, now
    and then, on first use (NOTE [First-call math] in tba/testing.py). conftest.py makes those
    first calls before any test."""
    got = [p.grad for p in model.parameters()]
    if all(map(torch.equal, got, want)):
        return
    diffs = [
        f"{name}: max |diff| {(g - w).abs().max().item():.3g} of max |grad| "
        f"{w.abs().max().item():.3g}, {(g != w).sum().item()} of {w.numel()} differ"
        for (name, _), g, w in zip(model.named_parameters(), got, want)
        if not torch.equal(g, w)
    ]
    seen = [
        dict(reloaded=s.bytes_reloaded, sync=s.sync_loads, stall=round(s.stall_seconds, 4))
        for s in steps
    ]
    raise AssertionError("gradients differ: " + "; ".join(diffs) + f"; steps {seen}")


def forwards(off, model, xs):
    """One tba step per micro-batch; returns (losses, their StepStates)."""
    losses, steps = [], []
    for x in xs:
        with off.step(model):
            losses.append(model(x).square().mean())
            steps.append(off._current)
    return losses, steps


def make(make_offloader, prefetch):
    # 9 offloaded tensors of 256 KiB per micro-batch (each Tanh output is the next Linear's
    # input: one entry), written one by one; reads bounded by ``prefetch``
    return make_offloader(coalesce_bytes=0, prefetch_bytes=prefetch, keep_last=0)


def test_1f1b_reads_the_oldest_forward_first(make_offloader):
    xs = batches(3)
    want = reference(xs, [0, 1, 2])
    off = make(make_offloader, MiB)  # less than half of one micro-batch's 2.25 MiB
    model = mlp()
    losses, steps = forwards(off, model, xs)  # F1 F2 F3, then B1 B2 B3
    for loss, st in zip(losses, steps):
        off.synchronize()
        loss.backward()
        assert st.sync_loads == 0, [s.sync_loads for s in steps]
    assert_grads_equal(model, want, steps)
    assert all(st.bytes_reloaded > 0 for st in steps)


def test_a_newer_forward_keeps_its_reads_when_an_older_backward_starts(make_offloader):
    xs = batches(2)
    off = make(make_offloader, 8 * MiB)  # room for both micro-batches
    model = mlp()
    reads = []
    real, staged = off.reader.start_read, off.io.staged_to_host

    def spy(e):
        reads.append(e)
        real(e)

    def spy_staged(e):  # asked for while still being written: served from staging, not read
        reads.append(e)
        staged(e)

    off.prefetcher.start = off.reader.start_read = spy  # prefetches and sync loads
    off.io.staged_to_host = spy_staged  # a slow write (a loaded machine) takes this way
    losses, steps = forwards(off, model, xs)
    off.synchronize()  # both plans read as far as the budget goes
    issued = len(reads)
    assert {e.step for e in reads} == set(steps)  # the newer forward has reads in too
    for loss in losses:
        loss.backward()
        off.synchronize()
    assert len(reads) == issued  # none dropped and read again
    assert len({id(e) for e in reads}) == len(reads)
    assert [s.sync_loads for s in steps] == [0, 0]


def test_a_graph_without_backward_does_not_starve_the_running_one(make_offloader):
    xs = batches(2)
    want = reference(xs[1:], [0])
    off = make(make_offloader, MiB)
    model = mlp()
    (stale, loss), (st_stale, st) = forwards(off, model, xs)
    off.synchronize()  # the older, stale forward's reads fill the budget
    assert off.prefetcher.inflight > 0
    loss.backward()
    assert st.sync_loads == 0 and st_stale.sync_loads == 0
    assert_grads_equal(model, want, [st_stale, st])
    del stale
    off.synchronize()
    assert off.prefetcher.inflight == 0
    assert off.stats()["disk_bytes_in_use"] == 0
