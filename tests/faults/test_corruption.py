"""Corruption: bytes of a slab file inverted after the write, through /proc/self/fd, as a bad
drive, cable or another process with access to the file could. With the default checksum
(``TBA_CHECKSUM=auto``) backward raises ``tba.StorageError`` (EBADMSG) naming the slab, the
offset and both digests; with ``TBA_CHECKSUM=off`` the corrupted bytes come back and the
gradients are wrong, which is what the checksum is for."""

from __future__ import annotations

import errno

import pytest

import tba

from .util import (
    BACKENDS,
    MiB,
    assert_exact,
    flip_spill_bytes,
    grads,
    loss_of,
    make_batch,
    make_model,
)


def corrupted_step(off, model, x):
    """A forward whose spilled bytes are inverted once written, before any read."""
    model.zero_grad(set_to_none=True)
    with off.step(model):
        loss = loss_of(model, x)
        off.synchronize()
        assert flip_spill_bytes(off.backend.spill_path, 16 * MiB) >= 1
    return loss


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_flipped_byte_is_a_checksum_error(spill_fs, offloaders, backend):
    assert tba.Config(environ={}).checksum == "auto"
    model, x = make_model(), make_batch(1)
    baseline = spill_fs.baseline()
    off = offloaders(spill_fs.root, backend=backend)  # the default checksum
    loss = corrupted_step(off, model, x)
    with pytest.raises(
        tba.StorageError,
        match=r"read of \d+ bytes at offset \d+ in .*slab-\d+ .*EBADMSG.* Checksum \w+ "
        r"mismatch: expected 0x[0-9a-f]+, got 0x[0-9a-f]+",
    ) as e:
        loss.backward()
    assert e.value.errno == errno.EBADMSG
    assert off.backend.usage()["checksum_errors"] >= 1
    del loss
    off.close()
    spill_fs.assert_no_bytes_left(baseline)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_checksums_the_same_flip_is_a_wrong_gradient(spill_fs, offloaders, backend):
    """Documents what TBA_CHECKSUM=off gives up: the one case in the suite where tba returns
    a wrong gradient, silently."""
    model, x = make_model(), make_batch(1)
    want = grads(model, x)
    baseline = spill_fs.baseline()
    off = offloaders(spill_fs.root, backend=backend, checksum="off")
    corrupted_step(off, model, x).backward()
    with pytest.raises(AssertionError, match="differ from the run without tba"):
        assert_exact(model, want)
    assert off.backend.usage()["checksum_errors"] == 0
    off.close()
    spill_fs.assert_no_bytes_left(baseline)
