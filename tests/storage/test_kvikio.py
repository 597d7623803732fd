"""The kvikio backend against a fake kvikio (tests/storage/fake_kvikio.py) on real slab files.

The fake's CuFile really opens ``/proc/self/fd/<fd>`` and really reads and writes, on threads
started at submit and split into tasks as kvikio 26.10 does, so these tests check the bytes, the
files kvikio is handed, the settings, and the failure paths. tests/storage/test_kvikio_real.py
runs the backend against the real library's host path and checks that the fake answers as the
real one does. What neither shows is cuFile and a GPU: the ``gpu``-marked test at the end does
that where one is present.
"""

from __future__ import annotations

import errno
import gc
import importlib.abc
import os
import random
import sys
import types
import zlib
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from fake_kvikio import FakeDeviceBuffer, FakeKvikio, host_copy_of_fake_device, posix_error
from storage_util import empty, filled

import tba.storage._kvikio_buffers as kv_buffers
import tba.storage.kvikio as kv_mod
from tba.errors import StorageError
from tba.storage import Backend
from tba.storage.kvikio import KvikioBackend, KvikioUnavailable, kvikio_status
from tba.storage.posix import PosixBackend

NO_DRIVER = RuntimeError(
    "cuda_driver: Cannot load shared library libcuda.so.1: libcuda.so.1: cannot open shared "
    "object file: No such file or directory"
)
STATUS_KEYS = {"importable", "version", "gds_available", "compat_mode", "reason"}


@pytest.fixture
def fake_cuda(monkeypatch):
    """A "CUDA device" for the probe: fake device buffers, copied to the host with ctypes."""
    made = []

    def pair(nbytes):
        src, dst = FakeDeviceBuffer(nbytes), FakeDeviceBuffer(nbytes, fill=0xA5)
        made.append((src, dst))
        return src, dst

    monkeypatch.setattr(kv_mod, "_cuda_probe_pair", pair)
    monkeypatch.setattr(kv_buffers, "_device_to_host", host_copy_of_fake_device)
    return made


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(kv_mod, "_cuda_probe_pair", lambda nbytes: None)


@pytest.fixture
def open_kv(make_cfg, no_cuda):
    """Open KvikioBackends on a fake; all are closed at teardown."""
    made = []

    def make(fake=None, **cfg):
        fake = FakeKvikio() if fake is None else fake
        b = KvikioBackend(make_cfg(**cfg), kvikio_module=fake)
        made.append(b)
        return b, fake

    yield make
    for b in made:
        b.close()


