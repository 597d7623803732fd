"""Issue 15's findings, one test each, through the public API only (so that each also runs,
and fails, on the code before the fix): in-place edits in every timing, corruption on disk,
refusals that name their cause, resource settings checked at start, and counters that say
what reached the disk."""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil
import threading

import pytest
import torch

import tba

from .faults.util import flip_spill_bytes

MiB = 1 << 20


def make(spill_dir, **kw):
    kw.setdefault("spill_dir", spill_dir)
    kw.setdefault("backend", "posix")
    kw.setdefault("min_offload_bytes", 1)
    kw.setdefault("keep_last", 0)
    kw.setdefault("staging_bytes", "32MiB")
    kw.setdefault("slab_bytes", "16MiB")
    kw.setdefault("min_free_bytes", 0)
    return tba.Offloader(tba.Config(environ={}, **kw))


@pytest.fixture
def offloaders(spill_dir):
    made = []

    def build(**kw):
        off = make(spill_dir, **kw)
        made.append(off)
        return off

    yield build
    for off in made:
        off.close()


def gate(real):
    """A syscall held until the returned event is set."""
    ev = threading.Event()

    def call(*args):
        ev.wait(30)
        return real(*args)

    return call, ev


def inplace_case(off, numel, settle_in_forward):
    """``loss`` saves ``y = exp(x)``; ``y`` is edited in place and dropped before backward."""
    w = torch.randn(numel, requires_grad=True)
    x = torch.randn(numel)
    with off.step():
        y = x.exp()
        loss = (y * w).sum()
        if settle_in_forward:
            off.synchronize()  # written before the forward ends: prefetch reads it from disk
    off.synchronize()
    y.add_(1)
    del y
    gc.collect()
    return loss


def test_stock_pytorch_raises_for_an_edited_and_dropped_saved_tensor():
    w = torch.randn(64, requires_grad=True)
    y = torch.randn(64).exp()
    loss = (y * w).sum()
    y.add_(1)
    del y
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_finding1_edit_after_a_write_the_prefetcher_waited_for_raises(offloaders):
    """The forward ends with the write in flight, so the prefetcher asks for the entry during
    it; the write completes, then the user edits and drops the tensor."""
    off = offloaders(checksum="off", coalesce_bytes=0)
    off.backend._pwrite, ev = gate(os.pwrite)
    w = torch.randn(MiB // 4, requires_grad=True)
    x = torch.randn(MiB // 4)
    with off.step():
        y = x.exp()
        loss = (y * w).sum()
    ev.set()
    off.synchronize()
    y.add_(1)
    del y
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize(
    "timing,kw,numel",
    [
        ("written then dropped", {"checksum": "off", "coalesce_bytes": 0}, MiB // 4),
        ("checksum staging", {"checksum": "crc32", "coalesce_bytes": 0}, MiB // 4),
        ("small coalesced", {"checksum": "off"}, 16384),
    ],
)
def test_finding2_edit_of_a_dropped_tensor_raises_like_stock(offloaders, timing, kw, numel):
    off = offloaders(**kw)
    loss = inplace_case(off, numel, settle_in_forward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_finding3_checksums_are_on_by_default_and_catch_a_flipped_byte(offloaders):
    assert tba.Config(environ={}).checksum != "off"
    off = offloaders(coalesce_bytes=0)  # the default checksum
    w = torch.randn(MiB // 4, requires_grad=True)
    with off.step():
        loss = (torch.randn(MiB // 4).exp() * w).sum()
        off.synchronize()
        assert flip_spill_bytes(off.backend.spill_path, 2 * MiB) >= 1
    with pytest.raises(tba.StorageError, match="[Cc]hecksum"):
        loss.backward()


def test_finding4_a_removed_spill_dir_is_named_as_such(offloaders, caplog):
    off = offloaders()
    shutil.rmtree(off.backend.spill_path)
    w = torch.randn(MiB // 4, requires_grad=True)
    x = torch.randn(MiB // 4)
    with caplog.at_level(logging.WARNING, logger="tba"), off.step():
        loss = (x.exp() * w).sum()
    loss.backward()
    assert torch.equal(w.grad, x.exp())
    reasons = off.stats()["kept_reasons"]
    assert "disk_full" not in reasons and reasons.get("spill_dir_gone", 0) >= 1, reasons
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "ENOENT" in text and "TBA_SPILL_DIR" in text, text


def test_finding5_staging_beyond_memory_is_a_config_error_at_start(spill_dir):
    with pytest.raises(tba.ConfigError, match=r"staging_bytes.*1\.0 TiB.*(available|memory)"):
        make(spill_dir, staging_bytes="1TiB")


def test_finding7_a_refused_batch_is_counted_kept_not_offloaded(offloaders):
    off = offloaders(coalesce_bytes="1MiB", max_disk_bytes="1MiB")
    ws = [torch.randn(MiB // 16, requires_grad=True) for _ in range(8)]
    xs = [torch.randn(MiB // 16) for _ in range(8)]
    with off.step():
        loss = sum((x.exp() * w).sum() for x, w in zip(xs, ws))  # 8 x 256 KiB: one 2 MiB batch
        off.synchronize()
    loss.backward()
    assert all(torch.equal(w.grad, x.exp()) for w, x in zip(ws, xs))
    st = off.stats()
    assert st["bytes_offloaded"] <= off.backend.usage()["bytes_written"], st
    ends = st["tensors_offloaded"] + st["tensors_kept"] + st["dedup_hits"]
    assert ends + st["recomputed_tensors"] == st["packs"], st
    assert st["kept_reasons"].get("quota", 0) >= 8, st["kept_reasons"]


def test_every_saved_tensor_is_counted_once_and_written_bytes_cover_offloaded(offloaders):
    """On a real model, once writes settle: offloaded + kept + deduplicated (+ recomputed, none
    in fp32) = saved tensors, and the bytes written are at least the bytes offloaded."""
    from tba.testing import GPT, GPTConfig, random_batch

    cfg = GPTConfig(vocab=64, seq=64, hidden=64, heads=4, layers=4)
    model = GPT(cfg)
    for kw in ({}, {"coalesce_bytes": 0}, {"min_offload_bytes": "16KiB", "keep_last": 1}):
        off = offloaders(**kw)
        for step in range(2):
            x, y = random_batch(cfg, 4, seed=step)
            with off.step(model):
                loss = model(x, y)
            loss.backward()
            off.synchronize()
            st = off.stats()
            ends = st["tensors_offloaded"] + st["tensors_kept"] + st["dedup_hits"]
            assert ends + st["recomputed_tensors"] == st["packs"]
            assert off.backend.usage()["bytes_written"] >= st["bytes_offloaded"] > 0
        off.close()


def test_a_write_error_keeps_the_tensor_and_names_the_cause(offloaders):
    off = offloaders(coalesce_bytes=0)
    real = os.pwrite

    def fail(*a):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    off.backend._pwrite = fail
    w = torch.randn(MiB // 4, requires_grad=True)
    x = torch.randn(MiB // 4)
    with off.step():
        loss = (x.exp() * w).sum()
        off.synchronize()
    off.backend._pwrite = real
    loss.backward()
    assert torch.equal(w.grad, x.exp())
    st = off.stats()
    assert st["tensors_offloaded"] == 0 and st["kept_reasons"] == {"io_error": 1}, st
