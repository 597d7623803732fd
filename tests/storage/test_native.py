"""The native engine (native/tba_engine.c) behind NativeBackend, in io_uring and threads modes.

Faults are injected by the engine itself (``NativeBackend.inject``): a short transfer really
submits fewer bytes, so the engine's own resubmission runs; a failure travels through the ring
as a NOP whose result the engine replaces.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from storage_util import empty, filled

from tba.errors import StorageError
from tba.host.memory import aligned_empty, as_memoryview
from tba.storage import Backend
from tba.storage.native import NativeBackend, NativeUnavailable, engine_status
from tba.storage.posix import PosixBackend

STATUS = engine_status()
needs_engine = pytest.mark.skipif(
    not STATUS["built"], reason=f"needs the native engine; {STATUS['build_error']}"
)
MODES = [
    pytest.param(
        "io_uring",
        marks=pytest.mark.skipif(not STATUS["io_uring"], reason=STATUS["io_uring_reason"]),
    ),
    "threads",
]
KIB, MIB = 1 << 10, 1 << 20
REPO = Path(__file__).resolve().parents[2]


def open_native(cfg, mode: str, **kw) -> NativeBackend:
    """io_uring when it works here; "threads" simulates io_uring_setup failing with EPERM."""
    b = NativeBackend(cfg, _setup_errno=errno.EPERM if mode == "threads" else None, **kw)
    assert b.kind == mode
    return b


@pytest.fixture(params=MODES)
def native(request, make_cfg):
    if not STATUS["built"]:
        pytest.skip(f"needs the native engine; {STATUS['build_error']}")
    b = open_native(make_cfg(io_depth=16), request.param)
    yield b
    b.close()


def on_disk(backend, extent) -> bytes:
    """The extent's bytes as the file holds them, read around the engine (O_DIRECT fd)."""
    slab = backend._slabs.slabs[extent.slab]
    back = as_memoryview(aligned_empty(extent.length))
    assert os.preadv(slab.fd, [back], extent.offset) == extent.length
    return bytes(back)


def os_threads() -> set[int]:
    """This process's kernel threads (their ids), less io_uring's own workers (they come and
    go)."""
    tids = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except FileNotFoundError:
            continue
        if not name.startswith("iou-"):
            tids.add(int(tid))
    return tids