def no_kvikio(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvikio", None)  # "import kvikio" raises ModuleNotFoundError


# -- kvikio_status: what doctor and backend selection see -------------------------------------
def test_status_when_not_installed(monkeypatch):
    no_kvikio(monkeypatch)
    st = kvikio_status()
    assert set(st) == STATUS_KEYS
    assert st["importable"] is False and st["version"] is None
    assert st["reason"] == "kvikio is not installed (pip install 'tba[gds]')"


def test_status_when_import_breaks(monkeypatch):
    class Broken(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "kvikio":
                raise OSError("libkvikio.so: cannot open shared object file")
            return None

    monkeypatch.delitem(sys.modules, "kvikio", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    st = kvikio_status()
    assert st["importable"] is False
    assert "failed to import (OSError: libkvikio.so: cannot open" in st["reason"]
    assert "pip install 'tba[gds]'" in st["reason"]


@pytest.mark.parametrize("api", ["new", "old"])
def test_status_reports_gds_and_compat_mode(api):
    st = kvikio_status(FakeKvikio(gds=True, api=api, version="25.06.00"))
    assert st == {
        "importable": True,
        "version": "25.06.00",
        "gds_available": True,
        "compat_mode": "AUTO" if api == "new" else "OFF",  # 24.x only says on/off
        "reason": st["reason"],
    }
    assert st["reason"].startswith("kvikio 25.06.00 imported; GDS driver available")

    st = kvikio_status(FakeKvikio(gds=False, api=api, version="25.06.00"))
    assert st["gds_available"] is False
    assert st["reason"] == (
        "kvikio 25.06.00 imported; GDS driver not available, kvikio would run in compat mode "
        "(POSIX)"
    )


def test_status_with_compat_forced_on_or_driver_unknown():
    st = kvikio_status(FakeKvikio(gds=True, compat="ON"))
    assert st["compat_mode"] == "ON" and "forced ON" in st["reason"]
    st = kvikio_status(FakeKvikio(gds=None))
    assert st["gds_available"] is None
    why = "GDS driver state unknown (querying the cuFile driver failed: RuntimeError"
    assert why in st["reason"]


def test_status_does_no_io():
    fake = FakeKvikio(gds=True)
    kvikio_status(fake)
    assert fake.calls == [] and fake.requests == [] and fake.settings_calls == []


class _Hostile(types.ModuleType):
    """Every attribute access raises."""

    def __getattribute__(self, name):
        if name in ("__class__", "__dict__", "__name__"):
            return object.__getattribute__(self, name)
        raise RuntimeError(f"kvikio.{name} exploded")


class _BadStr:
    def __str__(self):
        raise ValueError("no")


def _odd_modules():
    yield _Hostile("kvikio")
    m = FakeKvikio(gds=True)
    m.__version__ = _BadStr()
    m.defaults = types.SimpleNamespace(
        get=lambda name: (_ for _ in ()).throw(SystemError("get")),
        is_compat_mode_preferred=lambda: (_ for _ in ()).throw(KeyError("x")),
    )
    m.cufile_driver = types.SimpleNamespace(get=lambda name: _BadStr().__str__())
    yield m
    m = FakeKvikio()
    m.defaults = types.SimpleNamespace(get=lambda name: object(), set=None)
    del m.cufile_driver
    yield m


@pytest.mark.parametrize("mod", list(_odd_modules()), ids=["hostile", "raising", "odd"])
def test_status_never_raises(mod):
    st = kvikio_status(mod)
    assert set(st) == STATUS_KEYS
    assert isinstance(st["reason"], str) and st["reason"]
    assert st["version"] is None or isinstance(st["version"], str)
    assert st["gds_available"] in (True, False, None)
    assert st["compat_mode"] in ("ON", "OFF", "AUTO", None)


def test_status_never_raises_on_a_weird_import_error(monkeypatch):
    class Weird(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "kvikio":
                raise ValueError("\n")  # an error with an empty message
            return None

    monkeypatch.delitem(sys.modules, "kvikio", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Weird(), *sys.meta_path])
    st = kvikio_status()
    assert st["importable"] is False and "(ValueError)" in st["reason"]


# -- selection: import and probe --------------------------------------------------------------
def test_backend_without_kvikio_says_how_to_install(make_cfg, monkeypatch):
    no_kvikio(monkeypatch)
    with pytest.raises(KvikioUnavailable) as info:
        KvikioBackend(make_cfg())
    assert str(info.value) == "tba.storage: kvikio is not installed (pip install 'tba[gds]')."
    assert isinstance(info.value, OSError)
    assert not os.path.exists(make_cfg().spill_dir)  # nothing was created


@pytest.mark.parametrize("where", ["call", "get"])
def test_probe_fails_when_every_transfer_raises(make_cfg, no_cuda, where):
    fake = FakeKvikio(gds=False)
    setattr(fake, f"raise_at_{where}", NO_DRIVER)
    with pytest.raises(KvikioUnavailable) as info:
        KvikioBackend(make_cfg(), kvikio_module=fake)
    msg = str(info.value)
    assert msg.startswith("tba.storage: kvikio 26.10.00 imported, but its probe through CuFile ")
    assert "probe write of 4096 bytes at offset 0 in " in msg and "/probe (unlinked)" in msg
    assert "EIO (Input/output error)" in msg  # kvikio gave no errno
    assert "libcuda.so.1: cannot open shared object file" in msg
    assert "TBA_BACKEND=posix" in msg
    assert isinstance(info.value.__cause__, StorageError)
    assert os.listdir(make_cfg().spill_dir) == []  # the spill directory is gone
    assert all(f.closed for f in fake.files)


def test_probe_fails_when_cufile_cannot_open(make_cfg, no_cuda):
    fake = FakeKvikio()
    fake.open_error = RuntimeError("cuFile error: CU_FILE_DRIVER_NOT_INITIALIZED")
    with pytest.raises(KvikioUnavailable, match=r"kvikio\.CuFile could not open the slab"):
        KvikioBackend(make_cfg(), kvikio_module=fake)
    paths = [c[1] for c in fake.calls]
    assert paths[0].startswith("/proc/self/fd/") and paths[1].startswith("/dev/fd/")


def test_probe_fails_when_bytes_come_back_different(make_cfg, no_cuda):
    fake = FakeKvikio()
    fake.corrupt_reads = True
    with pytest.raises(
        KvikioUnavailable,
        match=r"probe read of 4096 bytes at offset 0 in .* failed: EIO .* kvikio read back "
        r"different bytes than it wrote \(a host buffer\)",
    ) as info:
        KvikioBackend(make_cfg(), kvikio_module=fake)
    assert "NVIDIA driver" not in str(info.value)  # a wrong answer is not a missing driver


def test_probe_fails_when_device_bytes_come_back_different(make_cfg, fake_cuda):
    fake = FakeKvikio(gds=True)
    fake.corrupt_reads = lambda offset: offset == 4096  # the device pair's page only
    with pytest.raises(KvikioUnavailable, match=r"different bytes than it wrote \(a device"):
        KvikioBackend(make_cfg(), kvikio_module=fake)


def test_probe_is_a_real_round_trip_through_the_slab_link(open_kv):
    b, fake = open_kv()
    probe = fake.files[0]
    assert probe.path.startswith("/proc/self/fd/") and probe.flags == "r+"
    assert probe.closed  # the probe file is closed with its CuFile
    ops = [(r[0], r[2], r[3], r[4]) for r in fake.requests]
    assert ops == [("pwrite", 0, 4096, 8 << 20), ("pread", 0, 4096, 8 << 20)]


def test_gds_available_with_a_device_goes_direct(open_kv, fake_cuda):
    b, fake = open_kv(FakeKvikio(gds=True))
    assert b.device_direct is True and b.gds_available is True and b.compat_mode == "AUTO"
    assert "device-buffer probe passed; GDS: device buffers go straight" in b.reason
    assert len(fake_cuda) == 1
    src, dst = fake_cuda[0]
    assert np.array_equal(src.host, dst.host)  # the device pair really round-tripped
    assert [r[:3:2] for r in fake.requests[2:]] == [("pwrite", 4096), ("pread", 4096)]


@pytest.mark.parametrize(
    ("kw", "direct", "mode"),
    [
        ({"gds": False}, False, "AUTO"),
        ({"gds": True, "compat": "ON"}, False, "ON"),
        ({"gds": True, "preferred": True}, False, "AUTO"),
        ({"gds": True, "api": "old"}, True, "OFF"),  # 24.x reports compat mode as a bool
        ({"gds": False, "api": "old"}, False, "OFF"),
    ],
    ids=["no-driver", "compat-on", "compat-preferred", "old-api-gds", "old-api-no-driver"],
)
def test_gds_versus_compat_mode(open_kv, fake_cuda, kw, direct, mode):
    b, _ = open_kv(FakeKvikio(**kw))
    assert b.device_direct is direct and b.compat_mode == mode
    assert "device-buffer probe passed; " in b.reason
    if direct:
        assert "; GDS: device buffers go straight between GPU memory and the drive" in b.reason
    else:
        assert "; compat mode (POSIX): stage through pinned host memory" in b.reason


def test_gds_without_a_cuda_device_is_not_direct(open_kv):
    b, _ = open_kv(FakeKvikio(gds=True))
    assert b.device_direct is False
    assert "device-buffer probe skipped (no CUDA device)" in b.reason
    assert "GDS driver available, but device_direct is off" in b.reason


def test_failing_device_probe_keeps_the_host_path(make_cfg, fake_cuda):
    fake = FakeKvikio(gds=True)
    fake.raise_at_get = RuntimeError("cuFile error: CU_FILE_INVALID_VALUE")
    fake.fail_when = lambda op, offset, size: offset == 4096  # the device pair's page
    with KvikioBackend(make_cfg(), kvikio_module=fake) as b:
        assert b.device_direct is False
        assert "device-buffer probe failed (probe write of 16384 bytes at offset 4096" in b.reason


# -- settings ---------------------------------------------------------------------------------
def test_threads_and_task_size_set_with_the_new_api(open_kv):
    b, fake = open_kv(io_threads=6, gds_task_bytes="2MiB")
    assert fake.settings_calls == [
        ("set", {"num_threads": 6, "task_size": 2 << 20}),
        ("set", {"auto_direct_io_read": True, "auto_direct_io_write": True}),
    ]
    assert b.threads == 6 and b.task_bytes == 2 << 20
    assert "6 kvikio threads, 2048 KiB tasks" in b.reason
    ext = b.allocate(1 << 20)
    b.write(ext, filled(ext.length)).result()
    assert fake.requests[-1][4] == 2 << 20  # every call carries the task size too


def test_threads_and_task_size_set_with_the_old_api(open_kv):
    b, fake = open_kv(FakeKvikio(api="old"), io_threads=3, gds_task_bytes="1MiB")
    # never the bare set_num_threads(): on 24.x it is a context manager and would do nothing
    assert fake.settings_calls == [("num_threads_reset", 3), ("task_size_reset", 1 << 20)]
    assert b.threads == 3 and "3 kvikio threads, 1024 KiB tasks" in b.reason


def test_settings_that_cannot_be_applied_are_reported(open_kv):
    fake = FakeKvikio()
    fake.defaults = types.SimpleNamespace()  # neither API
    b, _ = open_kv(fake)
    assert b.threads is None
    assert "kvikio's default kvikio threads (could not set (AttributeError" in b.reason


# -- transfers --------------------------------------------------------------------------------
def test_implements_the_protocol(open_kv):
    b, _ = open_kv()
    assert isinstance(b, Backend) and b.name == "kvikio"
    assert b.reason.startswith("kvikio: kvikio 26.10.00 write+read probe passed on ")
    ext = b.allocate(5000)
    fut = b.write(ext, filled(ext.length))
    assert isinstance(fut, Future) and fut.result() is None
    fut = b.write(ext, filled(ext.length), "crc32")
    assert isinstance(fut.result(), int)


@pytest.mark.parametrize("checksum", ["off", "crc32"])
def test_round_trip_random_extents(open_kv, checksum):
    b, fake = open_kv(max_disk_bytes="8MiB")
    rng = random.Random(7)
    live = []
    for _ in range(40):
        if live and rng.random() < 0.3:
            ext, _, _ = live.pop(rng.randrange(len(live)))
            b.free(ext)
            continue
        logical = rng.choice([1, 4095, 4096, 70_000, 300_000, 1 << 20])
        ext = b.allocate(logical)
        if ext is None:
            continue
        data = filled(ext.length, logical)
        digest = b.write(ext, data, checksum).result()
        live.append((ext, bytes(data), digest))
    assert len(live) >= 5
    futures = []
    for ext, data, digest in live:
        back = empty(ext.length)
        futures.append((b.read(ext, back, checksum, digest), back, data))
    for fut, back, data in futures:
        fut.result()
        assert back == data
    # one CuFile per slab (plus the probe's), each on its slab's /proc link, opened "r+"
    slabs = b._slabs.slabs
    assert len(fake.files) == 1 + len(slabs)
    assert {f.path for f in fake.files[1:]} == {f"/proc/self/fd/{s.fd}" for s in slabs.values()}
    assert all(f.flags == "r+" for f in fake.files)
    for s in slabs.values():  # "w" would have truncated the preallocated slab
        assert os.fstat(s.fd).st_size == s.size
    u = b.usage()
    assert u["io_errors"] == 0 and u["writes"] >= len(live) and u["reads"] == len(live)


def test_device_buffers_round_trip(open_kv, fake_cuda):
    b, fake = open_kv(FakeKvikio(gds=True))
    assert b.device_direct
    ext = b.allocate(200_000)
    src = FakeDeviceBuffer(ext.length, offset=100)  # not 4 KiB aligned: fine on the device
    digest = b.write(ext, src, "crc32").result()
    assert digest == zlib.crc32(src.host.tobytes())
    dst = FakeDeviceBuffer(ext.length, fill=0xA5)
    b.read(ext, dst, "crc32", digest).result()
    assert np.array_equal(dst.host, src.host)
    host = empty(ext.length)  # host and device buffers share the slab
    b.read(ext, host).result()
    assert host == src.host.tobytes()


def test_device_buffer_lengths_are_still_checked(open_kv, fake_cuda):
    b, _ = open_kv(FakeKvikio(gds=True))
    ext = b.allocate(8192)
    with pytest.raises(ValueError, match="buffer of 4096 bytes for an extent of 8192 bytes"):
        b.write(ext, FakeDeviceBuffer(4096))
    with pytest.raises(ValueError, match="is not a multiple of 4096"):
        b.write(ext, memoryview(bytearray(8192 + 1))[1:])  # host memory keeps the check


def test_checksum_mismatch_is_ebadmsg(open_kv):
    b, _ = open_kv()
    ext = b.allocate(8192)
    data = filled(ext.length)
    digest = b.write(ext, data, "crc32").result()
    slab = b._slabs.slabs[ext.slab]
    junk = filled(4096)
    os.pwrite(slab.fd, junk, ext.offset)
    with pytest.raises(StorageError) as info:
        b.read(ext, empty(ext.length), "crc32", digest).result()
    assert info.value.errno == errno.EBADMSG
    assert b.usage()["checksum_errors"] == 1


@pytest.mark.parametrize(
    ("raised", "code"),
    [
        (RuntimeError("POSIX error on pwrite: No space left on device"), errno.ENOSPC),
        (RuntimeError("cuFile error at: file_handle.cpp:212: internal error"), errno.EIO),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), errno.EDQUOT),
        (RuntimeError("libcuda.so.1: cannot open shared object file: No such file or dir"), 5),
    ],
)
def test_iofuture_errors_become_storage_errors(open_kv, raised, code):
    b, fake = open_kv()
    ext = b.allocate(3 << 20)
    fake.raise_at_get = raised
    with pytest.raises(StorageError) as info:
        b.write(ext, filled(ext.length)).result()
    e = info.value
    assert e.errno == code and e.op == "write"
    assert e.path == f"{b.spill_path}/slab-0 (unlinked)"
    assert e.offset == ext.offset and e.nbytes == ext.length
    assert f"kvikio: {type(raised).__name__}: " in str(e)
    assert isinstance(e.__cause__, type(raised))
    assert b.usage()["io_errors"] == 1


def test_read_error_is_never_zeros(open_kv):
    b, fake = open_kv()
    ext = b.allocate(65536)
    b.write(ext, filled(ext.length)).result()
    fake.raise_at_get = RuntimeError("POSIX error on pread: Input/output error")
    back = empty(ext.length)
    with pytest.raises(StorageError, match=r"read of 65536 bytes at offset 0 in .*slab-0 .*EIO"):
        b.read(ext, back).result()
    assert back == empty(ext.length)  # untouched marker, not zeros


def test_short_counts_are_resubmitted_from_an_aligned_byte(open_kv, fake_cuda):
    """Only cuFile returns short counts (kvikio's POSIX path loops until done)."""
    b, fake = open_kv(FakeKvikio(gds=True))
    ext = b.allocate(65536)
    data = FakeDeviceBuffer(ext.length)
    seen = []

    def short(op, offset, size):  # the first request of each op moves 10000 bytes
        seen.append((op, offset, size))
        return 10_000 if sum(1 for s in seen if s[0] == op) == 1 else size

    fake.short = short
    b.write(ext, data).result()
    back = FakeDeviceBuffer(ext.length, fill=0xA5)
    b.read(ext, back).result()
    assert np.array_equal(back.host, data.host)
    # 10000 bytes done: resubmitted from 8192 (the last 4 KiB boundary), for the rest
    assert seen == [
        ("pwrite", 0, 65536),
        ("pwrite", 8192, 65536 - 8192),
        ("pread", 0, 65536),
        ("pread", 8192, 65536 - 8192),
    ]


@pytest.mark.parametrize(
    ("op", "count", "text"),
    [
        ("pwrite", 0, "The device made no progress in 8 attempts"),
        ("pread", 0, "Unexpected end of file"),
        ("pwrite", 100, "The device made no progress"),  # below one DIO unit, every time
        ("pread", 1 << 30, "kvikio reported 1073741824 bytes for a 65536-byte request"),
    ],
)
def test_short_counts_that_never_finish_are_errors(open_kv, fake_cuda, op, count, text):
    b, fake = open_kv(FakeKvikio(gds=True))
    ext = b.allocate(65536)
    b.write(ext, filled(ext.length)).result()
    fake.short = lambda o, offset, size: count if o == op else size
    buf = FakeDeviceBuffer(ext.length)
    call = b.write if op == "pwrite" else b.read
    with pytest.raises(StorageError, match=text) as info:
        call(ext, buf).result()
    assert info.value.errno == errno.EIO


# -- the fake itself: what tests/storage/test_kvikio_real.py cannot compare without timing ------
def test_the_fakes_io_starts_at_submit_and_done_waits_for_it(tmp_path):
    fake = FakeKvikio()
    path = tmp_path / "f"
    path.write_bytes(bytes(65536))
    f = fake.CuFile(path, "r+")
    data = np.frombuffer(os.urandom(65536), dtype=np.uint8).copy()
    fake.hold_tasks = True
    fut = f.pwrite(data, 65536, 0, 16384)
    assert fut.done() is False and fake.pending == 4
    fake.release()  # no get(): the tasks run all the same
    assert fut.done() is True and path.read_bytes() == data.tobytes()
    assert fut.get() == 65536
    with pytest.raises(ValueError, match="does not refer to a valid shared state"):
        fut.done()
    f.close()


# -- what real kvikio does that tba relied on wrongly (each test failed before its fix) -------
def test_the_device_probe_is_large_enough_to_reach_cufile(open_kv, fake_cuda):
    """kvikio sends a device request under gds_threshold through POSIX: a probe that small
    says nothing about cuFile."""
    fake = FakeKvikio(gds=True)
    fake.settings["gds_threshold"] = 256 << 10
    b, _ = open_kv(fake)
    device = [r for r in fake.requests if r[2] != 0]  # the host pair is at offset 0
    assert device and all(r[3] >= 256 << 10 for r in device)
    assert {p[3] for p in fake.paths if p[1] != 0} == {"cufile"}
    assert b.device_direct is True
    src, dst = fake_cuda[0]
    assert src.nbytes == 256 << 10 and np.array_equal(src.host, dst.host)


@pytest.mark.parametrize("api", ["new", "old"])
def test_the_device_probe_follows_the_default_threshold(open_kv, fake_cuda, api):
    b, fake = open_kv(FakeKvikio(gds=True, api=api))
    device = [r for r in fake.requests if r[2] != 0]
    assert [r[3] for r in device] == [16 << 10, 16 << 10]  # kvikio's default, 16 KiB
    assert {p[3] for p in fake.paths if p[1] != 0} == {"cufile"}


def test_host_reads_and_writes_go_through_o_direct(open_kv):
    """kvikio reads host buffers through the page cache unless auto_direct_io_read is on."""
    b, fake = open_kv()
    if fake.files[0].fd_direct == -1:
        pytest.skip("the spill filesystem does not open files with O_DIRECT")
    assert fake.settings["auto_direct_io_read"] is True
    assert fake.settings["auto_direct_io_write"] is True
    assert "host I/O through O_DIRECT" in b.reason
    ext = b.allocate(200_000)
    data = filled(ext.length)
    b.write(ext, data).result()
    back = empty(ext.length)
    b.read(ext, back).result()
    assert back == data
    assert {p[3] for p in fake.paths} == {"posix-direct"}


def test_a_release_without_direct_io_settings_still_opens(open_kv):
    b, fake = open_kv(FakeKvikio(version="25.12.00", direct_io=False))
    assert "auto_direct_io_read" not in fake.settings
    assert "host I/O buffered (kvikio 25.12.00 has no auto_direct_io_read)" in b.reason
    assert b.threads == 4


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_failed_task_waits_for_the_others_before_the_buffer_goes(open_kv, op):
    """kvikio's get() rethrows the first failed task while later tasks still use the buffer;
    tba must not report (and so free or reuse the buffer) before all of them ended."""
    b, fake = open_kv(gds_task_bytes="1MiB")
    ext = b.allocate(3 << 20)
    b.write(ext, filled(ext.length)).result()
    fake.hold_tasks = True  # a busy pool: a task runs once something waits for it
    fake.raise_at_get = posix_error("pwrite" if op == "write" else "pread", errno.ENOSPC)
    fake.fail_when = lambda o, offset, size: offset == ext.offset
    buf = filled(ext.length) if op == "write" else empty(ext.length)
    try:
        with pytest.raises(StorageError) as info:
            getattr(b, op)(ext, buf).result()
        assert fake.pending == 0  # no task of the request still holds the buffer
    finally:
        fake.release()
    assert info.value.errno == errno.ENOSPC and info.value.offset == ext.offset
    assert b.usage()["io_errors"] == 1


_AT = "/__w/kvikio/kvikio/cpp/include/kvikio/detail/posix_io.hpp:90"
_CU = "/__w/kvikio/kvikio/cpp/include/kvikio/error.hpp:270"


@pytest.mark.parametrize(
    ("text", "code", "kind"),
    [
        (f"KvikIO failure at: {_AT}: POSIX error on pwrite: No space left on device", 28, "disk"),
        (f"KvikIO failure at: {_AT}: POSIX error on pwrite: Disk quota exceeded", 122, "disk"),
        (f"KvikIO failure at: {_AT}: POSIX error on pwrite: File too large", 27, "io"),
        (f"KvikIO failure at: {_AT}: POSIX error: Operation not permitted", 9, "io"),  # EBADF
        (f"cuFile error at: {_CU}: No space left on device", 28, "disk"),
        (f"KvikIO failure at: {_CU}: Unable to write file: No space left on device", 28, "disk"),
        (f"cuFile error at: {_CU}: Operation not permitted", 5, "io"),  # cuFile's -1: no errno
        (f"cuFile error at: {_CU}: cufile invalid value", 5, "io"),
        (
            "Unable to open file. Linux system/library function call error at: x.cpp:160: "
            "Permission denied",
            13,
            "permission",
        ),
        (f"KvikIO failure at: {_AT}: POSIX error on pread: EOF", 5, "io"),
    ],
    ids=[
        "enospc",
        "edquot",
        "efbig",
        "ebadf",
        "cufile-enospc",
        "cufile-write-enospc",
        "cufile-minus-one",
        "cufile-op-error",
        "open-eacces",
        "eof",
    ],
)
def test_errnos_come_from_kvikios_real_messages(open_kv, text, code, kind):
    """The texts are kvikio 26.10's (cpp/include/kvikio/error.hpp, detail/posix_io.hpp)."""
    from tba.records.reasons import kept_reason_for

    b, fake = open_kv()
    ext = b.allocate(65536)
    fake.raise_at_get = RuntimeError(text)
    with pytest.raises(StorageError) as info:
        b.write(ext, filled(ext.length)).result()
    assert info.value.errno == code, str(info.value)
    reason = kept_reason_for(info.value.errno)
    assert {"disk": "disk_full", "io": "io_error", "permission": "permission"}[kind] == reason


def test_end_of_file_from_kvikio_says_so(open_kv):
    b, fake = open_kv()
    ext = b.allocate(65536)
    b.write(ext, filled(ext.length)).result()
    os.ftruncate(b._slabs.slabs[ext.slab].fd, ext.offset + 4096)  # the slab lost its tail
    back = empty(ext.length)
    with pytest.raises(StorageError, match="Unexpected end of file") as info:
        b.read(ext, back).result()
    assert info.value.errno == errno.EIO and "POSIX error on pread: EOF" in str(info.value)


# -- files, registration, close ---------------------------------------------------------------
def test_released_slab_closes_its_cufile(open_kv):
    b, fake = open_kv(max_disk_bytes="2MiB")
    first = b.allocate(1 << 20)
    b.write(first, filled(first.length)).result()
    slab0 = fake.files[-1]
    b.free(first)
    second = b.allocate(2 << 20)  # no room beside slab 0: the empty slab is released first
    assert second is not None and second.slab == 1
    assert slab0.closed  # its CuFile went with it, so its blocks really return
    data = filled(second.length)
    b.write(second, data).result()
    back = empty(second.length)
    b.read(second, back).result()
    assert back == data
    assert fake.files[-1] is not slab0 and fake.files[-1].path == slab0.path  # fd reused


def test_close_closes_every_cufile_and_the_directory(open_kv):
    b, fake = open_kv()
    for n in (4096, 1 << 20, 1 << 20):
        ext = b.allocate(n)
        b.write(ext, filled(ext.length)).result()
    path = b.spill_path
    b.close()
    assert all(f.closed for f in fake.files)
    assert not os.path.exists(path)
    b.close()  # idempotent


def test_register_device_buffers_and_deregister_at_close(open_kv, fake_cuda):
    b, fake = open_kv(FakeKvikio(gds=True))
    arena = FakeDeviceBuffer(1 << 20)
    assert b.register(arena) is True
    assert b.register(arena) is True  # once per buffer
    assert b.register(memoryview(bytearray(4096))) is False  # host: kvikio never uses cuFile
    assert len(fake.registered) == 1 and fake.registered[0].ptr == arena.ptr
    b.close()
    assert [v.ptr for v in fake.deregistered] == [arena.ptr]
    with pytest.raises(ValueError, match="closed"):
        b.register(arena)


def test_register_is_a_no_op_in_compat_mode(open_kv, fake_cuda):
    b, fake = open_kv(FakeKvikio(gds=False))
    assert b.register(FakeDeviceBuffer(4096)) is False
    assert fake.registered == []


def test_register_refused_by_cufile_is_false(open_kv, fake_cuda):
    fake = FakeKvikio(gds=True)

    def refuse(buf):
        raise RuntimeError("cuFile error: CU_FILE_MEMORY_ALREADY_REGISTERED")

    fake.memory_register = refuse
    b, _ = open_kv(fake)
    assert b.register(FakeDeviceBuffer(4096)) is False
    b.close()
    assert fake.deregistered == []


def test_a_slab_given_back_to_the_node_quota_closes_its_cufile(open_kv, make_cfg):
    """NOTE [Slabs] 6: a free that empties a slab owed to another rank closes its CuFile too."""
    b, fake = open_kv(node_max_disk_bytes="2MiB")
    held = [b.allocate(1 << 20), b.allocate(1 << 20)]
    for ext in held:
        b.write(ext, filled(ext.length)).result()
    files = fake.files[-2:]
    with PosixBackend(make_cfg(node_max_disk_bytes="2MiB")) as other:
        assert other.allocate(1 << 20) is None  # refused below its share: it wants space
        for ext in held:
            b.free(ext)
        assert b.usage()["slabs"] == 1 and [f.closed for f in files].count(True) == 1
        assert other.allocate(1 << 20) is not None


def test_dropped_backend_releases_its_files(make_cfg, no_cuda):
    fake = FakeKvikio()
    b = KvikioBackend(make_cfg(), kvikio_module=fake)
    ext = b.allocate(4096)
    b.write(ext, filled(ext.length)).result()
    path = b.spill_path
    del b, ext
    gc.collect()
    assert not os.path.exists(path)


def test_host_tensors_are_accepted(open_kv):
    from tba.host.memory import aligned_empty

    b, _ = open_kv()
    ext = b.allocate(8192)
    src = aligned_empty(ext.length)
    src.copy_(torch.randint(0, 256, (ext.length,), dtype=torch.uint8))
    b.write(ext, src).result()
    dst = aligned_empty(ext.length)
    b.read(ext, dst).result()
    assert torch.equal(src, dst)


# -- a real GPU ------------------------------------------------------------------------------
@pytest.mark.gpu
def test_real_kvikio_with_a_device_buffer(make_cfg):
    pytest.importorskip("kvikio")
    with KvikioBackend(make_cfg()) as b:
        ext = b.allocate(3 << 20)
        src = torch.randint(0, 256, (ext.length,), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()  # the DMA is ordered on no stream
        digest = b.write(ext, src, "crc32").result()
        dst = torch.empty_like(src)
        torch.cuda.synchronize()
        b.read(ext, dst, "crc32", digest).result()
        assert torch.equal(src, dst)
        host = empty(ext.length)
        b.read(ext, host).result()
        assert host == src.cpu().numpy().tobytes()
        assert b.register(src) is b.device_direct


# -- backend selection: "auto" and kvikio ------------------------------------------------------
def fake_cuda_host(monkeypatch, fake):
    """``import kvikio`` gives ``fake`` and torch reports a CUDA device."""
    monkeypatch.setitem(sys.modules, "kvikio", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_auto_picks_kvikio_on_a_cuda_host_with_gds(make_cfg, monkeypatch, fake_cuda):
    from tba.storage import open_backend

    fake_cuda_host(monkeypatch, FakeKvikio(gds=True, compat="OFF"))
    with open_backend(make_cfg(backend="auto")) as b:
        assert b.name == "kvikio" and b.device_direct
        assert b.reason.startswith("auto: ")


def test_auto_passes_over_kvikio_without_gds(make_cfg, monkeypatch, fake_cuda):
    from tba.storage import open_backend

    fake_cuda_host(monkeypatch, FakeKvikio(gds=False))
    with open_backend(make_cfg(backend="auto")) as b:
        assert b.name != "kvikio"
        assert b.reason.startswith("auto: kvikio skipped (kvikio 26.10.00 imported; GDS driver not")


def test_auto_passes_over_kvikio_without_cuda(make_cfg, monkeypatch):
    from tba.storage import open_backend

    monkeypatch.setitem(sys.modules, "kvikio", FakeKvikio(gds=True, compat="OFF"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with open_backend(make_cfg(backend="auto")) as b:
        assert b.name != "kvikio"
        assert "kvikio skipped" not in b.reason  # not news on a CPU host


def test_auto_passes_over_kvikio_whose_probe_fails(make_cfg, monkeypatch, fake_cuda):
    from tba.storage import open_backend

    fake = FakeKvikio(gds=True, compat="OFF")
    fake.raise_at_call = NO_DRIVER
    fake_cuda_host(monkeypatch, fake)
    with open_backend(make_cfg(backend="auto")) as b:
        assert b.name != "kvikio"
        assert b.reason.startswith("auto: kvikio probe failed (") and "libcuda.so.1" in b.reason
