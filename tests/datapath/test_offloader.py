"""Offloader behaviour: faults, bounds, prefetch, stats, lifecycle and crash cleanup."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.nn as nn

import tba
from tba.testing import GPT, GPTConfig, random_batch

from ..conftest import step_ctx

CFG = GPTConfig(vocab=64, seq=64, hidden=64, heads=4, layers=4)


def grads_of(model, off=None, seed=0, settle=True):
    for p in model.parameters():
        p.grad = None
    x, y = random_batch(CFG, 4, seed=seed)
    if off is None:
        loss = model(x, y)
    else:
        with off.step(model):
            loss = model(x, y)
            if settle:
                off.synchronize()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def assert_same(a, b):
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPT(CFG)


def failing(real, err, after=0):
    """Wrap a syscall so that calls after the first ``after`` raise OSError(err)."""
    calls = {"n": 0}

    def call(*args):
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(err, os.strerror(err))
        return real(*args)

    return call


def test_stats_has_every_pinned_key(make_offloader, model):
    off = make_offloader()
    grads_of(model, off)
    st = off.stats()
    assert set(tba.PINNED_KEYS) <= set(st)
    assert st["saved_bytes"] > 0 and st["bytes_offloaded"] > 0
    # everything comes back from disk but the targets (4 x 64 int64), alive in grads_of while
    # backward runs: those are served by the tensor itself, never read (NOTE [Forwarding])
    assert st["bytes_reloaded"] == st["bytes_offloaded"] - 4 * 64 * 8
    assert st["forwarded"] == 1
    assert st["peak_resident_bytes"] > 0
    assert st["disk_bytes_in_use"] == 0


def test_injected_enospc_on_write_falls_back_to_memory(make_offloader, model):
    want = grads_of(model)
    off = make_offloader(backend="posix")
    off.backend._pwrite = failing(os.pwrite, errno.ENOSPC)
    assert_same(grads_of(model, off), want)
    st = off.stats()
    assert st["io_errors"] >= 1
    assert st["kept_reasons"].get("disk_full", 0) + st["io_errors"] >= 2
    assert st["disk_bytes_in_use"] == 0


def test_injected_enospc_on_slab_growth_keeps_in_memory(make_offloader, model):
    want = grads_of(model)
    off = make_offloader(backend="posix", slab_bytes="1MiB")
    off.backend._fallocate = failing(os.posix_fallocate, errno.ENOSPC, after=1)
    assert_same(grads_of(model, off), want)
    st = off.stats()
    assert st["kept_reasons"].get("disk_full", 0) > 0 and st["tensors_offloaded"] > 0


def test_quota_keeps_in_memory(make_offloader, model):
    want = grads_of(model)
    off = make_offloader(max_disk_bytes="1MiB", slab_bytes="1MiB")
    assert_same(grads_of(model, off), want)
    st = off.stats()
    assert st["kept_reasons"].get("quota", 0) > 0  # TBA_MAX_DISK_BYTES, named as such
    assert st["peak_disk_bytes"] <= 1 << 20


def test_injected_eio_on_read_raises_storage_error(make_offloader, model):
    off = make_offloader(backend="posix", prefetch_bytes="1MiB")
    x, y = random_batch(CFG, 4)
    with off.step(model):
        loss = model(x, y)
        off.synchronize()
        off.backend._preadv = failing(os.preadv, errno.EIO)
    with pytest.raises(tba.StorageError, match=r"read of \d+ bytes at offset \d+ in .+: EIO") as ei:
        loss.backward()
    assert ei.value.errno == errno.EIO and isinstance(ei.value, OSError)


def test_short_writes_and_reads_are_completed(make_offloader, model):
    want = grads_of(model)
    off = make_offloader(backend="posix")

    def short_write(fd, buf, offset):
        return os.pwrite(fd, buf[: max(4096, len(buf) // 2 // 4096 * 4096)], offset)

    def short_read(fd, bufs, offset):
        (buf,) = bufs
        return os.preadv(fd, [buf[: max(4096, len(buf) // 2 // 4096 * 4096)]], offset)

    off.backend._pwrite = short_write
    off.backend._preadv = short_read
    assert_same(grads_of(model, off), want)
    assert off.stats()["bytes_reloaded"] > 0


def gate(real):
    """A syscall that blocks until the returned event is set: tiny compute, slow I/O."""
    ev = threading.Event()

    def call(*args):
        ev.wait(30)
        return real(*args)

    return call, ev


def test_unpack_while_writes_in_flight_uses_staging(make_offloader, model):
    want = grads_of(model)
    off = make_offloader(backend="posix")
    off.backend._pwrite, ev = gate(os.pwrite)
    x, y = random_batch(CFG, 4)
    model.zero_grad(set_to_none=True)
    with off.step(model):
        loss = model(x, y)
    loss.backward()  # every write is still blocked: bytes must come from staging
    got = [p.grad.clone() for p in model.parameters()]
    st = off.stats()
    ev.set()
    off.synchronize()
    assert torch.equal(loss.detach(), want[0]) and all(map(torch.equal, got, want[1]))
    assert st["forwarded"] > 0 and st["bytes_reloaded"] == 0
    assert off.stats()["disk_bytes_in_use"] == 0


def test_a_failed_read_of_a_dropped_graph_frees_its_extent(make_offloader, model):
    """The graph dies while its prefetch reads are in flight, then the reads fail: the extents
    go back (the entries are dead, not FAILED) and the error is still counted."""
    off = make_offloader(backend="posix", prefetch_bytes="64MiB")
    x, y = random_batch(CFG, 4)
    with off.step(model):
        loss = model(x, y)
        off.synchronize()  # every write done: the reads armed at the end of forward go to disk
        failing_read, ev = gate(failing(os.preadv, errno.EIO))
        off.backend._preadv = failing_read
    assert off.stats()["disk_bytes_in_use"] > 0
    del loss  # no backward: every handle dies with its reads still blocked
    ev.set()
    off.synchronize()
    st = off.stats()
    assert st["io_errors"] > 0
    assert st["disk_bytes_in_use"] == 0


def test_slow_reads_stall_but_stay_exact(make_offloader, model):
    """Reads held until backward waits for one: it stalls (measured), and the gradients are
    exact. The gate opens on that wait, not on a timer, so it holds on a loaded machine."""
    want = grads_of(model)
    off = make_offloader(backend="posix")
    real, opened = os.preadv, threading.Event()

    def slow(*args):
        opened.wait(30)
        return real(*args)

    off.backend._preadv = slow
    real_wait = off.io.wait

    def waiting(futures, what):  # unpack waits for a read: now let the reads through
        opened.set()
        return real_wait(futures, what)

    off.io.wait = waiting
    for p in model.parameters():
        p.grad = None
    x, y = random_batch(CFG, 4)
    with off.step(model):
        loss = model(x, y)
    loss.backward()
    assert opened.is_set()
    assert_same((loss.detach(), [p.grad.clone() for p in model.parameters()]), want)
    assert off.stats()["stall_seconds"] > 0


def test_staging_bound_holds_and_keeps_the_rest(make_offloader, model):
    want = grads_of(model)
    off = make_offloader(backend="posix", staging_bytes="1MiB")
    off.backend._pwrite, ev = gate(os.pwrite)
    x, y = random_batch(CFG, 4)
    model.zero_grad(set_to_none=True)
    with off.step(model):
        loss = model(x, y)
        ((_, pool),) = off.io.adapters.values()
        assert pool.in_use <= pool.capacity == 1 << 20
        ev.set()
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    assert torch.equal(loss.detach(), want[0]) and all(map(torch.equal, got, want[1]))
    assert off.stats()["kept_reasons"].get("staging_full", 0) > 0


def test_prefetch_budget_is_respected(make_offloader, model):
    want = grads_of(model)
    budget = 1 << 20
    off = make_offloader(prefetch_bytes=budget, keep_last=1)
    before = []
    real_start = off.reader.start_read

    def spy(e):
        before.append((off.prefetcher.inflight - e.budgeted, e.padded))
        real_start(e)

    off.prefetcher.start = spy
    assert_same(grads_of(model, off), want)
    assert len(before) > 3
    # Each read starts only if it fits the budget, or if nothing else is in flight.
    assert all(b == 0 or b + n <= budget for b, n in before)
    assert off.stats()["bytes_offloaded"] > 2 * budget  # so the budget really bound


def test_no_sync_loads_after_step_one(make_offloader, model):
    off = make_offloader(prefetch_bytes="2MiB", keep_last=1)
    for step in range(3):
        grads_of(model, off, seed=step, settle=False)
        off.synchronize()  # the step's last writes are counted once they land
        st = off.stats()
        assert st["bytes_offloaded"] > 0
        if step >= 1:
            assert st["sync_loads"] == 0, st
    assert st["kept_groups"] == 1 and st["kept_reasons"].get("group", 0) > 0


def test_keep_last_zero_keeps_no_group(make_offloader, model):
    off = make_offloader(keep_last=0)
    grads_of(model, off)
    assert off.stats()["kept_reasons"].get("group", 0) == 0


def test_steps_do_not_nest(make_offloader):
    off = make_offloader()
    with off.step(), pytest.raises(tba.UsageError, match="steps do not nest"), off.step():
        pass


def test_closed_offloader_refuses_steps(make_offloader):
    off = make_offloader()
    off.close()
    with pytest.raises(tba.UsageError, match="closed Offloader"), off.step():
        pass


def test_close_with_live_graph_keeps_data(make_offloader, model):
    want = grads_of(model)
    off = make_offloader()
    x, y = random_batch(CFG, 4)
    model.zero_grad(set_to_none=True)
    with off.step(model):
        loss = model(x, y)
        off.synchronize()
    off.close()
    loss.backward(retain_graph=True)  # twice: the second use must not touch the closed files
    got = [p.grad.clone() for p in model.parameters()]
    assert all(map(torch.equal, got, want[1]))
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want[1]))


def test_disabled_is_a_no_op(spill_dir, model, monkeypatch):
    off = tba.Offloader(tba.Config(enabled=False, spill_dir=spill_dir, environ={}))
    want = grads_of(model)
    assert_same(grads_of(model, off), want)
    assert off.stats()["tensors_offloaded"] == 0
    assert not os.path.exists(spill_dir)
    monkeypatch.setenv("TBA_ENABLED", "0")
    monkeypatch.setenv("TBA_SPILL_DIR", spill_dir)
    with tba.offload(model):
        loss = model(*random_batch(CFG, 2))
    loss.backward()
    assert not os.path.exists(spill_dir)


def test_process_wide_offload_from_env(spill_dir, model, monkeypatch):
    monkeypatch.setenv("TBA_SPILL_DIR", spill_dir)
    monkeypatch.setenv("TBA_MIN_OFFLOAD_BYTES", "4KiB")
    monkeypatch.setenv("TBA_MIN_FREE_BYTES", "0")
    want = grads_of(model)
    for p in model.parameters():
        p.grad = None
    with tba.offload(model):
        loss = model(*random_batch(CFG, 4))
    loss.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want[1]))
    off = tba.default_offloader()
    assert off.stats()["tensors_offloaded"] > 0
    off.close()


def test_backend_choice_logged_once(make_offloader, caplog):
    import tba.storage as storage

    storage._logged.clear()
    with caplog.at_level(logging.INFO, logger="tba"):
        make_offloader()
        make_offloader()
    lines = [r.getMessage() for r in caplog.records if "using the" in r.getMessage()]
    assert len(lines) == 1 and "backend" in lines[0]


def test_ranks_get_separate_spill_dirs(make_offloader, spill_dir):
    a = make_offloader(rank=0)
    b = make_offloader(rank=1)
    dirs = sorted(os.listdir(spill_dir))
    assert len(dirs) == 2 and dirs[0].endswith("rank0") and dirs[1].endswith("rank1")
    assert a.backend.spill_path != b.backend.spill_path


def test_module_without_blocks_uses_children(make_offloader):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    x = torch.randn(8, 32)
    model(x).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    off = make_offloader(keep_last=1)
    with off.step(model):
        loss = model(x).sum()
    loss.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want))


KILLED = textwrap.dedent(
    """
    import sys, time, torch, tba
    off = tba.Offloader(tba.Config(spill_dir=sys.argv[1], min_offload_bytes=1,
                                   min_free_bytes=0, slab_bytes="64MiB", environ={}))
    xs = [torch.randn(1 << 20, requires_grad=True) for _ in range(16)]
    with off.step():
        loss = sum((x.exp() * x).sum() for x in xs)
        off.synchronize()
        print("READY", off.stats()["disk_bytes_in_use"], flush=True)
        time.sleep(60)
    """
)


def _spill_bytes_held(pid: int, spill_dir: str) -> int:
    """Bytes allocated to the files ``pid`` holds open under ``spill_dir`` (named or not)."""
    held, root = 0, os.path.realpath(spill_dir)
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
            if target.startswith(root + "/"):
                held += os.stat(os.path.join(fd_dir, fd)).st_blocks * 512
        except FileNotFoundError:
            continue
    return held


@pytest.mark.integration
def test_sigkill_leaves_no_bytes(spill_dir, tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, str(script), spill_dir], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY")
        usage = 0
        for root, _, files in os.walk(spill_dir):
            usage += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
        assert usage == 0  # nameless files: nothing to see even while running
        held = _spill_bytes_held(proc.pid, spill_dir)  # the nameless slabs, through /proc
        assert held >= 16 << 20
        os.sync()
        before = os.statvfs(spill_dir)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    leftovers = [os.path.join(r, f) for r, _, fs in os.walk(spill_dir) for f in fs]
    assert leftovers == []
    # The kernel reclaims the nameless slabs with the process. ext4 returns freed blocks to
    # the free count when the journal commits, hence the sync and the wait. Other writers on
    # the same filesystem could mask it; CI runs the tests one at a time.
    deadline, freed = time.monotonic() + 15, 0
    while time.monotonic() < deadline:
        os.sync()
        after = os.statvfs(spill_dir)
        freed = (after.f_bfree - before.f_bfree) * after.f_frsize
        if freed >= held // 2:
            break
        time.sleep(0.2)
    assert freed >= held // 2, f"{held} B held by the killed process, {freed} B came back"
    # A new Offloader sweeps the dead process's empty directory.
    off = tba.Offloader(tba.Config(spill_dir=spill_dir, min_free_bytes=0, environ={}))
    assert os.listdir(spill_dir) == [os.path.basename(off.backend.spill_path)]
    off.close()
    assert os.listdir(spill_dir) == []


def test_concurrent_graphs_keep_their_own_step_stats(make_offloader, model):
    """Two forwards before one backward: each step's numbers stay its own."""
    off = make_offloader()
    x, y = random_batch(CFG, 4)
    with off.step(model):
        first = model(x, y)
        off.synchronize()
    st1 = off._last
    with off.step(model):
        second = model(x[:2], y[:2])
        off.synchronize()
    st2 = off._last
    (first + second).backward()
    off.synchronize()
    assert st1 is not st2 and st1.bytes_offloaded > st2.bytes_offloaded > 0
    # y itself is alive: served without a read (NOTE [Forwarding]); its slice y[:2] is not
    assert st1.bytes_reloaded == st1.bytes_offloaded - y.nbytes
    assert st2.bytes_reloaded == st2.bytes_offloaded
    assert off.stats()["step"] == 2 and off.stats()["bytes_offloaded"] == st2.bytes_offloaded


def test_tensors_alive_at_backward_are_never_read_back(make_offloader):
    """NOTE [Forwarding]: saved tensors the caller still holds at backward are served by
    themselves and never read; those it let go are read back; the bytes read say so."""
    xs = [torch.randn(1 << 18) for _ in range(4)]  # 1 MiB each: not coalesced

    def run(off):
        w = torch.ones(1 << 18, requires_grad=True)
        with step_ctx(off):
            loss = sum((x.exp() * w).sum() for x in xs[:3])  # saves exp(x): gone after forward
            held = [x.sin() for x in xs]
            loss = loss + sum((h * w).sum() for h in held)  # saves each sin(x), held below
            if off is not None:
                off.synchronize()
        del held[3]
        loss.backward()
        return w.grad

    want = run(None)
    off = make_offloader()
    reads = []
    real = off.io.read
    off.io.read = lambda extent, device, e: reads.append(e.nbytes) or real(extent, device, e)
    assert torch.equal(run(off), want)
    off.synchronize()
    st = off.stats()
    assert st["tensors_offloaded"] == 7 and st["forwarded"] == 3 and st["sync_loads"] == 0
    assert len(reads) == 4 and st["bytes_reloaded"] == sum(reads) == 4 * (1 << 20)