def open_fds() -> set[tuple[int, str]]:
    """This process's open descriptors, each with what it points at (a number alone can be
    closed and reused in between)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((int(fd), os.readlink(f"/proc/self/fd/{fd}")))
        except FileNotFoundError:
            continue  # the listing's own descriptor, or one closed meanwhile
    return out


def py_threads() -> set[int]:
    return {id(t) for t in threading.enumerate()}


def leaked(before: set, now, timeout: float = 5.0) -> set:
    """What ``now()`` holds that ``before`` did not, once that is nothing (threads exit a moment
    after join returns) or ``timeout`` passed. Set-wise, so that a thread or descriptor an
    earlier test left to finish, and which ends meanwhile, cannot hide one this test leaked or
    fail a test that leaked nothing."""
    deadline = time.monotonic() + timeout
    new = now() - before
    while new and time.monotonic() < deadline:
        time.sleep(0.05)
        new = now() - before
    return new


# -- engine_status ---------------------------------------------------------------------------
def test_engine_status_keys_and_types():
    s = engine_status()
    assert set(s) == {
        "built",
        "library",
        "build_error",
        "io_uring",
        "io_uring_reason",
        "memlock_bytes",
    }
    assert isinstance(s["built"], bool) and isinstance(s["io_uring"], bool)
    assert isinstance(s["io_uring_reason"], str) and s["io_uring_reason"]
    assert s["memlock_bytes"] is None or isinstance(s["memlock_bytes"], int)
    assert engine_status() is s  # cached per process
    if s["built"]:
        assert s["build_error"] is None and Path(s["library"]).is_file()
    else:
        assert s["library"] is None and "Reinstall tba" in s["build_error"]
        assert not s["io_uring"]
    if s["io_uring"]:
        assert s["io_uring_reason"].startswith("io_uring: a ")
    elif s["built"]:
        assert s["io_uring_reason"].startswith(("io_uring_setup: E", "mmap", "IORING"))


def test_missing_library_is_reported_and_import_stays_quiet(tmp_path):
    """A tba without its engine: imports silently, reports why, and refuses NativeBackend."""
    shutil.copytree(
        REPO / "tba", tmp_path / "tba", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    script = textwrap.dedent(
        """
        import json, logging, tba
        from tba.config import Config
        from tba.storage import open_backend
        from tba.storage.native import NativeBackend, NativeUnavailable, engine_status
        try:
            NativeBackend(Config(spill_dir=SPILL, environ={}))
        except NativeUnavailable as e:
            refused = str(e)
        warnings = []
        handler = logging.Handler()
        handler.emit = lambda r: warnings.append(r.getMessage())
        handler.setLevel(logging.WARNING)
        logging.getLogger("tba.storage").addHandler(handler)
        names = []
        for _ in range(2):  # auto falls back to posix, and says why once
            b = open_backend(Config(spill_dir=SPILL, min_free_bytes=0, environ={}))
            names.append(b.name)
            b.close()
        print(json.dumps([tba.__file__, engine_status(), refused, names, warnings]))
        """
    ).replace("SPILL", repr(str(tmp_path / "spill")))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    where, status, refused, names, warnings = json.loads(run.stdout)
    assert names == ["posix", "posix"]
    assert len(warnings) == 1
    assert warnings[0].startswith("tba.storage: native probe failed (the native engine")
    assert warnings[0].endswith("; using the posix backend instead")
    assert where == str(tmp_path / "tba" / "__init__.py")
    assert status["built"] is False and status["library"] is None and not status["io_uring"]
    assert "not built" in status["build_error"] and "C compiler" in status["build_error"]
    assert "pip install" in status["build_error"]
    assert refused.startswith("tba.storage: the native engine")
    assert "Reinstall tba where a C compiler is available" in refused


# -- the Backend protocol --------------------------------------------------------------------
@needs_engine
def test_implements_the_protocol(native, make_cfg):
    assert isinstance(native, Backend)
    assert native.name == "native" and native.alignment % 4096 == 0
    assert native.depth == 16
    with PosixBackend(make_cfg()) as posix:
        assert native.usage().keys() == posix.usage().keys()
    text = native.reason
    assert text.startswith("native: ") and "O_DIRECT write+read probe passed" in text
    if native.kind == "io_uring":
        assert "io_uring engine, depth 16" in text and native.registered_files
        assert "registered slab files" in text
    else:
        assert "thread engine with 16 threads (io_uring_setup: EPERM" in text
        assert not native.registered_files and not native.registered_buffers


@needs_engine
def test_round_trip_and_usage(native):
    ext = native.allocate(100_000)
    data = filled(ext.length)
    assert native.write(ext, data).result() is None
    back = empty(ext.length)
    assert native.read(ext, back).result() is None
    assert back == data and on_disk(native, ext) == bytes(data)
    u = native.usage()
    assert (u["writes"], u["reads"], u["bytes_written"], u["bytes_read"]) == (
        1,
        1,
        ext.length,
        ext.length,
    )
    assert u["io_errors"] == 0


@needs_engine
def test_refuses_what_posix_refuses(native):
    ext = native.allocate(4096)
    raw = as_memoryview(aligned_empty(8192))
    with pytest.raises(ValueError, match=r"address 0x[0-9a-f]+ is not a multiple of 4096"):
        native.write(ext, raw[512 : 512 + 4096])
    with pytest.raises(ValueError, match=r"buffer of 8192 bytes for an extent of 4096"):
        native.write(ext, filled(8192))
    with pytest.raises(ValueError, match=r"read\(\) needs a writable buffer"):
        native.read(ext, filled(4096).toreadonly())
    native.free(ext)
    with pytest.raises(ValueError, match=r"not allocated"):
        native.read(ext, empty(4096))


# -- the same bytes as posix -----------------------------------------------------------------
def random_size(rng: random.Random) -> int:
    """4 KiB .. 4 MiB, log-uniform, in 4 KiB pages."""
    return 4096 * round(2 ** rng.uniform(0, 10))


@needs_engine
@pytest.mark.parametrize("mode", MODES)
def test_matches_posix_on_random_extents(make_cfg, mode):
    """Several hundred random writes, overwrites, reads and frees, submitted from 4 threads at
    once, give the same bytes through native as through posix, and on disk."""
    rng = random.Random(1234)
    cfg = make_cfg(slab_bytes="8MiB", io_depth=16)
    native = open_native(cfg, mode)
    posix = PosixBackend(cfg)
    pool = ThreadPoolExecutor(4)
    try:
        live: list[tuple] = []  # (native extent, posix extent, expected bytes)
        busy: dict[int, list] = {}  # extent index -> its writes in flight (never two at once)

        def settle(i: int) -> None:
            for f in busy.pop(i, []):
                f.result().result(timeout=60)

        def put(i: int, data: memoryview) -> None:
            settle(i)
            n_ext, p_ext, _ = live[i]
            busy[i] = [
                pool.submit(native.write, n_ext, data),
                pool.submit(posix.write, p_ext, data),
            ]
            live[i] = (n_ext, p_ext, data)

        for i in range(120):
            n = random_size(rng)
            live.append((native.allocate(n), posix.allocate(n), None))
            put(i, filled(n))
        for _ in range(240):
            i = rng.randrange(len(live))
            action = rng.random()
            if action < 0.4:
                put(i, filled(live[i][0].length))
            elif action < 0.8:
                settle(i)  # a read sees the write before it; others stay in flight
                n_ext, p_ext, data = live[i]
                nb, pb = empty(n_ext.length), empty(p_ext.length)
                fn, fp = pool.submit(native.read, n_ext, nb), pool.submit(posix.read, p_ext, pb)
                fn.result().result(timeout=60)
                fp.result().result(timeout=60)
                assert nb == pb == data
            else:
                settle(i)
                native.free(live[i][0])
                posix.free(live[i][1])
                n = random_size(rng)
                live[i] = (native.allocate(n), posix.allocate(n), None)
                put(i, filled(n))
        for i in list(busy):
            settle(i)
        reads = []
        for n_ext, p_ext, data in live:
            nb, pb = empty(n_ext.length), empty(p_ext.length)
            reads.append((native.read(n_ext, nb), posix.read(p_ext, pb), nb, pb, data, n_ext))
        for fn, fp, nb, pb, data, n_ext in reads:
            fn.result(timeout=60)
            fp.result(timeout=60)
            assert nb == pb == data
            assert on_disk(native, n_ext) == bytes(data)
        nu, pu = native.usage(), posix.usage()
        for key in ("writes", "reads", "bytes_written", "bytes_read", "disk_bytes_in_use"):
            assert nu[key] == pu[key], key
        assert nu["io_errors"] == 0
    finally:
        pool.shutdown()
        native.close()
        posix.close()


# -- short transfers -------------------------------------------------------------------------
@needs_engine
@pytest.mark.parametrize("op", ["write", "read"])
def test_short_transfers_are_resubmitted(native, op):
    ext = native.allocate(64 * KIB)
    data = filled(ext.length)
    before = native.engine_info()["resubmit_short"]
    if op == "write":
        native.inject("write", "short", count=3)  # one 4 KiB page at a time, three times
        native.write(ext, data).result()
        assert on_disk(native, ext) == bytes(data)
    else:
        native.write(ext, data).result()
        native.inject("read", "short", count=15)  # page by page, then the last one
        back = empty(ext.length)
        native.read(ext, back).result()
        assert back == data
    info = native.engine_info()
    assert info["resubmit_short"] - before == (3 if op == "write" else 15)


@needs_engine
def test_short_report_below_the_dio_unit_resumes_from_an_aligned_offset(native):
    """The device moved a page but reports 100 bytes: resubmit from offset 0, never from 100."""
    ext = native.allocate(64 * KIB)
    data = filled(ext.length)
    native.inject("write", "short", count=1, nbytes=100)
    native.write(ext, data).result()
    assert on_disk(native, ext) == bytes(data)
    native.inject("read", "short", count=2, nbytes=100)
    back = empty(ext.length)
    native.read(ext, back).result()
    assert back == data


@needs_engine
def test_write_without_progress_fails(native):
    ext = native.allocate(8192)
    native.inject("write", "short", count=50, nbytes=0)
    with pytest.raises(
        StorageError,
        match=r"write of 8192 bytes at offset 0 in .*/slab-0 \(unlinked\) failed: EIO "
        r"\(Input/output error\)\. The device made no progress in 8 attempts\.",
    ):
        native.write(ext, filled(8192)).result()
    native.inject("write", "clear")
    assert native.usage()["io_errors"] == 1


@needs_engine
@pytest.mark.parametrize("served", [0, 4096])
def test_end_of_file_is_an_error_never_zeros(native, served):
    ext = native.allocate(8192)
    data = filled(8192)
    native.write(ext, data).result()
    if served:
        native.inject("read", "short", count=1, nbytes=served)
    native.inject("read", "short", count=1, nbytes=0)  # the kernel says: end of file
    back = empty(8192)
    with pytest.raises(
        StorageError,
        match=rf"read of {8192 - served} bytes at offset {served} in .* failed: EIO "
        r"\(Input/output error\)\. Unexpected end of file: .* Nothing was zero-filled",
    ):
        native.read(ext, back).result()
    assert bytes(back[served:]) == b"\xa5" * (8192 - served)  # nothing was made up


# -- errors ----------------------------------------------------------------------------------
@needs_engine
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize(
    "code, text",
    [
        (errno.EIO, r"EIO \(Input/output error\)\. The device reported an I/O error"),
        (errno.ENOSPC, r"ENOSPC \(No space left on device\)\. Free space on the spill"),
    ],
)
def test_injected_error_names_file_offset_bytes_errno(native, op, code, text):
    native.allocate(4096)  # so the failing extent is not at offset 0
    ext = native.allocate(8192)
    data = filled(8192)
    native.write(ext, data).result()
    native.inject(op, "fail", errno=code)
    back = empty(8192)
    fut = native.write(ext, data) if op == "write" else native.read(ext, back)
    with pytest.raises(
        StorageError,
        match=rf"^tba\.storage: {op} of 8192 bytes at offset 4096 in "
        rf"{native.spill_path}/slab-0 \(unlinked\) failed: {text}",
    ) as info:
        fut.result()
    e, shown = info.value, f"{native.spill_path}/slab-0 (unlinked)"
    got = (isinstance(e, OSError), e.errno, e.filename, e.offset, e.nbytes, e.op)
    assert got == (True, code, shown, 4096, 8192, op)
    assert native.usage()["io_errors"] == 1
    if op == "read":
        assert bytes(back) == b"\xa5" * 8192  # a failed read never hands back zeros
    # the next op is not affected
    native.read(ext, back).result()
    assert back == data


@needs_engine
def test_error_after_a_short_transfer_names_where_it_stopped(native):
    ext = native.allocate(64 * KIB)
    native.inject("write", "short", count=1, nbytes=8192)
    native.inject("write", "fail", errno=errno.EIO)
    with pytest.raises(StorageError, match=r"write of 57344 bytes at offset 8192 in") as info:
        native.write(ext, filled(ext.length)).result()
    assert (info.value.offset, info.value.nbytes, info.value.errno) == (8192, 57344, errno.EIO)


@needs_engine
def test_eagain_is_retried_a_bounded_number_of_times(native):
    ext = native.allocate(4096)
    data = filled(4096)
    native.inject("write", "fail", count=3, errno=errno.EAGAIN)
    native.write(ext, data).result()
    assert native.engine_info()["resubmit_again"] == 3
    native.inject("read", "fail", count=100, errno=errno.EAGAIN)
    with pytest.raises(StorageError, match=r"failed: EAGAIN .* Still EAGAIN after 17 attempts"):
        native.read(ext, empty(4096)).result()
    native.inject("read", "clear")
    back = empty(4096)
    native.read(ext, back).result()
    assert back == data


@needs_engine
def test_inject_validates_its_arguments(native):
    with pytest.raises(ValueError, match=r"unknown op or kind"):
        native.inject("fsync", "fail", errno=errno.EIO)
    with pytest.raises(ValueError, match=r"needs errno > 0"):
        native.inject("write", "fail")
    for _ in range(8):
        native.inject("write", "short")
    with pytest.raises(ValueError, match=r"inject refused: ENOSPC"):
        native.inject("write", "short")
    native.inject("write", "clear")


# -- io_uring setup failing ------------------------------------------------------------------
@needs_engine
def test_simulated_eperm_falls_back_to_threads(make_cfg):
    with NativeBackend(make_cfg(io_depth=4), _setup_errno=errno.EPERM) as b:
        assert b.kind == "threads" and b.depth == 4
        assert "io_uring_setup: EPERM (blocked by a seccomp profile" in b.reason
        assert "EPERM" in b.ring_reason
        assert b.engine_info()["threads"] == 4
        ext = b.allocate(4096)
        data = filled(4096)
        b.write(ext, data).result()
        back = empty(4096)
        b.read(ext, back).result()
        assert back == data


@needs_engine
@pytest.mark.parametrize("code, name", [(errno.EPERM, "EPERM"), (errno.ENOSYS, "ENOSYS")])
def test_require_ring_refuses_the_thread_fallback(make_cfg, code, name):
    fds, threads = open_fds(), os_threads()
    with pytest.raises(
        NativeUnavailable,
        match=rf"io_uring is required but unavailable: "
        rf"io_uring_setup: {name} ",
    ) as info:
        NativeBackend(make_cfg(), require_ring=True, _setup_errno=code)
    assert isinstance(info.value, OSError) and info.value.errno == code
    assert "kernel.io_uring_disabled=0" in str(info.value)
    assert leaked(fds, open_fds) == set()
    assert leaked(threads, os_threads) == set()
    spill = make_cfg().spill_dir
    assert not os.path.exists(spill) or os.listdir(spill) == []


@needs_engine
@pytest.mark.skipif(not STATUS["io_uring"], reason=STATUS["io_uring_reason"])
def test_require_ring_when_the_ring_works(make_cfg):
    with NativeBackend(make_cfg(), require_ring=True) as b:
        assert b.kind == "io_uring"


# -- registered buffers and files ------------------------------------------------------------
@needs_engine
def test_registered_and_unregistered_buffers_both_work(native):
    arena_t = aligned_empty(2 * MIB)
    registered = native.register(arena_t)
    assert registered == (native.kind == "io_uring")
    assert native.registered_buffers == registered
    if registered:
        assert "1 registered buffer region(s) of 2.0 MiB" in native.reason
    else:
        assert "the thread engine has nothing to register buffers with" in native.buffer_reason
    arena = as_memoryview(arena_t)
    exts = [native.allocate(256 * KIB) for _ in range(8)]
    inside = [arena[i * 256 * KIB : (i + 1) * 256 * KIB] for i in range(8)]
    outside = [filled(256 * KIB) for _ in range(8)]
    for view, src in zip(inside, outside):
        view[:] = src
    before = native.engine_info()
    futs = [native.write(e, v) for e, v in zip(exts[:4], inside[:4])]
    futs += [native.write(e, v) for e, v in zip(exts[4:], outside[4:])]
    for f in futs:
        f.result()
    after = native.engine_info()
    if registered:
        assert after["ops_fixed"] - before["ops_fixed"] == 4
        assert after["ops_plain"] - before["ops_plain"] == 4
    for i, e in enumerate(exts):
        assert on_disk(native, e) == bytes(outside[i])
    # read back into the arena (fixed) and into plain buffers
    for view in inside:
        view[:] = b"\xa5" * len(view)
    backs = [empty(256 * KIB) for _ in range(8)]
    futs = [native.read(e, v) for e, v in zip(exts, inside)]
    futs += [native.read(e, b) for e, b in zip(exts, backs)]
    for f in futs:
        f.result()
    for i in range(8):
        assert inside[i] == outside[i] and backs[i] == outside[i]
    assert native.unregister(arena_t) == registered
    assert not native.registered_buffers
    native.read(exts[0], inside[0]).result()
    assert inside[0] == outside[0]


@needs_engine
@pytest.mark.skipif(not STATUS["io_uring"], reason=STATUS["io_uring_reason"])
def test_memlock_refusal_falls_back_with_a_reason(make_cfg):
    """Deterministic: the engine is told the kernel said ENOMEM."""
    with NativeBackend(make_cfg()) as b:
        b.inject("register", "fail", errno=errno.ENOMEM)
        arena_t = aligned_empty(4 * MIB)
        assert b.register(arena_t) is False
        assert not b.registered_buffers
        assert b.buffer_reason.startswith("IORING_REGISTER_BUFFERS: ENOMEM: pinning 4.0 MiB")
        assert "RLIMIT_MEMLOCK" in b.buffer_reason and "CAP_IPC_LOCK" in b.buffer_reason
        assert "unregistered buffers (IORING_REGISTER_BUFFERS: ENOMEM" in b.reason
        ext = b.allocate(MIB)
        arena = as_memoryview(arena_t)
        arena[:MIB] = filled(MIB)
        b.write(ext, arena[:MIB]).result()
        back = empty(MIB)
        b.read(ext, back).result()
        assert back == arena[:MIB]
        assert b.register(arena_t) is True  # the kernel may accept it later


def _have_cap_ipc_lock() -> bool:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 14 & 1)
    return False


@needs_engine
@pytest.mark.skipif(not STATUS["io_uring"], reason=STATUS["io_uring_reason"])
def test_buffer_larger_than_memlock(make_cfg):
    """64 MiB against RLIMIT_MEMLOCK (8 MiB here): refused with ENOMEM unless the process may
    lock memory anyway (CAP_IPC_LOCK, e.g. root), and the I/O works either way."""
    limit = STATUS["memlock_bytes"]
    with NativeBackend(make_cfg(slab_bytes="16MiB")) as b:
        arena_t = aligned_empty(64 * MIB)
        ok = b.register(arena_t)
        if limit is None or limit >= 64 * MIB or _have_cap_ipc_lock():
            assert ok, b.buffer_reason
        else:
            assert not ok and "ENOMEM" in b.buffer_reason and "RLIMIT_MEMLOCK" in b.buffer_reason
        arena = as_memoryview(arena_t)
        ext = b.allocate(16 * MIB)
        arena[-16 * MIB :] = filled(16 * MIB)
        b.write(ext, arena[-16 * MIB :]).result()
        back = empty(16 * MIB)
        b.read(ext, back).result()
        assert back == arena[-16 * MIB :]


_NO_IPC_LOCK = """
import ctypes, json, sys
from tba.host.memory import aligned_empty, as_memoryview
from tba.config import Config
from tba.storage.native import NativeBackend

