"""open_backend: probing, "auto" fallback, forced backends, and the once-per-process log line."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import tempfile

import pytest
import torch
from storage_util import assert_round_trip, empty, filled

from tba.config import Config
from tba.errors import ConfigError
from tba.storage import BufferedBackend, MemoryBackend, PosixBackend, open_backend
from tba.storage.checksum import checksum_fn
from tba.storage.native import engine_status

needs_engine = pytest.mark.skipif(not engine_status()["built"], reason="native engine not built")


@pytest.fixture(autouse=True)
def cpu_host(monkeypatch):
    """These tests describe "auto" on a host without CUDA, where kvikio is not even tried and
    its absence goes unmentioned; on a GPU host (the GPU check runs this suite there) "auto"
    first says why kvikio was skipped (test_auto_on_a_gpu_host_says_why_kvikio_was_skipped)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def no_o_direct_at_open(monkeypatch):
    """Make every O_DIRECT open fail with EINVAL, as on filesystems without direct I/O."""
    real = os.open

    def fake(path, flags, mode=0o777, *, dir_fd=None):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", fake)


def no_o_direct_at_write(monkeypatch):
    """O_DIRECT opens succeed but the first aligned write fails with EINVAL."""
    real = os.pwrite

    def fake(fd, buf, off):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, buf, off)

    monkeypatch.setattr(os, "pwrite", fake)


def no_native(monkeypatch):
    """The native engine cannot create its ring here, as under Docker's seccomp profile."""
    import tba.storage.native as native

    real = native.NativeBackend

    class Blocked(real):
        def __init__(self, cfg, *, require_ring=False, _setup_errno=None):
            super().__init__(cfg, require_ring=require_ring, _setup_errno=errno.EPERM)

    monkeypatch.setattr(native, "NativeBackend", Blocked)


@needs_engine
def test_auto_takes_native_on_a_disk(make_cfg):
    with open_backend(make_cfg(backend="auto")) as b:
        assert b.name == "native" and b.kind == "io_uring"
        assert b.reason.startswith("auto: io_uring engine, depth 32, ")
        assert "kvikio" not in b.reason  # skipping kvikio on a CPU host is not news
        assert f"O_DIRECT write+read probe passed on {b.fs} at {make_cfg().spill_dir}" in b.reason


