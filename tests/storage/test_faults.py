"""Injected faults on the slab-backed backends: every failure is typed, counted and named.

Faults are injected by replacing the syscalls a backend holds as instance attributes:
``_pwrite``, ``_preadv``, ``_fallocate``, ``_statvfs`` (and ``_fdatasync``, ``_fadvise`` on
buffered).
"""

from __future__ import annotations

import errno
import logging
import os
import zlib

import pytest
from storage_util import empty, filled

from tba.errors import StorageError
from tba.storage import open_backend


def oserror(code: int) -> OSError:
    return OSError(code, os.strerror(code))


# -- short and stalled transfers -------------------------------------------------------------
@pytest.mark.parametrize("first", [8192, 100])  # aligned, and not even DIO-aligned
def test_short_write_is_resubmitted(file_backend, first):
    calls = []
    real = os.pwrite

    def short_once(fd, buf, off):
        calls.append((len(buf), off))
        if len(calls) == 1:  # at least ``first`` bytes reach the file, ``first`` is reported
            real(fd, buf[: max(first, 4096)], off)
            return first
        return real(fd, buf, off)

    file_backend._pwrite = short_once
    ext = file_backend.allocate(65536)
    data = filled(ext.length)
    file_backend.write(ext, data).result()
    assert len(calls) >= 2
    back = empty(ext.length)
    file_backend.read(ext, back).result()
    assert back == data


def test_short_read_is_resubmitted(file_backend):
    ext = file_backend.allocate(65536)
    data = filled(ext.length)
    file_backend.write(ext, data).result()
    real = os.preadv
    calls = []

    def page_at_a_time(fd, bufs, off):
        calls.append(off)
        return real(fd, [bufs[0][:4096]], off)

    file_backend._preadv = page_at_a_time
    back = empty(ext.length)
    file_backend.read(ext, back).result()
    assert back == data
    assert len(calls) == ext.length // 4096


def test_write_without_progress_fails(file_backend):
    file_backend._pwrite = lambda fd, buf, off: 0
    ext = file_backend.allocate(4096)
    with pytest.raises(
        StorageError,
        match=r"write of 4096 bytes at offset 0 in .*/slab-0 \(unlinked\) failed: EIO "
        r"\(Input/output error\)\. The device made no progress in 8 attempts\.",
    ):
        file_backend.write(ext, filled(4096)).result()


def test_eagain_is_retried(file_backend):
    real = os.pwrite
    left = [3]

    def busy(fd, buf, off):
        if left[0]:
            left[0] -= 1
            raise oserror(errno.EAGAIN)
        return real(fd, buf, off)

    file_backend._pwrite = busy
    ext = file_backend.allocate(4096)
    file_backend.write(ext, filled(4096)).result()
    assert left[0] == 0


# -- write and read errors -------------------------------------------------------------------
@pytest.mark.parametrize(
    "code, text",
    [
        (errno.ENOSPC, r"ENOSPC \(No space left on device\)\. Free space on the spill filesystem"),
        (errno.EIO, r"EIO \(Input/output error\)\. The device reported an I/O error"),
    ],
)
def test_write_error_names_file_offset_bytes_errno(file_backend, code, text):
    def fail(fd, buf, off):
        raise oserror(code)

    file_backend.allocate(4096)  # so the failing extent is not at offset 0
    ext = file_backend.allocate(8192)
    file_backend._pwrite = fail
    fut = file_backend.write(ext, filled(8192))
    with pytest.raises(
        StorageError,
        match=r"^tba\.storage: write of 8192 bytes at offset 4096 in "
        rf"{file_backend.spill_path}/slab-0 \(unlinked\) failed: {text}",
    ) as info:
        fut.result()
    e = info.value
    assert isinstance(e, OSError)
    assert (e.errno, e.offset, e.nbytes, e.op) == (code, 4096, 8192, "write")
    assert e.filename == f"{file_backend.spill_path}/slab-0 (unlinked)"
    assert file_backend.usage()["io_errors"] == 1
    assert file_backend.usage()["writes"] == 0


