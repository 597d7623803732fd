"""Issue 15's findings, one test each, through the public API only (so that each also runs,
and fails, on the code before the fix): in-place edits in every timing, corruption on disk,
refusals that name their cause, resource settings checked at start, and counters that say
what reached the disk."""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import shutil
import threading

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

import tba

from ..faults.util import flip_spill_bytes

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


def inplace_case(off, numel, settle_in_forward, strided=False):
    """``loss`` saves ``y = exp(x)``; ``y`` is edited in place and dropped before backward.
    ``strided``: ``y`` is instead a non-dense view spanning a quarter of an 8x larger storage,
    which tba captures through a staging copy (neither whole nor dense: tba/records/handle.py
    ``layout``), never from the source's own memory."""
    w = torch.randn(numel, requires_grad=True)
    x = torch.randn(8 * numel if strided else numel)
    with off.step():
        y = x.exp()
        if strided:  # the first n/8 rows of (n/2, 16), every other column: n elements
            y = y.view(-1, 16)[: numel // 8, ::2]
            w = w.view(-1, 8)
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
    "timing,kw,numel,strided",
    [
        ("written then dropped", {"checksum": "off", "coalesce_bytes": 0}, MiB // 4, False),
        # checksums keep direct capture (the digest covers the source's own bytes)
        ("checksummed direct capture", {"checksum": "crc32", "coalesce_bytes": 0}, MiB // 4, False),
        # a non-dense view cannot be written from its own memory: copied into staging first
        ("staging copy", {"checksum": "crc32", "coalesce_bytes": 0}, MiB // 4, True),
        ("small coalesced", {"checksum": "off"}, 16384, False),
    ],
)
def test_finding2_edit_of_a_dropped_tensor_raises_like_stock(
    offloaders, timing, kw, numel, strided
):
    off = offloaders(**kw)
    loss = inplace_case(off, numel, settle_in_forward=True, strided=strided)
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


def scrape(path):
    """The Prometheus samples in the multiprocess files of ``path``, as the sidecar reads them."""
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=path)
    return [(s.name, dict(s.labels), s.value) for fam in reg.collect() for s in fam.samples]


def metric(samples, name, **labels):
    return sum(v for n, lab, v in samples if n == name and labels.items() <= lab.items())


def test_finding7_a_refused_batch_is_kept_in_metrics_and_group_records(offloaders, tmp_path):
    """One tensor written, then a coalesced batch the quota refuses: the batch's members are
    kept (quota) in stats(), in the Prometheus counters and in the group record that feeds
    adaptive keep and the trace; the bytes written to the device cover the bytes offloaded."""
    mdir, trace = str(tmp_path / "metrics"), str(tmp_path / "trace.jsonl")
    off = offloaders(
        coalesce_bytes="1MiB", max_disk_bytes="1536KiB", metrics_dir=mdir, rank=7, trace=trace
    )
    w1, x1 = torch.randn(MiB // 4, requires_grad=True), torch.randn(MiB // 4)
    ws = [torch.randn(MiB // 32, requires_grad=True) for _ in range(8)]
    xs = [torch.randn(MiB // 32) for _ in range(8)]
    with off.step():
        loss = (x1.exp() * w1).sum()  # 1 MiB alone: written, within the quota
        off.synchronize()
        # 8 x 128 KiB: one 1 MiB batch, which no longer fits in the 1.5 MiB quota
        loss = loss + sum((x.exp() * w).sum() for x, w in zip(xs, ws))
        off.synchronize()
    loss.backward()
    assert torch.equal(w1.grad, x1.exp())
    assert all(torch.equal(w.grad, x.exp()) for w, x in zip(ws, xs))
    st = off.stats()
    written = off.backend.usage()["bytes_written"]
    assert (st["tensors_offloaded"], st["bytes_offloaded"]) == (1, MiB), st
    assert st["kept_reasons"] == {"quota": 8}, st["kept_reasons"]
    assert written >= st["bytes_offloaded"]
    off.close()  # writes the step's trace records

    samples = scrape(mdir)
    assert metric(samples, "tba_tensors_offloaded_total", rank="7") == 1
    assert metric(samples, "tba_bytes_offloaded_total", rank="7") == MiB
    assert metric(samples, "tba_tensors_kept_total", rank="7", reason="quota") == 8
    assert metric(samples, "tba_tensors_kept_total", rank="7") == 8
    device_written = metric(samples, "tba_device_bytes_written_total", rank="7")
    assert device_written == written >= MiB

    with open(trace, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    groups = [r for r in records if r["type"] == "group"]
    assert sum(g["offloaded_bytes"] for g in groups) == MiB, groups
    assert sum(g["kept_bytes"] for g in groups) == 8 * (MiB // 8), groups  # the batch
    assert all(g["offloaded_bytes"] + g["kept_bytes"] == g["packed_bytes"] for g in groups)
    assert [r["bytes_offloaded"] for r in records if r["type"] == "step"] == [MiB]


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