class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]

libc = ctypes.CDLL(None, use_errno=True)
header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
if libc.capget(ctypes.byref(header), data) != 0:
    sys.exit(3)
data[0].effective &= ~(1 << 14)  # CAP_IPC_LOCK
data[0].permitted &= ~(1 << 14)
if libc.capset(ctypes.byref(header), data) != 0:
    sys.exit(3)
with NativeBackend(Config(spill_dir=sys.argv[1], slab_bytes="16MiB", min_free_bytes=0,
                          environ={})) as b:
    arena_t = aligned_empty(64 << 20)
    ok = b.register(arena_t)
    arena = as_memoryview(arena_t)
    ext = b.allocate(16 << 20)
    arena[: 16 << 20] = bytes(range(256)) * (1 << 16)
    b.write(ext, arena[: 16 << 20]).result()
    back = as_memoryview(aligned_empty(16 << 20))
    b.read(ext, back).result()
    print(json.dumps([ok, b.buffer_reason, back == arena[: 16 << 20], b.reason]))
"""


@needs_engine
@pytest.mark.skipif(not STATUS["io_uring"], reason=STATUS["io_uring_reason"])
@pytest.mark.skipif(
    STATUS["memlock_bytes"] is None or STATUS["memlock_bytes"] >= 64 * MIB,
    reason="RLIMIT_MEMLOCK is not below 64 MiB here",
)
def test_buffer_larger_than_memlock_without_cap_ipc_lock(tmp_path):
    """The real kernel refusal: a child without CAP_IPC_LOCK registers 64 MiB."""
    run = subprocess.run(
        [sys.executable, "-c", _NO_IPC_LOCK, str(tmp_path / "spill")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if run.returncode == 3:
        pytest.skip("capget/capset is not available to drop CAP_IPC_LOCK")
    assert run.returncode == 0, run.stderr
    ok, why, same, reason = json.loads(run.stdout)
    assert ok is False and same is True
    assert why.startswith("IORING_REGISTER_BUFFERS: ENOMEM: pinning 64.0 MiB would exceed ")
    assert "RLIMIT_MEMLOCK (8.0 MiB" in why or "RLIMIT_MEMLOCK" in why
    assert "unregistered buffers" in reason


@needs_engine
@pytest.mark.skipif(not STATUS["io_uring"], reason=STATUS["io_uring_reason"])
def test_a_file_the_table_refuses_goes_by_its_plain_fd(make_cfg):
    with NativeBackend(make_cfg()) as b:
        b.inject("files", "fail", errno=errno.ENFILE)
        ext = b.allocate(4096)  # slab-0: its first I/O adds it to the engine
        data = filled(4096)
        b.write(ext, data).result()
        info = b.engine_info()
        assert (info["files_registered"], info["files_plain"]) == (0, 1)
        assert "registered slab files, 1 by plain fd (ENFILE)" in b.probe_summary()
        back = empty(4096)
        b.read(ext, back).result()
        assert back == data


@needs_engine
def test_closed_slabs_leave_the_engine(native):
    native._slabs.max_disk_bytes = 2 * MIB
    small = native.allocate(4096)
    native.write(small, filled(4096)).result()
    native.free(small)
    big = native.allocate(2 * MIB)  # the empty 1 MiB slab is closed to make room
    assert native.usage()["slabs"] == 1
    data = filled(2 * MIB)
    native.write(big, data).result()
    back = empty(2 * MIB)
    native.read(big, back).result()
    assert back == data
    info = native.engine_info()
    assert info["files_registered"] + info["files_plain"] == 1


@needs_engine
@pytest.mark.parametrize("mode", MODES)
def test_slabs_given_back_to_the_node_quota_leave_the_engine(make_cfg, mode):
    """NOTE [Slabs] 6: a free that empties a slab owed to another rank closes it, and its
    engine file goes with it (before the ledger says so), or its blocks would stay allocated."""
    cfg = make_cfg(io_depth=16, node_max_disk_bytes="2MiB")
    a = open_native(cfg, mode)
    try:
        with PosixBackend(cfg) as other:
            held = [a.allocate(MIB), a.allocate(MIB)]
            for ext in held:
                a.write(ext, filled(MIB)).result()  # each slab gets its engine file
            assert other.allocate(MIB) is None  # refused below its share: it wants space
            info = a.engine_info()
            assert info["files_registered"] + info["files_plain"] == 2
            for ext in held:
                a.free(ext)  # the first free gives one slab back: a keeps its share
            assert a.usage()["slabs"] == 1
            info = a.engine_info()
            assert info["files_registered"] + info["files_plain"] == 1
            assert other.allocate(MIB) is not None
    finally:
        a.close()


# -- checksums -------------------------------------------------------------------------------
@needs_engine
def test_crc32_over_native(native):
    """write resolves to the crc32 digest and read verifies it; a wrong expectation, or a bit
    that rots on disk, is EBADMSG naming the extent."""
    ext = native.allocate(50_000)
    data = filled(ext.length)
    digest = native.write(ext, data, checksum="crc32").result()
    back = empty(ext.length)
    assert native.read(ext, back, checksum="crc32", expect=digest).result() is None
    assert (digest, back) == (zlib.crc32(data), data)
    mismatch = (
        r"read of 53248 bytes at offset 0 in .*/slab-0 \(unlinked\) failed: EBADMSG \(Bad "
        r"message\)\. Checksum crc32 mismatch: expected 0x[0-9a-f]+, got 0x[0-9a-f]+\. The "
        r"spilled bytes were corrupted"
    )
    with pytest.raises(StorageError, match=mismatch) as wrong:
        native.read(ext, empty(ext.length), checksum="crc32", expect=digest ^ 1).result()
    page = as_memoryview(aligned_empty(4096))
    page[:] = data[4096:8192]
    page[100] ^= 0x01  # one bit of rot, written around the engine
    os.pwrite(native._slabs.slabs[ext.slab].fd, page, ext.offset + 4096)
    with pytest.raises(StorageError, match=mismatch) as rot:
        native.read(ext, empty(ext.length), checksum="crc32", expect=digest).result()
    assert wrong.value.errno == rot.value.errno == errno.EBADMSG
    u = native.usage()
    assert (u["checksum_errors"], u["io_errors"], u["reads"]) == (2, 2, 1)


# -- close, threads, leaks -------------------------------------------------------------------
@needs_engine
@pytest.mark.parametrize("mode", MODES)
def test_close_completes_in_flight_ops_and_leaks_nothing(make_cfg, mode):
    gc.collect()
    fds, pys, threads = open_fds(), py_threads(), os_threads()
    b = open_native(make_cfg(io_depth=8), mode)
    exts = [b.allocate(256 * KIB) for _ in range(32)]
    datas = [filled(e.length) for e in exts]
    futs = [b.write(e, d) for e, d in zip(exts, datas)]
    reads = [b.read(e, empty(e.length)) for e in exts[:8]]  # reads behind the writes
    b.close()
    assert all(f.done() and f.exception() is None for f in futs + reads)
    assert b.usage()["writes"] == 32 and b.usage()["reads"] == 8
    b.close()  # idempotent
    with pytest.raises(ValueError, match=r"closed"):
        b.write(exts[0], datas[0])
    del b, futs, reads
    gc.collect()
    assert leaked(fds, open_fds) == set()
    assert leaked(pys, py_threads) == set()
    assert leaked(threads, os_threads) == set()


@needs_engine
@pytest.mark.parametrize("mode", MODES)
def test_an_unclosed_backend_is_finalised(make_cfg, mode):
    gc.collect()
    fds, threads = open_fds(), os_threads()
    b = open_native(make_cfg(io_depth=4), mode)
    ext = b.allocate(4096)
    b.write(ext, filled(4096)).result()
    spill = b.spill_path
    del b
    gc.collect()
    assert not os.path.exists(spill)
    assert leaked(fds, open_fds) == set()
    assert leaked(threads, os_threads) == set()


@needs_engine
def test_close_from_a_done_callback(native):
    exts = [native.allocate(64 * KIB) for _ in range(16)]
    futs = [native.write(e, filled(e.length)) for e in exts]
    closed = threading.Event()

    def close_now(_f):
        native.close()
        closed.set()

    futs[0].add_done_callback(close_now)
    assert closed.wait(30)
    for f in futs:
        assert f.result(timeout=30) is None


@needs_engine
def test_ops_from_short_lived_threads(native):
    """Submitters may exit before their ops finish (io_uring ties work to the submitting task)."""
    exts = [native.allocate(128 * KIB) for _ in range(32)]
    datas = [filled(e.length) for e in exts]
    futs: list = [None] * 32
    workers = [
        threading.Thread(target=lambda i=i: futs.__setitem__(i, native.write(exts[i], datas[i])))
        for i in range(32)
    ]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    for f in futs:
        f.result(timeout=30)
    for e, d in zip(exts, datas):
        assert on_disk(native, e) == bytes(d)


@needs_engine
def test_more_ops_than_depth_queue_up(native):
    exts = [native.allocate(16 * KIB) for _ in range(200)]
    datas = [filled(e.length) for e in exts]
    futs = [native.write(e, d) for e, d in zip(exts, datas)]
    for f in futs:
        f.result(timeout=30)
    backs = [empty(e.length) for e in exts]
    for f in [native.read(e, b) for e, b in zip(exts, backs)]:
        f.result(timeout=30)
    assert backs == datas
    assert native.engine_info()["outstanding"] == 0


@needs_engine
def test_cancel_cannot_stop_an_op_in_flight(native):
    ext = native.allocate(MIB)
    fut = native.write(ext, filled(MIB))
    assert fut.cancel() is False
    fut.result(timeout=30)


@needs_engine
def test_a_forked_child_cannot_touch_the_parents_engine(native):
    """A child shares the parent's ring: its ops would complete in the parent's reaper. The
    engine refuses them (ECHILD), and closing the child's copy leaves the parent working."""
    ext = native.allocate(64 * KIB)
    data = filled(ext.length)
    native.write(ext, data).result()
    again = filled(ext.length)  # made here: a forked child must run no torch op (OpenMP)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only, never return into pytest
        code = 1
        try:
            fut = native.write(ext, again)
            e = fut.exception(timeout=10)
            if isinstance(e, StorageError) and e.errno == errno.ECHILD:
                native._engine.close()  # drops the child's mappings and fds, waits for nothing
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    back = empty(ext.length)
    native.read(ext, back).result(timeout=30)
    assert back == data
    native.write(ext, filled(ext.length)).result(timeout=30)