def test_read_error_is_a_storage_error(file_backend):
    ext = file_backend.allocate(8192)
    file_backend.write(ext, filled(8192)).result()

    def fail(fd, bufs, off):
        raise oserror(errno.EIO)

    file_backend._preadv = fail
    with pytest.raises(
        StorageError,
        match=r"read of 8192 bytes at offset 0 in .*/slab-0 \(unlinked\) failed: EIO "
        r"\(Input/output error\)\. The device reported an I/O error: check dmesg",
    ):
        file_backend.read(ext, empty(8192)).result()


@pytest.mark.parametrize("before_eof", [0, 4096])
def test_end_of_file_is_an_error_never_zeros(file_backend, before_eof):
    ext = file_backend.allocate(8192)
    file_backend.write(ext, filled(8192)).result()
    real = os.preadv
    served = [0]

    def eof(fd, bufs, off):
        if served[0] >= before_eof:
            return 0
        n = real(fd, [bufs[0][:4096]], off)
        served[0] += n
        return n

    file_backend._preadv = eof
    fut = file_backend.read(ext, empty(8192))
    with pytest.raises(
        StorageError,
        match=rf"read of {8192 - before_eof} bytes at offset {before_eof} in .* failed: EIO "
        r"\(Input/output error\)\. Unexpected end of file: .* Nothing was zero-filled",
    ):
        fut.result()


def test_checksum_mismatch_from_a_flipped_byte(file_backend):
    ext = file_backend.allocate(16384)
    data = filled(ext.length)
    digest = file_backend.write(ext, data, checksum="crc32").result()
    assert digest == zlib.crc32(data)
    real = os.preadv

    def flip(fd, bufs, off):
        n = real(fd, bufs, off)
        bufs[0][100] ^= 0x01  # one bit of rot on the way back
        return n

    file_backend._preadv = flip
    with pytest.raises(
        StorageError,
        match=r"read of 16384 bytes at offset 0 in .*/slab-0 \(unlinked\) failed: EBADMSG "
        r"\(Bad message\)\. Checksum crc32 mismatch: expected 0x[0-9a-f]+, got 0x[0-9a-f]+\. "
        r"The spilled bytes were corrupted",
    ) as info:
        file_backend.read(ext, empty(ext.length), checksum="crc32", expect=digest).result()
    assert info.value.errno == errno.EBADMSG
    u = file_backend.usage()
    assert u["checksum_errors"] == 1 and u["io_errors"] == 1


# -- slab growth: fallocate, quota, free space -----------------------------------------------
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_fallocate_no_space_returns_none_and_counts(file_backend, code):
    def full(fd, off, n):
        raise oserror(code)

    file_backend._fallocate = full
    assert file_backend.allocate(4096) is None
    assert file_backend.allocate(4096) is None
    u = file_backend.usage()
    assert (u["refused_space"], u["slabs"], u["slab_bytes"]) == (2, 0, 0)
    file_backend._fallocate = os.posix_fallocate
    assert file_backend.allocate(4096) is not None
    assert os.listdir(file_backend.spill_path) == []


def test_fallocate_other_error_returns_none_and_counts(file_backend, caplog):
    def broken(fd, off, n):
        raise oserror(errno.EIO)

    file_backend._fallocate = broken
    assert file_backend.allocate(4096) is None
    assert file_backend.usage()["refused_error"] == 1
    # The cause and errno are the caller's to warn about, once (NOTE [Slabs] 5): only debug here
    assert file_backend.refusal == "io_error"
    assert "fallocate of 1048576 bytes at offset 0" in file_backend.refusal_detail
    assert "EIO" in file_backend.refusal_detail
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_fallocate_unsupported_falls_back_to_sparse(file_backend):
    def unsupported(fd, off, n):
        raise oserror(errno.EOPNOTSUPP)

    file_backend._fallocate = unsupported
    ext = file_backend.allocate(4096)
    assert ext is not None
    data = filled(4096)
    file_backend.write(ext, data).result()
    back = empty(4096)
    file_backend.read(ext, back).result()
    assert back == data


