"""EROFS: the spill filesystem remounted read-only (``mount -o remount,ro``) under a running
Offloader. Saved tensors stay in memory as ``kept_reasons["read_only"]``, exact; offloading
resumes in the first step after a read-write remount. The kernel refuses a read-only remount
while a file is open for writing, so the remount can only land before tba's first slab (or
after its slabs are closed): that is where these tests put it."""

from __future__ import annotations

import os

import pytest

from .util import (
    BACKENDS,
    assert_exact,
    grads,
    make_batch,
    make_model,
    sweep,
    train_step,
    warnings_text,
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_only_remount_mid_run(loop_ext4, offloaders, backend, caplog):
    fs = loop_ext4
    model, x = make_model(), make_batch(0.5)
    want = grads(model, x)
    baseline = fs.baseline()
    off = offloaders(fs.root, backend=backend)
    fs.must_remount("ro")
    st = train_step(off, model, x)
    assert_exact(model, want)
    assert st["tensors_offloaded"] == 0 and set(st["kept_reasons"]) == {"read_only"}, st
    text = warnings_text(caplog)
    assert "(read_only)" in text and "EROFS" in text and "remount it read-write" in text, text
    fs.must_remount("rw")
    st = train_step(off, model, x)
    assert_exact(model, want)
    assert st["tensors_offloaded"] > 0 and st["kept_reasons"] == {}, st
    busy = fs.remount("ro")  # the slabs are open for writing now
    assert busy.returncode != 0 and "busy" in busy.stderr, busy.stderr
    off.close()
    fs.assert_no_bytes_left(baseline)


@pytest.mark.parametrize("backend", BACKENDS)
def test_still_read_only_at_close(loop_ext4, offloaders, backend):
    """close() cannot remove the per-process directory (EROFS) and says so; it holds no
    bytes, and the next Offloader's sweep removes it once the filesystem is writable."""
    fs = loop_ext4
    model, x = make_model(), make_batch(0.5)
    want = grads(model, x)
    baseline = fs.baseline()
    off = offloaders(fs.root, backend=backend)
    fs.must_remount("ro")
    st = train_step(off, model, x)
    assert_exact(model, want)
    assert set(st["kept_reasons"]) == {"read_only"}, st["kept_reasons"]
    spill = os.path.basename(off.backend.spill_path)
    off.close()
    fs.must_remount("rw")
    assert fs.files_under_root() == [spill]
    sweep(fs.root)
    fs.assert_no_bytes_left(baseline)
