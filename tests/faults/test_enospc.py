"""ENOSPC: the spill filesystem runs out mid-step. Saved tensors that find no room stay in
memory (``kept_reasons["disk_full"]``), the gradients are exact, and no OSError reaches the
user."""

from __future__ import annotations

import pytest

from .util import (
    BACKENDS,
    MiB,
    assert_exact,
    grads,
    make_batch,
    make_model,
    tba_warnings,
    train_step,
    warnings_text,
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fallocate_refused_by_the_kernel_mid_step(loop_ext4, offloaders, backend, caplog):
    """Free space in 256 KiB holes: statvfs says 22 MiB are free, but a slab that takes all of
    what is left needs one more block for its extent tree, so the kernel's fallocate fails
    with ENOSPC after two 8 MiB slabs have been made."""
    fs = loop_ext4
    model, x = make_model(layers=6), make_batch(2)  # 12 saved tensors of 2 MiB
    want = grads(model, x)
    assert fs.fragment(22 * MiB) < 24 * MiB
    baseline = fs.baseline()
    off = offloaders(fs.root, backend=backend, slab_bytes="8MiB")
    for _ in range(2):  # the next step meets the full disk again
        st = train_step(off, model, x)
        assert_exact(model, want)
        assert st["tensors_offloaded"] > 0 and st["kept_reasons"].get("disk_full", 0) > 0, st
        assert set(st["kept_reasons"]) == {"disk_full"}, st["kept_reasons"]
    text = warnings_text(caplog)
    assert "(disk_full)" in text and "fallocate" in text and "ENOSPC" in text, text
    off.close()
    assert len(tba_warnings(caplog)) == 1, tba_warnings(caplog)  # one cause, two steps
    fs.assert_no_bytes_left(baseline)


@pytest.mark.parametrize("backend", BACKENDS)
def test_disk_filled_by_another_writer_after_the_slabs_exist(
    loop_ext4, offloaders, backend, caplog
):
    """Slabs are preallocated: once another file takes every free block, the space tba holds
    still serves whole steps (no write meets ENOSPC); only a step that needs more is kept in
    memory, as disk_full."""
    fs = loop_ext4
    model = make_model()
    small, large = make_batch(0.5), make_batch(1.5)  # 4 MiB saved, then 12 MiB
    want_small, want_large = grads(model, small), grads(model, large)
    baseline = fs.baseline()
    off = offloaders(fs.root, backend=backend, slab_bytes="8MiB")
    first = train_step(off, model, small)
    assert first["kept_reasons"] == {} and first["tensors_offloaded"] > 0, first
    assert fs.fill(), "the other writer found no free space"
    assert fs.free_bytes() < MiB
    again = train_step(off, model, small)
    assert_exact(model, want_small)
    assert again["kept_reasons"] == {}, again["kept_reasons"]
    assert again["bytes_offloaded"] == first["bytes_offloaded"]
    bigger = train_step(off, model, large)
    assert_exact(model, want_large)
    assert bigger["tensors_offloaded"] > 0, bigger
    assert set(bigger["kept_reasons"]) == {"disk_full"}, bigger["kept_reasons"]
    assert "(disk_full)" in warnings_text(caplog)
    off.close()
    assert len(tba_warnings(caplog)) == 1, tba_warnings(caplog)
    fs.remove_hog()
    fs.assert_no_bytes_left(baseline)
