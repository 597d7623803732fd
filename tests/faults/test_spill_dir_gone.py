"""ENOENT: the spill directory removed under a running Offloader (``rm -rf`` by a cleanup
job). The slabs already open have no name and keep working; a new slab cannot be made, so
what does not fit stays in memory as ``kept_reasons["spill_dir_gone"]``, with one warning
that names ENOENT and TBA_SPILL_DIR (one in all: not one from the storage layer too, nor
another at close for the directory it cannot remove). Gradients exact; closing frees every
block."""

from __future__ import annotations

import os
import shutil

import pytest

from .util import (
    BACKENDS,
    assert_exact,
    grads,
    make_batch,
    make_model,
    tba_warnings,
    train_step,
    warnings_text,
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_spill_dir_removed_mid_run(spill_fs, offloaders, backend, caplog):
    model = make_model()
    small, large = make_batch(0.5), make_batch(2)
    want_small, want_large = grads(model, small), grads(model, large)
    baseline = spill_fs.baseline()
    off = offloaders(spill_fs.root, backend=backend)
    first = train_step(off, model, small)
    assert first["tensors_offloaded"] > 0 and first["kept_reasons"] == {}, first
    shutil.rmtree(spill_fs.root)  # the root and the per-process directory in it
    again = train_step(off, model, small)  # the open slabs are enough
    assert_exact(model, want_small)
    assert again["kept_reasons"] == {} and again["bytes_offloaded"] == first["bytes_offloaded"]
    bigger = train_step(off, model, large)  # needs a new slab
    assert_exact(model, want_large)
    assert set(bigger["kept_reasons"]) == {"spill_dir_gone"}, bigger["kept_reasons"]
    text = warnings_text(caplog)
    assert "(spill_dir_gone)" in text and "ENOENT" in text and "TBA_SPILL_DIR" in text, text
    again = train_step(off, model, large)  # refused again: no second warning
    assert_exact(model, want_large)
    assert set(again["kept_reasons"]) == {"spill_dir_gone"}, again["kept_reasons"]
    off.close()
    assert not os.path.exists(spill_fs.root)  # close made nothing again
    warned = tba_warnings(caplog)
    assert len(warned) == 1 and "ENOENT" in warned[0], warned
    os.mkdir(spill_fs.root, 0o700)  # the baseline counts the root's own block and inode
    spill_fs.assert_no_bytes_left(baseline)
