"""Real kvikio, host POSIX path, stand-in libcuda: tba's kvikio backend against the real library.

kvikio imports without an NVIDIA driver, but every transfer needs ``libcuda.so.1``. The stand-in
built here from tests/storage/stub_libcuda/libcuda_stub.c answers CUDA_ERROR_NOT_INITIALIZED,
which kvikio reads as "host memory": its real POSIX path (threads, task split, O_DIRECT, error
texts) then runs, and cuFile never does. Each test runs in a subprocess, since the driver
library has to be on LD_LIBRARY_PATH before the process starts.

Where kvikio comes from, first found: ``TBA_KVIKIO_SITE`` (a ``pip install --target`` folder),
``.kvikio-site`` in the checkout (``.ci/run`` makes it; docs/gpu.md, "kvikio on a CPU host"), or
the interpreter's own kvikio. Without one, or without gcc, every test here skips and says why.
The same checks of behaviour run against tests/storage/fake_kvikio.py too, so the fake cannot
drift from the library.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STUB = HERE / "stub_libcuda" / "libcuda_stub.c"
LABEL = "real kvikio, host POSIX path, stand-in libcuda"


# -- the environment: kvikio, the stand-in driver, a subprocess --------------------------------
def _site() -> Path | None:
    given = os.environ.get("TBA_KVIKIO_SITE")
    if given:
        return Path(given)
    local = ROOT / ".kvikio-site"
    return local if (local / "kvikio").is_dir() else None


def _library_dirs(site: Path | None) -> list[str]:
    """Where libcufile.so.0 lies in a --target install (cuda.pathfinder does not look there)."""
    if site is None:
        return []
    return sorted({str(p.parent) for p in site.glob("nvidia/*/lib/libcufile.so.0")})


@pytest.fixture(scope="module")
def real_env(tmp_path_factory):
    """The environment of a subprocess that runs real kvikio on the stand-in driver."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip(f"{LABEL}: no C compiler to build the stand-in libcuda.so.1")
    lib = tmp_path_factory.mktemp("stub_libcuda")
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-o", str(lib / "libcuda.so.1"), str(STUB)],
        check=True,
        capture_output=True,
    )
    site = _site()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [*([str(site)] if site else []), str(ROOT), os.environ.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(lib), *_library_dirs(site), os.environ.get("LD_LIBRARY_PATH", "")]
    ).rstrip(os.pathsep)
    env.pop("KVIKIO_COMPAT_MODE", None)
    probe = subprocess.run(
        [sys.executable, "-c", "import kvikio; print(kvikio.__version__)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        where = f"TBA_KVIKIO_SITE={site}" if site else "this interpreter"
        pytest.skip(
            f"{LABEL}: kvikio does not import from {where} ({last}); install it with "
            "`pip install --no-deps --target .kvikio-site kvikio-cu13 libkvikio-cu13 "
            "rapids-logger cuda-pathfinder 'nvidia-cufile>=1.15'` (docs/gpu.md)"
        )
    return env


def run_child(env, scenario: str, where: Path, *args: str) -> dict:
    """Run ``scenario`` of this file in a subprocess under ``env``; its JSON result."""
    proc = subprocess.run(
        [sys.executable, __file__, scenario, str(where), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"{scenario} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the tests ----------------------------------------------------------------------------------
def test_real_kvikio_probe_and_round_trips(real_env, tmp_path):
    """Real kvikio, host POSIX path, stand-in libcuda: probe, then 4 KiB / 200 KB / 3 MiB."""
    got = run_child(real_env, "round_trips", tmp_path)
    assert got["version"].startswith(("25.", "26.", "27.")), got
    assert got["reason"].startswith(f"kvikio: kvikio {got['version']} write+read probe passed")
    assert "compat mode (POSIX)" in got["reason"] and got["device_direct"] is False
    assert got["round_trips"] == {"4096": True, "200000": True, "3145728": True}
    assert got["crc_round_trip"] is True
    assert got["io_errors"] == 0
    assert not os.listdir(tmp_path / "spill")  # closed: nothing left on disk


def test_real_kvikio_host_reads_bypass_the_page_cache(real_env, tmp_path):
    """Real kvikio, host POSIX path, stand-in libcuda: with auto_direct_io_read on, a read
    leaves no page of the slab in the page cache (kvikio's default would fill it)."""
    got = run_child(real_env, "page_cache", tmp_path)
    if not got["o_direct"]:
        pytest.skip(f"{LABEL}: {got['fs']} does not open files with O_DIRECT")
    assert got["equal"] is True
    assert got["pages"] == 768 and got["resident_after_read"] == 0, got
    assert got["settings"] == {"auto_direct_io_read": True, "auto_direct_io_write": True}
    assert "host I/O through O_DIRECT" in got["reason"]


def test_real_kvikio_efbig_from_a_file_size_limit(real_env, tmp_path):
    """Real kvikio, host POSIX path, stand-in libcuda: RLIMIT_FSIZE makes pwrite fail with
    EFBIG; tba names the errno and quotes kvikio."""
    got = run_child(real_env, "efbig", tmp_path)
    assert got["errno"] == errno.EFBIG, got
    assert "POSIX error on pwrite: File too large" in got["message"]
    assert got["kept_reason"] == "io_error" and got["io_errors"] == 1


def test_real_kvikio_end_of_file_is_an_error(real_env, tmp_path):
    """Real kvikio, host POSIX path, stand-in libcuda: a slab cut short raises, never zeros."""
    got = run_child(real_env, "eof", tmp_path)
    assert got["errno"] == errno.EIO
    assert "Unexpected end of file" in got["message"]
    assert "POSIX error on pread: EOF" in got["message"]
    assert got["untouched"] is True  # the marker is still there past the end: no zero-fill


def test_real_kvikio_error_texts_map_to_their_errnos(real_env, tmp_path):
    """Real kvikio, host POSIX path, stand-in libcuda: ENOSPC (/dev/full), EBADF (a read-only
    or closed CuFile) from kvikio's own exceptions."""
    got = run_child(real_env, "errnos", tmp_path)
    if got.get("no_dev_full"):
        pytest.skip(f"{LABEL}: /dev/full is missing")
    assert got["enospc"] == errno.ENOSPC, got
    assert got["enospc_split"] == errno.ENOSPC, got
    assert got["ebadf_read_only"] == errno.EBADF, got
    assert got["ebadf_closed"] == errno.EBADF, got
    assert got["eof"] is True, got


def test_the_fake_behaves_like_real_kvikio(real_env, tmp_path):
    """Real kvikio, host POSIX path, stand-in libcuda, and tests/storage/fake_kvikio.py answer
    the same calls the same way (texts without kvikio's source locations)."""
    real = run_child(real_env, "contract", tmp_path / "real", "real")
    fake = run_child(real_env, "contract", tmp_path / "fake", "fake")
    assert real == fake
    assert real["defaults"]["gds_threshold"] == 16 << 10


# -- what the subprocess runs -------------------------------------------------------------------
def _backend(where: Path, **kw):
    from tba.config import Config
    from tba.storage.kvikio import KvikioBackend

    fields = {
        "spill_dir": str(where / "spill"),
        "slab_bytes": "4MiB",
        "min_free_bytes": 0,
        "io_threads": 4,
        "gds_task_bytes": "1MiB",  # 3 MiB transfers take three tasks
        "environ": {},
    }
    fields.update(kw)
    return KvikioBackend(Config(**fields))


def _buffers(n: int):
    from tba.host.memory import aligned_empty, as_memoryview

    src = as_memoryview(aligned_empty(n))
    src[:] = os.urandom(n)
    dst = as_memoryview(aligned_empty(n))
    dst[:] = b"\xa5" * n
    return src, dst


def _round_trips(where: Path) -> dict:
    import kvikio

    with _backend(where) as b:
        trips = {}
        for n in (4096, 200_000, 3 << 20):
            ext = b.allocate(n)
            src, dst = _buffers(ext.length)
            b.write(ext, src).result()
            b.read(ext, dst).result()
            trips[str(n)] = bytes(src) == bytes(dst)
        ext = b.allocate(3 << 20)
        src, dst = _buffers(ext.length)
        digest = b.write(ext, src, "crc32").result()
        b.read(ext, dst, "crc32", digest).result()
        out = {
            "version": kvikio.__version__,
            "reason": b.reason,
            "device_direct": b.device_direct,
            "round_trips": trips,
            "crc_round_trip": bytes(src) == bytes(dst),
            "io_errors": b.usage()["io_errors"],
        }
    return out


def _resident_pages(fd: int, offset: int, length: int) -> int:
    """How many pages of ``fd``'s range are in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    addr = libc.mmap(None, length, 1, 1, fd, offset)  # PROT_READ, MAP_SHARED
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    try:
        vec = (ctypes.c_ubyte * (length // 4096))()
        if libc.mincore(addr, length, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(v & 1 for v in vec)
    finally:
        libc.munmap(addr, length)


def _page_cache(where: Path) -> dict:
    import kvikio.defaults

    with _backend(where) as b:
        ext = b.allocate(3 << 20)
        src, dst = _buffers(ext.length)
        b.write(ext, src).result()
        fd = b._slabs.slabs[ext.slab].fd
        os.posix_fadvise(fd, ext.offset, ext.length, os.POSIX_FADV_DONTNEED)
        b.read(ext, dst).result()
        return {
            "fs": b.fs,
            "o_direct": _opens_direct(fd),
            "reason": b.reason,
            "settings": {
                k: bool(kvikio.defaults.get(k))
                for k in ("auto_direct_io_read", "auto_direct_io_write")
            },
            "equal": bytes(src) == bytes(dst),
            "pages": ext.length // 4096,
            "resident_after_read": _resident_pages(fd, ext.offset, ext.length),
        }


def _opens_direct(fd: int) -> bool:
    try:
        os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    return True


def _efbig(where: Path) -> dict:
    import resource
    import signal

    from tba.errors import StorageError
    from tba.records.reasons import kept_reason_for

    with _backend(where) as b:
        first = b.allocate(1 << 20)
        ext = b.allocate(1 << 20)  # beyond the limit set below: the slab is already allocated
        assert ext.offset >= first.offset + first.length
        src, _ = _buffers(ext.length)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel's SIGXFSZ ends us
        resource.setrlimit(resource.RLIMIT_FSIZE, (ext.offset, resource.RLIM_INFINITY))
        try:
            b.write(ext, src).result()
        except StorageError as e:
            got = {"errno": e.errno, "message": str(e), "kept_reason": kept_reason_for(e.errno)}
        else:
            got = {"errno": None, "message": "no error", "kept_reason": None}
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (-1, -1))
        got["io_errors"] = b.usage()["io_errors"]
        return got


def _eof(where: Path) -> dict:
    from tba.errors import StorageError

    with _backend(where) as b:
        ext = b.allocate(3 << 20)
        src, dst = _buffers(ext.length)
        b.write(ext, src).result()
        os.ftruncate(b._slabs.slabs[ext.slab].fd, ext.offset + (1 << 20))
        try:
            b.read(ext, dst).result()
        except StorageError as e:
            got = {"errno": e.errno, "message": str(e)}
        else:
            got = {"errno": None, "message": "no error"}
        got["untouched"] = bytes(dst[(2 << 20) :]) == b"\xa5" * (ext.length - (2 << 20))
        return got


def _errnos(where: Path) -> dict:
    import kvikio
    import numpy as np

    from tba.storage._kvikio_api import _errno_of, _is_eof

    if not os.path.exists("/dev/full"):
        return {"no_dev_full": True}

    def failure(fn) -> BaseException:
        try:
            fn()
        except Exception as e:
            return e
        raise AssertionError("no error")

    buf = np.zeros(1 << 20, dtype=np.uint8)  # kept alive for every task (kvikio keeps none)
    full = kvikio.CuFile("/dev/full", "r+")
    out = {
        "enospc": _errno_of(failure(lambda: full.pwrite(buf, 4096).get())),
        "enospc_split": _errno_of(failure(lambda: full.pwrite(buf, task_size=1 << 16).get())),
    }
    full.close()
    path = where / "small"
    where.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * 8192)
    ro = kvikio.CuFile(path, "r")
    out["ebadf_read_only"] = _errno_of(failure(lambda: ro.pwrite(buf, 4096).get()))
    out["eof"] = _is_eof(failure(lambda: ro.pread(buf, 16384).get()))
    ro.close()
    out["ebadf_closed"] = _errno_of(failure(lambda: ro.pread(buf, 4096).get()))
    return out


_LOCATION = re.compile(r" at: [^ ]+:\d+: ")


def _answer(fn) -> list:
    try:
        value = fn()
    except Exception as e:
        return [type(e).__name__, _LOCATION.sub(" at: <where>: ", str(e))]
    return ["ok", value]


def _contract(where: Path, which: str) -> dict:
    """The same calls against the real kvikio or the fake; what each answers."""
    import numpy as np

    if which == "real":
        import kvikio
        import kvikio.defaults

        defaults = kvikio.defaults
    else:
        sys.path.insert(0, str(HERE))
        from fake_kvikio import FakeKvikio

        kvikio = FakeKvikio()
        defaults = kvikio.defaults
    where.mkdir(parents=True, exist_ok=True)
    path = where / "data"
    path.write_bytes(bytes(range(256)) * 64)  # 16 KiB
    buf = np.zeros(1 << 16, dtype=np.uint8)
    f = kvikio.CuFile(path, "r+")
    out: dict = {
        "defaults": {
            k: defaults.get(k)
            for k in ("gds_threshold", "auto_direct_io_read", "auto_direct_io_write")
        }
    }
    out["read_whole"] = _answer(lambda: f.pread(buf, 16384, 0, 4096).get())
    out["bytes_right"] = bytes(buf[:16384]) == path.read_bytes()
    out["read_past_eof"] = _answer(lambda: f.pread(buf, 8192, 12288).get())
    out["read_at_eof"] = _answer(lambda: f.pread(buf, 4096, 16384).get())
    out["size_over_buffer"] = _answer(lambda: f.pread(buf, 1 << 17))
    out["negative_offset"] = _answer(lambda: f.pwrite(buf, 4096, -1))
    fut = f.pwrite(buf, 1 << 16, 0, 4096)
    out["write_split"] = _answer(fut.get)
    out["done_after_get"] = _answer(fut.done)
    out["get_twice"] = _answer(fut.get)
    f.close()
    out["closed_read"] = _answer(lambda: f.pread(buf, 4096).get())
    ro = kvikio.CuFile(path, "r")
    out["write_read_only"] = _answer(lambda: ro.pwrite(buf, 4096).get())
    ro.close()
    out["open_missing"] = _answer(lambda: kvikio.CuFile(where / "missing", "r"))
    out["open_append"] = _answer(lambda: kvikio.CuFile(path, "a"))
    out["open_unknown"] = _answer(lambda: kvikio.CuFile(path, "x"))
    short = where / "short"
    short.write_bytes(b"y" * 10000)
    out["read_split_past_eof"] = _answer(lambda: kvikio_read(kvikio, short, buf, 32768, 4096))
    if os.path.exists("/dev/full"):
        full = kvikio.CuFile("/dev/full", "r+")
        out["write_full"] = _answer(lambda: full.pwrite(buf, 4096).get())
        out["write_full_split"] = _answer(lambda: full.pwrite(buf, 1 << 16, 0, 4096).get())
        full.close()
    out["open_w_truncates"] = [kvikio.CuFile(path, "w").close(), os.path.getsize(path)]
    return out


def kvikio_read(kvikio, path: Path, buf, size: int, task_size: int) -> int:
    f = kvikio.CuFile(path, "r")
    try:
        return f.pread(buf, size, 0, task_size).get()
    finally:
        f.close()


_SCENARIOS = {
    "round_trips": _round_trips,
    "page_cache": _page_cache,
    "efbig": _efbig,
    "eof": _eof,
    "errnos": _errnos,
    "contract": _contract,
}

if __name__ == "__main__":
    name, where, *rest = sys.argv[1:]
    result = _SCENARIOS[name](Path(where), *rest)
    print(json.dumps(result, default=str))