@pytest.mark.parametrize("name", ["posix", "buffered"])
def test_quota_refuses_growth_and_shrinks_the_last_slab(make_cfg, name):
    mib = 1 << 20
    with open_backend(make_cfg(backend=name, max_disk_bytes=mib + mib // 2)) as b:
        first = b.allocate(mib)
        second = b.allocate(mib // 2)  # the second slab is cut to the quota: 512 KiB
        assert first is not None and second is not None
        assert b.usage()["slab_bytes"] == mib + mib // 2
        assert b.allocate(4096) is None
        assert b.usage()["refused_quota"] == 1
        b.free(second)
        assert b.allocate(4096) is not None


def test_quota_closes_empty_slabs_to_make_room(make_cfg):
    mib = 1 << 20
    with open_backend(make_cfg(backend="posix", max_disk_bytes=2 * mib)) as b:
        small = b.allocate(4096)
        b.free(small)
        big = b.allocate(2 * mib)  # needs the whole quota: the empty 1 MiB slab goes
        assert big is not None
        u = b.usage()
        assert (u["slabs"], u["slab_bytes"], u["refused_quota"]) == (1, 2 * mib, 0)


def test_large_request_gets_its_own_slab(file_backend):
    ext = file_backend.allocate((3 << 20) + 1)
    assert ext.length == (3 << 20) + 4096
    assert file_backend.usage()["slab_bytes"] == ext.length
    small = file_backend.allocate(4096)
    assert small.slab != ext.slab
    assert file_backend.usage()["slabs"] == 2


def test_free_space_floor_refuses(make_cfg):
    free = os.statvfs(make_cfg().spill_dir.rsplit("/", 1)[0])
    floor = free.f_bavail * free.f_frsize + (1 << 40)
    with open_backend(make_cfg(backend="posix", min_free_bytes=floor)) as b:
        assert b.allocate(4096) is None
        assert b.usage()["refused_space"] == 1


def test_slab_is_cut_to_the_free_space(file_backend):
    class Almost:
        f_frsize = 4096
        f_bavail = 64  # 256 KiB free above the 0-byte floor

    file_backend._statvfs = lambda path: Almost
    ext = file_backend.allocate(8192)
    assert ext is not None
    assert file_backend.usage()["slab_bytes"] == 64 * 4096
    assert file_backend.allocate(512 * 1024) is None
    assert file_backend.usage()["refused_space"] == 1


# -- buffered page-cache control -------------------------------------------------------------
def test_buffered_syncs_and_drops_every_sync_bytes(make_cfg):
    with open_backend(make_cfg(backend="buffered")) as b:
        b.sync_bytes = 64 * 1024
        synced, dropped = [], []
        b._fdatasync = lambda fd: synced.append(fd)
        b._fadvise = lambda fd, off, n, advice: dropped.append((off, n, advice))
        exts = [b.allocate(32 * 1024) for _ in range(4)]
        for e in exts:
            b.write(e, filled(e.length)).result()
        assert len(synced) == 2
        assert dropped == [
            (0, 65536, os.POSIX_FADV_DONTNEED),
            (65536, 65536, os.POSIX_FADV_DONTNEED),
        ]
        b.read(exts[0], empty(exts[0].length)).result()
        assert dropped[-1] == (0, 32 * 1024, os.POSIX_FADV_DONTNEED)


def test_buffered_fdatasync_error_fails_the_write(make_cfg):
    with open_backend(make_cfg(backend="buffered")) as b:
        b.sync_bytes = 4096

        def fail(fd):
            raise oserror(errno.EIO)

        b._fdatasync = fail
        ext = b.allocate(4096)
        with pytest.raises(
            StorageError,
            match=r"fdatasync of 4096 bytes at offset 0 in .*/slab-0 \(unlinked\) failed: EIO",
        ):
            b.write(ext, filled(4096)).result()
        assert b.usage()["io_errors"] == 1
