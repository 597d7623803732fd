"""EIO: the ext4 shutdown ioctl on the loop filesystem (every I/O on it fails from then on, as
when a device vanishes). Bytes whose write fails stay in memory (``kept_reasons["io_error"]``)
and their gradients are exact; bytes already on disk cannot come back, and backward raises
``tba.StorageError`` (errno EIO) naming the slab, the offset and the byte count. After the
filesystem is mounted again, the blocks of the nameless slabs are free again, and the next
Offloader's sweep removes the empty per-process directory that could not be removed."""

from __future__ import annotations

import errno
import os
import time

import pytest

import tba

from .util import BACKENDS, assert_exact, grads, loss_of, make_batch, make_model, sweep, train_step


def close_after_shutdown(off, fs, baseline) -> None:
    """Close ``off`` on a shut-down filesystem, then count what is left once it is mounted
    again: only the spill dir, whose removal failed with EIO (empty, for the janitor), and
    after the janitor's sweep not a byte."""
    spill = os.path.basename(off.backend.spill_path)
    off.close()
    fs.cycle()
    assert fs.files_under_root() == [spill]
    sweep(fs.root)
    fs.assert_no_bytes_left(baseline)


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_after_a_shutdown_keep_the_bytes_in_memory(loop_ext4, offloaders, backend):
    fs = loop_ext4
    model, x = make_model(), make_batch(1)
    want = grads(model, x)
    baseline = fs.baseline()
    off = offloaders(fs.root, backend=backend)
    first = train_step(off, model, x)  # the slabs exist: the next step needs no new one
    assert first["tensors_offloaded"] > 0 and first["kept_reasons"] == {}, first
    fs.shutdown()
    st = train_step(off, model, x)
    assert_exact(model, want)
    assert st["tensors_offloaded"] == 0, st
    assert st["kept_reasons"] == {"io_error": first["tensors_offloaded"]}, st["kept_reasons"]
    assert off.backend.usage()["io_errors"] > 0
    close_after_shutdown(off, fs, baseline)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bytes_on_disk_at_a_shutdown_raise_a_storage_error(loop_ext4, offloaders, backend):
    fs = loop_ext4
    model, x = make_model(), make_batch(1)
    baseline = fs.baseline()
    off = offloaders(fs.root, backend=backend)
    with off.step(model):
        loss = loss_of(model, x)
        off.synchronize()  # every write done, no read started yet
        assert off.backend.usage()["bytes_written"] > 0
        fs.shutdown()
    with pytest.raises(
        tba.StorageError, match=r"read of \d+ bytes at offset \d+ in .*/slab-\d+ .*EIO"
    ) as e:
        loss.backward()
    assert e.value.errno == errno.EIO
    del loss
    close_after_shutdown(off, fs, baseline)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shutdown_while_writes_are_in_flight(loop_ext4, offloaders, backend):
    """Writes capped at 4 MB/s: the shutdown lands while most are queued or in the kernel.
    Those fail and are kept in memory; the first one (at least) reached the disk, and its
    tensor is gone (a live tensor would be served from memory), so backward, which needs it,
    raises the typed error rather than returning anything."""
    fs = loop_ext4
    model = make_model()
    baseline = fs.baseline()
    off = offloaders(fs.root, backend=backend, max_write_bps="4MB/s", coalesce_bytes=0)
    with off.step(model):
        loss = loss_of(model, make_batch(1))  # the input dies too: every saved tensor is
        # only in tba's hands; the first write lands before the shutdown, whatever the load
        deadline = time.monotonic() + 60
        while off.backend.usage()["bytes_written"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        fs.shutdown()
    off.synchronize()
    st = off.stats()
    assert st["tensors_offloaded"] >= 1 and st["kept_reasons"].get("io_error", 0) >= 1, st
    assert set(st["kept_reasons"]) == {"io_error"}, st["kept_reasons"]
    with pytest.raises(tba.StorageError, match="EIO") as e:
        loss.backward()
    assert e.value.errno == errno.EIO
    del loss
    close_after_shutdown(off, fs, baseline)
