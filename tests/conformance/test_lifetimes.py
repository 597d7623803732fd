"""Lifetimes: a graph freed without backward (no error, nothing left in tba), saved tensors
that die with their graph (weak references to tensors and storages), tensors the caller still
holds, a graph freed by the cyclic GC, and a backward after the Offloader was closed.

Only a saved tensor's own graph can keep it alive; tba holds a tensor until its write completes
(known, with ``coalesce_bytes=0``), so every check first waits for the writes (``settle``)."""

from __future__ import annotations

import gc
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .conftest import UnderTba, run_both


def settle(fwd) -> None:
    gc.collect()
    if isinstance(fwd, UnderTba):
        fwd.settle()


def assert_nothing_left(under_tba: UnderTba) -> None:
    under_tba.settle()
    st = under_tba.off.stats()
    left = {k: st[k] for k in ("live_entries", "resident_bytes", "disk_bytes_in_use")}
    assert left == {"live_entries": 0, "resident_bytes": 0, "disk_bytes_in_use": 0}, left


def forward(x, w):
    """Saves intermediates and inputs, no node's own output (sin, cos and mul save inputs)."""
    h = (x @ w).sin()
    return h, (h * h.cos()).sum()


def watched(fwd):
    """``forward`` under ``fwd``: the loss, the weight, and weak references to the saved
    intermediate ``h`` and its storage (``h`` itself is not held)."""
    x = torch.randn(16, 8)
    w = torch.randn(8, 8, requires_grad=True)
    with fwd():
        h, loss = forward(x, w)
    return loss, w, weakref.ref(h), StorageWeakRef(h.untyped_storage())


def test_graph_freed_without_backward_leaves_nothing(under_tba):
    def case(fwd):
        x = torch.randn(16, 8)
        w = torch.randn(8, 8, requires_grad=True)
        for _ in range(3):
            with fwd():
                h, loss = forward(x, w)
            del h, loss
        settle(fwd)
        return w.grad

    run_both(case, under_tba)
    assert_nothing_left(under_tba)


def test_saved_intermediates_die_with_their_graph_like_stock(under_tba):
    def case(fwd):
        loss, w, ref, storage = watched(fwd)
        del loss  # the graph dies
        settle(fwd)
        return ref() is None, storage.expired()

    run_both(case, under_tba)
    assert_nothing_left(under_tba)


def test_saved_tensors_die_after_backward_like_stock(under_tba):
    def case(fwd):
        loss, w, ref, storage = watched(fwd)
        loss.backward()  # frees the saved tensors; ``loss`` and its graph's nodes stay
        settle(fwd)
        return ref() is None, storage.expired(), w.grad

    run_both(case, under_tba)
    assert_nothing_left(under_tba)


def test_retained_graph_dies_when_dropped_like_stock(under_tba):
    def case(fwd):
        loss, w, ref, storage = watched(fwd)
        loss.backward(retain_graph=True)
        loss.backward(retain_graph=True)
        grads = w.grad.clone()
        del loss
        settle(fwd)
        return ref() is None, storage.expired(), grads

    run_both(case, under_tba)
    assert_nothing_left(under_tba)


def test_saved_output_dies_with_its_graph_like_stock(under_tba):
    """``exp``, ``tanh`` and ``sigmoid`` save their own result: stock saves it without its
    grad_fn, so dropping the graph frees it."""

    def case(fwd):
        x = torch.randn(16, 8)
        w = torch.randn(8, 8, requires_grad=True)
        with fwd():
            h = (x @ w).exp()
            loss = (h.tanh().sigmoid() * 2).sum()
        ref, storage = weakref.ref(h), StorageWeakRef(h.untyped_storage())
        del h, loss
        settle(fwd)
        return ref() is None, storage.expired()

    run_both(case, under_tba)
    assert_nothing_left(under_tba)


def test_graph_freed_by_the_cyclic_gc_like_stock(under_tba):
    """The graph's only owner is a Python reference cycle: ``gc.collect()`` frees it."""

    def case(fwd):
        loss, w, ref, storage = watched(fwd)
        holder: dict = {"loss": loss}
        holder["self"] = holder
        del loss, holder
        settle(fwd)
        return ref() is None, storage.expired()

    run_both(case, under_tba)
    assert_nothing_left(under_tba)


def test_held_inputs_outlive_the_graph_like_stock(under_tba):
    def case(fwd):
        x = torch.randn(16, 8)
        w = torch.randn(8, 8, requires_grad=True)
        a = x * 2
        with fwd():
            _, loss = forward(a, w)
        ref = weakref.ref(a)
        del loss
        settle(fwd)
        return ref() is a, a

    run_both(case, under_tba)
    assert_nothing_left(under_tba)


def test_backward_after_close_matches_stock(under_tba):
    """Closing the Offloader with a graph alive brings its saved tensors back into memory."""

    def case(fwd):
        x = torch.randn(16, 8, requires_grad=True)
        w = torch.randn(8, 8, requires_grad=True)
        with fwd():
            _, loss = forward(x * 1.5, w)
        if isinstance(fwd, UnderTba):
            fwd.off.synchronize()
            fwd.close()
        loss.backward()
        return loss, x.grad, w.grad

    run_both(case, under_tba)


def test_many_graphs_alive_at_once_match_stock(under_tba):
    def case(fwd):
        w = torch.randn(8, 8, requires_grad=True)
        losses = []
        for i in range(4):
            with fwd():
                losses.append(forward(torch.randn(16, 8) * (i + 1), w)[1])
        for loss in reversed(losses):
            loss.backward()
        return w.grad

    run_both(case, under_tba)
    assert_nothing_left(under_tba)