@needs_engine
def test_auto_on_a_gpu_host_says_why_kvikio_was_skipped(make_cfg, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(__import__("sys").modules, "kvikio", None)  # as on the GPU image
    with open_backend(make_cfg(backend="auto")) as b:
        assert b.name == "native"
        assert b.reason.startswith("auto: kvikio skipped (kvikio is not installed")
        assert "); io_uring engine, depth 32, " in b.reason


def test_auto_takes_posix_without_io_uring_and_says_why_once(make_cfg, monkeypatch, caplog):
    import tba.storage as storage

    no_native(monkeypatch)
    storage._logged.clear()
    caplog.set_level(logging.INFO, logger="tba.storage")
    for _ in range(2):
        with open_backend(make_cfg(backend="auto")) as b:
            assert isinstance(b, PosixBackend)
            assert b.reason.startswith("auto: native probe failed (")
            assert "EPERM" in b.reason
            assert "); O_DIRECT write+read probe passed on " in b.reason
            assert f" at {make_cfg().spill_dir} (dio align " in b.reason
            assert b.reason.endswith(f", using {b.alignment})")
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert "native probe failed" in warned[0].getMessage()
    assert "using the posix backend instead" in warned[0].getMessage()


@needs_engine
def test_forced_native_without_io_uring_runs_its_threads(make_cfg, monkeypatch):
    no_native(monkeypatch)
    with open_backend(make_cfg(backend="native")) as b:
        assert b.name == "native" and b.kind == "threads"
        assert b.reason.startswith("TBA_BACKEND=native: ")
        assert "EPERM" in b.reason
        assert_round_trip(b, 10_000)


def test_forced_native_without_the_library_is_a_config_error(make_cfg, monkeypatch):
    import tba.storage.native as native

    def missing(cfg, **kw):
        raise native.NativeUnavailable(errno.ENOENT, "tba.storage: the native engine is not built")

    monkeypatch.setattr(native, "NativeBackend", missing)
    with pytest.raises(
        ConfigError,
        match=r"TBA_BACKEND=native was requested but its probe failed: the native engine is not "
        r"built",
    ):
        open_backend(make_cfg(backend="native"))


def test_forced_kvikio_without_kvikio_is_a_config_error(make_cfg, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "kvikio", None)
    with pytest.raises(
        ConfigError,
        match=r"TBA_BACKEND=kvikio was requested but its probe failed: kvikio is not installed "
        r"\(pip install 'tba\[gds\]'\)",
    ):
        open_backend(make_cfg(backend="kvikio"))
    assert not os.path.exists(make_cfg().spill_dir)


@pytest.mark.parametrize("inject", [no_o_direct_at_open, no_o_direct_at_write])
def test_auto_falls_back_to_buffered_without_o_direct(make_cfg, monkeypatch, inject):
    inject(monkeypatch)
    no_native(monkeypatch)  # the engine's writes do not go through os.pwrite
    with open_backend(make_cfg(backend="auto")) as b:
        assert isinstance(b, BufferedBackend)
        assert b.reason.startswith("auto: native probe failed (")
        assert "); posix probe failed (" in b.reason
        assert "EINVAL (Invalid argument). The filesystem may refuse O_DIRECT" in b.reason
        assert "); buffered write+read probe passed on " in b.reason
        assert "fdatasync+DONTNEED every 128 MiB" in b.reason
        assert_round_trip(b, 10_000)
    assert os.listdir(make_cfg().spill_dir) == []


@pytest.mark.parametrize("inject", [no_o_direct_at_open, no_o_direct_at_write])
def test_forced_posix_whose_probe_fails_is_a_config_error(make_cfg, monkeypatch, inject):
    inject(monkeypatch)
    with pytest.raises(
        ConfigError,
        match=r"^tba\.config: TBA_BACKEND=posix was requested but its probe failed: "
        r"(open|write) of \d+ bytes at offset 0 in .*/probe \(unlinked\) failed: EINVAL "
        r"\(Invalid argument\)\. The filesystem may refuse O_DIRECT: try TBA_BACKEND=buffered\. "
        r"Use TBA_BACKEND=auto",
    ):
        open_backend(make_cfg(backend="posix"))
    assert os.listdir(make_cfg().spill_dir) == []  # the failed probe left nothing


def test_probe_that_reads_back_wrong_bytes_fails(make_cfg, monkeypatch):
    def zeros(fd, bufs, off):
        bufs[0][:] = bytes(len(bufs[0]))
        return len(bufs[0])

    monkeypatch.setattr(os, "preadv", zeros)
    with pytest.raises(
        ConfigError,
        match=r"TBA_BACKEND=buffered was requested but its probe failed: probe read of 4096 "
        r"bytes at offset 0 in .* failed: EIO \(Input/output error\)\. The bytes read back differ "
        r"from the bytes written",
    ):
        open_backend(make_cfg(backend="buffered"))


def test_auto_with_nothing_working_names_each_failure(make_cfg, monkeypatch):
    real = os.open

    def read_only(path, flags, mode=0o777, *, dir_fd=None):
        if flags & os.O_RDWR:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(
        ConfigError,
        match=r"no storage backend works in .*/spill: native probe failed \(.*EROFS.*\); "
        r"posix probe failed \(open of 0 bytes .* "
        r"EROFS \(Read-only file system\)\. The spill filesystem is read-only: remount it "
        r"read-write, or move TBA_SPILL_DIR\); buffered probe failed \(open .*EROFS.*\)\. Point "
        r"TBA_SPILL_DIR at a writable local disk, or use TBA_BACKEND=memory",
    ):
        open_backend(make_cfg(backend="auto"))


def test_memory_backend_touches_no_disk(make_cfg):
    with open_backend(make_cfg(backend="memory")) as b:
        assert isinstance(b, MemoryBackend)
        assert b.reason.startswith("TBA_BACKEND=memory: saved tensors stay in host memory")
        b.write(b.allocate(4096), filled(4096)).result()
    assert not os.path.exists(make_cfg().spill_dir)


def test_forced_names_say_so(make_cfg):
    with open_backend(make_cfg(backend="posix")) as b:
        assert b.reason.startswith("TBA_BACKEND=posix: O_DIRECT write+read probe passed on ")


def test_missing_checksum_package_fails_at_open(make_cfg, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "xxhash", None)
    checksum_fn.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"TBA_CHECKSUM=xxh64 needs the xxhash package"):
            open_backend(make_cfg(backend="posix", checksum="xxh64"))
    finally:
        checksum_fn.cache_clear()
    assert not os.path.exists(make_cfg().spill_dir)


def test_choice_is_logged_once(make_cfg, caplog):
    caplog.set_level(logging.INFO, logger="tba.storage")
    for _ in range(3):
        open_backend(make_cfg(backend="auto")).close()
    lines = [r for r in caplog.records if "tba.storage: using the " in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].levelno == logging.INFO
    assert "(auto: " in lines[0].getMessage()
    assert "O_DIRECT write+read probe passed" in lines[0].getMessage()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_buffered_on_tmpfs(make_cfg):
    try:
        root = tempfile.mkdtemp(prefix="tba-test-", dir="/dev/shm")
    except OSError:
        pytest.skip("/dev/shm is not writable")
    try:
        with open_backend(make_cfg(backend="buffered", spill_dir=root)) as b:
            assert " on tmpfs at " in b.reason
            exts = [b.allocate(n) for n in (4096, 70_000, 1 << 20)]
            datas = [filled(e.length) for e in exts]
            for f in [b.write(e, d) for e, d in zip(exts, datas)]:
                f.result()
            for e, d in zip(exts, datas):
                back = empty(e.length)
                b.read(e, back).result()
                assert back == d
            assert os.listdir(b.spill_path) == []
        assert os.listdir(root) == []
    finally:
        os.rmdir(root)


def _shm_is_tmpfs() -> bool:
    from tba.storage.statx import fs_type

    return os.path.isdir("/dev/shm") and fs_type("/dev/shm") == "tmpfs"


@pytest.mark.skipif(not _shm_is_tmpfs(), reason="/dev/shm is not a tmpfs here")
def test_spill_dir_in_ram_gets_a_warning(caplog):
    import tba.storage as storage

    storage._logged.clear()
    root = tempfile.mkdtemp(dir="/dev/shm")
    try:
        with caplog.at_level(logging.WARNING, logger="tba.storage"):
            backend = open_backend(Config(spill_dir=root, min_free_bytes=0, environ={}))
            backend.close()
    finally:
        os.rmdir(root)
    assert backend.fs == "tmpfs"
    assert any(
        "is on tmpfs, which lives in RAM: offloading there frees no memory" in r.getMessage()
        for r in caplog.records
    )
