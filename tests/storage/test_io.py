"""Round trips and API contract, over every backend (posix, buffered, memory)."""

from __future__ import annotations

import errno
import zlib

import pytest
from storage_util import empty, filled

from tba.errors import ConfigError, StorageError, TBAError
from tba.host.memory import aligned_empty, as_memoryview
from tba.storage import Backend, Extent
from tba.storage.checksum import checksum_fn

USAGE_KEYS = {
    "disk_bytes_in_use",
    "slab_bytes",
    "slabs",
    "refused_quota",
    "refused_space",
    "refused_error",
    "bytes_written",
    "bytes_read",
    "writes",
    "reads",
    "io_errors",
    "checksum_errors",
    "throttle_seconds_write",
    "throttle_seconds_read",
    "alignment",
}


def test_implements_the_protocol(backend):
    assert isinstance(backend, Backend)
    assert backend.reason
    assert backend.alignment >= 4096 and backend.alignment & (backend.alignment - 1) == 0
    assert set(backend.usage()) == USAGE_KEYS


@pytest.mark.parametrize("logical", [1, 4095, 4096, 4097, 100_000, (1 << 20) + 1, 3 << 20])
def test_round_trip_is_exact_with_caller_padding(backend, logical):
    ext = backend.allocate(logical)
    assert ext is not None
    assert ext.length >= logical and ext.length % backend.alignment == 0
    assert ext.offset % backend.alignment == 0
    data = filled(ext.length, logical)  # the caller zero-pads the tail
    assert backend.write(ext, data).result() is None
    back = empty(ext.length)
    assert backend.read(ext, back).result() is None
    assert back == data
    u = backend.usage()
    assert u["writes"] == 1 and u["reads"] == 1
    assert u["bytes_written"] == u["bytes_read"] == ext.length
    assert u["disk_bytes_in_use"] == ext.length
    backend.free(ext)
    assert backend.usage()["disk_bytes_in_use"] == 0


def test_many_futures_in_flight(backend):
    sizes = [4096 * (1 + i % 7) + i for i in range(48)]
    exts = [backend.allocate(n) for n in sizes]
    datas = [filled(e.length) for e in exts]
    writes = [backend.write(e, d) for e, d in zip(exts, datas)]
    for f in writes:
        f.result(timeout=30)
    backs = [empty(e.length) for e in exts]
    reads = [backend.read(e, b) for e, b in zip(exts, backs)]
    for f in reads:
        f.result(timeout=30)
    for d, b in zip(datas, backs):
        assert b == d
    assert backend.usage()["writes"] == 48


def test_freed_space_is_reused(backend):
    a = backend.allocate(200_000)
    backend.free(a)
    b = backend.allocate(200_000)
    assert backend.usage()["disk_bytes_in_use"] == b.length
    if backend.name != "memory":
        assert b == a
        assert backend.usage()["slabs"] == 1
    data = filled(b.length)
    backend.write(b, data).result()
    back = empty(b.length)
    backend.read(b, back).result()
    assert back == data


def test_overwrite_in_place(backend):
    ext = backend.allocate(65536)
    for _ in range(3):
        data = filled(ext.length)
        backend.write(ext, data).result()
        back = empty(ext.length)
        backend.read(ext, back).result()
        assert back == data


def test_crc32_digest_and_verify(backend):
    ext = backend.allocate(50_000)
    data = filled(ext.length)
    digest = backend.write(ext, data, checksum="crc32").result()
    assert digest == zlib.crc32(data)
    back = empty(ext.length)
    backend.read(ext, back, checksum="crc32", expect=digest).result()
    assert back == data
    with pytest.raises(StorageError, match=r"Checksum crc32 mismatch: expected 0x") as info:
        backend.read(ext, empty(ext.length), checksum="crc32", expect=digest ^ 1).result()
    assert info.value.errno == errno.EBADMSG
    assert backend.usage()["checksum_errors"] == 1


@pytest.mark.parametrize("name, module", [("crc32c", "google_crc32c"), ("xxh64", "xxhash")])
def test_optional_checksums(backend, name, module):
    mod = pytest.importorskip(module)
    ext = backend.allocate(5 << 20)  # more than one 4 MiB chunk
    data = filled(ext.length)
    digest = backend.write(ext, data, checksum=name).result()
    if name == "crc32c":
        assert digest == mod.value(bytes(data))
    else:
        assert digest == mod.xxh64_intdigest(bytes(data))
    backend.read(ext, empty(ext.length), checksum=name, expect=digest).result()


def test_unknown_checksum_is_a_config_error(backend):
    ext = backend.allocate(4096)
    with pytest.raises(ConfigError, match=r"TBA_CHECKSUM='md5' is not a known checksum"):
        backend.write(ext, filled(4096), checksum="md5")


@pytest.mark.parametrize("name, package", [("crc32c", "google-crc32c"), ("xxh64", "xxhash")])
def test_missing_checksum_package_names_it(monkeypatch, name, package):
    monkeypatch.setitem(__import__("sys").modules, package.replace("-", "_"), None)
    checksum_fn.cache_clear()
    try:
        with pytest.raises(
            ConfigError,
            match=rf"TBA_CHECKSUM={name} needs the {package} package, which is not installed\. "
            rf"Run `pip install {package}`, or use TBA_CHECKSUM=crc32",
        ):
            checksum_fn(name)
    finally:
        checksum_fn.cache_clear()


def test_buffer_must_match_the_extent(backend):
    ext = backend.allocate(8192)
    with pytest.raises(
        ValueError, match=r"buffer of 4096 bytes for an extent of 8192 bytes; the buffer must be"
    ):
        backend.write(ext, filled(4096))


def test_io_on_a_freed_extent_is_refused(backend):
    ext = backend.allocate(4096)
    backend.free(ext)
    with pytest.raises(ValueError, match=r"I/O on an extent that is not allocated \(slab"):
        backend.read(ext, empty(ext.length))
    with pytest.raises(TBAError, match=r"double free"):
        backend.free(ext)


def test_foreign_extent_is_refused(backend):
    with pytest.raises(ValueError, match="not allocated"):
        backend.write(Extent(99, 0, 4096), filled(4096))


def test_unaligned_buffer_is_refused_under_o_direct(make_cfg):
    from tba.storage import open_backend

    with open_backend(make_cfg(backend="posix")) as b:
        ext = b.allocate(4096)
        raw = as_memoryview(aligned_empty(8192))
        with pytest.raises(ValueError, match=r"address 0x[0-9a-f]+ is not a multiple of 4096"):
            b.write(ext, raw[512 : 512 + 4096])


def test_close_waits_for_in_flight_io_and_refuses_later_use(backend):
    exts = [backend.allocate(256 * 1024) for _ in range(8)]
    futs = [backend.write(e, filled(e.length)) for e in exts]
    backend.close()
    assert all(f.done() and f.exception() is None for f in futs)
    backend.close()  # idempotent
    backend.free(exts[1])  # after close, free is a no-op (teardown order is not ours to fix)
    with pytest.raises(ValueError, match=r"closed"):
        backend.allocate(4096)
    with pytest.raises(ValueError, match=r"closed|not allocated"):
        backend.write(exts[0], filled(exts[0].length))


def test_negative_size_is_refused(backend):
    with pytest.raises(ValueError, match=r"tba\.storage: cannot allocate -1 bytes"):
        backend.allocate(-1)
