"""`tba doctor`: the table, the JSON, exit codes, the optional engines' rendering, no leftovers."""

from __future__ import annotations

import errno
import fcntl
import importlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from tba import doctor
from tba.cli import main
from tba.host.malloc import malloc_family
from tba.storage.statx import fs_type

REPO = Path(__file__).resolve().parents[2]
PROBE = "8MiB"
LABELS = [label for _, label in doctor.ROWS]
KEYS = [key for key, _ in doctor.ROWS]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No TBA_* (or rank-count) variables from the caller's environment."""
    for k in list(os.environ):
        if k.startswith("TBA_") or k in ("LOCAL_WORLD_SIZE",):
            monkeypatch.delenv(k)


@pytest.fixture
def spill(tmp_path):
    return tmp_path / "spill"


def run_doctor(capsys, spill, *extra: str) -> tuple[int, str]:
    rc = main(["doctor", "--spill-dir", str(spill), "--probe-bytes", PROBE, *extra])
    out, err = capsys.readouterr()
    return rc, out + err


def run_json(capsys, spill, *extra: str) -> tuple[int, dict]:
    rc = main(["doctor", "--spill-dir", str(spill), "--probe-bytes", PROBE, "--json", *extra])
    out, _ = capsys.readouterr()
    return rc, json.loads(out)


def row(text: str, label: str) -> str:
    """The table line of a check, with its wrapped continuation lines joined."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(label + " ") and line[len(label) :].lstrip()[:4] in (
            "ok  ",
            "warn",
            "FAIL",
            "skip",
        ):
            parts = [line]
            for more in lines[i + 1 :]:
                if not more.startswith(" "):
                    break
                parts.append(more.strip())
            return " ".join(parts)
    raise AssertionError(f"no row {label!r} in:\n{text}")


def status(text: str, label: str) -> str:
    return row(text, label)[len(label) :].split()[0]


def assert_nothing_left(spill: Path, existed: bool = True) -> None:
    if existed:
        assert spill.is_dir()
        assert os.listdir(spill) == []
    else:
        assert not spill.exists()


def fake_status(monkeypatch, module: str, func: str, value: dict, **extra) -> None:
    """Make ``module.func()`` return ``value``, and set ``extra`` attributes (the backend class
    open_backend imports), on the real module if it exists, else on a stand-in module."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        mod = types.ModuleType(module)
        monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.setattr(mod, func, lambda: dict(value), raising=False)
    for k, v in extra.items():
        monkeypatch.setattr(mod, k, v, raising=False)


class _Unavailable(OSError):
    pass


def _refuse(*args, **kwargs):
    raise _Unavailable(errno.ENOSYS, "stand-in backend for the doctor tests")


def fake_native(monkeypatch, **status) -> None:
    """The native engine reports ``status``, and open_backend cannot open it (auto: posix)."""
    value = {
        "built": True,
        "library": "/x/libtba_native.so",
        "build_error": None,
        "io_uring": True,
        "io_uring_reason": "io_uring_setup works",
        "memlock_bytes": None,
    }
    value.update(status)
    fake_status(monkeypatch, "tba.storage.native", "engine_status", value, NativeBackend=_refuse)


def fake_kvikio(monkeypatch, **status) -> None:
    """kvikio reports ``status``, and open_backend cannot open it."""
    value = {
        "importable": True,
        "version": "25.06.00",
        "gds_available": True,
        "compat_mode": "OFF",
        "reason": "",
    }
    value.update(status)
    fake_status(
        monkeypatch,
        "tba.storage.kvikio",
        "kvikio_status",
        value,
        KvikioBackend=_refuse,
        KvikioUnavailable=_Unavailable,
    )


# -- a good spill dir ----------------------------------------------------------------------------
def test_table_has_every_check_and_exit_0(capsys, spill):
    spill.mkdir()
    rc, text = run_doctor(capsys, spill)
    assert rc == 0, text
    lines = text.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("check "))
    assert lines[header].split() == ["check", "status", "detail"]
    # every row, in order, with its status in one aligned column
    at = [next(i for i, ln in enumerate(lines) if ln.startswith(label + " ")) for label in LABELS]
    assert at == sorted(at) and at[0] == header + 1
    col = lines[header].index("status")
    for i in at:
        assert lines[i][col:].split()[0] in ("ok", "warn"), lines[i]
        assert lines[i][col - 2 : col] == "  "
    assert "aligned 4096-byte write+read on a nameless file" in row(text, "O_DIRECT")
    assert "tba aligns to " in row(text, "O_DIRECT")
    assert "statx" in row(text, "O_DIRECT")
    assert f"{spill} (from --spill-dir): writable" in row(text, "spill dir")
    assert "auto picks " in row(text, "backend")
    assert " GiB/s: 8.0 MiB in 1 x 8.0 MiB, 1 in flight, " in row(text, "write")
    assert "from the device (O_DIRECT)" in row(text, "read")
    assert "nothing left on disk" in row(text, "cleanup")
    if fs_type(spill.parent) in ("tmpfs", "ramfs"):  # pytest's tmp dir may live in RAM
        assert "# TBA_SPILL_DIR: " in text
    else:
        assert f"export TBA_SPILL_DIR={spill}  " in text
    assert "export TBA_MAX_DISK_BYTES=" in text
    assert "export TBA_PREFETCH_BYTES=" in text
    assert "# TBA_BACKEND: leave it at auto" in text
    assert lines[-1].startswith("result: usable (")
    assert_nothing_left(spill)


JSON_KEYS = {
    "version": str,
    "usable": bool,
    "exit_code": int,
    "problem": (str, type(None)),
    "elapsed_seconds": float,
    "checks": dict,
    "probe_bytes": int,
    "spill_dir": dict,
    "o_direct": dict,
    "io_uring": dict,
    "native": dict,
    "memlock": dict,
    "kvikio": dict,
    "cuda": dict,
    "backend": dict,
    "throughput": dict,
    "cleanup": dict,
    "host_malloc": dict,
    "recommendations": list,
}


def test_json_keys_and_types(capsys, spill):
    rc, j = run_json(capsys, spill)
    assert rc == 0 and j["exit_code"] == 0 and j["usable"] is True and j["problem"] is None
    assert set(j) == set(JSON_KEYS)
    for key, kind in JSON_KEYS.items():
        assert isinstance(j[key], kind), key
    assert list(j["checks"]) == KEYS
    for c in j["checks"].values():
        assert set(c) == {"status", "detail"} and c["status"] in ("ok", "warn")
    assert j["probe_bytes"] == 8 << 20
    sd = j["spill_dir"]
    assert sd["root"] == str(spill) and sd["source"] == "argument" and sd["created_root"] is True
    assert isinstance(sd["fs_type"], str) and isinstance(sd["free_bytes"], int)
    od = j["o_direct"]
    assert od["works"] is True and od["error"] is None
    assert isinstance(od["dio_mem_align"], int) and od["alignment"] >= 4096
    assert set(j["native"]) == {"module", "error", "built", "library", "build_error"}
    assert set(j["io_uring"]) == {"available", "reason", "source", "sysctl"}
    assert set(j["memlock"]) == {"limit_bytes", "unlimited", "cap_ipc_lock", "needed_bytes"}
    assert set(j["kvikio"]) == {
        "module",
        "error",
        "importable",
        "version",
        "gds_available",
        "compat_mode",
        "reason",
    }
    assert set(j["cuda"]) == {"torch", "built", "available", "device_count", "devices"}
    assert set(j["host_malloc"]) == {"malloc", "library", "suggested"}
    be = j["backend"]
    assert be["requested"] == "auto" and be["name"] == be["auto"] and be["error"] is None
    assert isinstance(be["reason"], str) and isinstance(be["alignment"], int)
    tp = j["throughput"]
    assert tp["bytes"] == 8 << 20 and tp["extent_bytes"] == 8 << 20 and tp["extents"] == 1
    for k in ("write_gib_s", "read_gib_s", "write_seconds", "read_seconds"):
        assert isinstance(tp[k], float) and tp[k] > 0, k
    assert tp["read_sweep_gib_s"] == {"1": tp["read_gib_s"]} and tp["error"] is None
    assert j["cleanup"] == {
        "clean": True,
        "leftovers": [],
        "removed": [str(spill)],
    }
    envs = [r["env"] for r in j["recommendations"]]
    assert envs[:3] == ["TBA_SPILL_DIR", "TBA_BACKEND", "TBA_MAX_DISK_BYTES"]
    for r in j["recommendations"]:
        assert set(r) == {"env", "value", "reason", "export"} and r["reason"]
        assert (r["export"] is None) == (r["value"] is None)
    assert not spill.exists()


def test_created_root_is_removed_existing_root_is_kept(capsys, tmp_path):
    deep = tmp_path / "a" / "b" / "spill"
    rc, text = run_doctor(capsys, deep)
    assert rc == 0, text
    assert "created for this check, removed afterwards" in row(text, "spill dir")
    assert f"and {tmp_path / 'a'}, which it had created" in row(text, "cleanup")
    assert os.listdir(tmp_path) == []
    # An existing root keeps its other contents, untouched.
    root = tmp_path / "root"
    root.mkdir()
    (root / "theirs").write_text("x")
    rc, text = run_doctor(capsys, root)
    assert rc == 0, text
    assert "was there before and stays" in row(text, "cleanup")
    assert os.listdir(root) == ["theirs"]


def test_spill_dir_from_env(capsys, spill, monkeypatch):
    monkeypatch.setenv("TBA_SPILL_DIR", str(spill))
    monkeypatch.setenv("TBA_IO_THREADS", "2")
    rc = main(["doctor", "--probe-bytes", PROBE])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert f"{spill} (from TBA_SPILL_DIR)" in row(text, "spill dir")
    assert "TBA_IO_THREADS=2" in row(text, "config")
    assert "TBA_SPILL_DIR=" in row(text, "config")


def test_sweep_and_io_threads_recommendation(capsys, spill):
    rc, j = run_json(capsys, spill, "--probe-bytes", "64MiB")
    assert rc == 0
    tp = j["throughput"]
    assert tp["extents"] == 4 and tp["in_flight"] == 4
    assert list(tp["read_sweep_gib_s"]) == ["1", "2", "4"]
    rec = {r["env"]: r for r in j["recommendations"]}
    native = j["backend"]["name"] == "native"
    used, unused = (
        ("TBA_IO_DEPTH", "TBA_IO_THREADS") if native else ("TBA_IO_THREADS", "TBA_IO_DEPTH")
    )
    assert int(rec[used]["value"]) >= (32 if native else 4)
    assert "16 MiB reads reach 90% of the best read rate" in rec[used]["reason"]
    assert rec[unused]["value"] is None and "not used by" in rec[unused]["reason"]


# -- the recommendation rules -------------------------------------------------------------------
def test_rules():
    gib, mib = 1 << 30, 1 << 20
    assert doctor.quota_for(101 * gib, gib, 1) == 90 * gib
    assert doctor.quota_for(101 * gib, gib, 4) == 90 * gib // 4
    assert doctor.quota_for(gib, 2 * gib, 1) == 0
    assert doctor.in_flight_for({1: 1.0, 2: 1.8, 4: 2.0, 8: 2.05}, 4) == (4, 4)
    assert doctor.in_flight_for({1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0}, 4) == (4, 1)
    assert doctor.in_flight_for({1: 0.5, 2: 1.0, 4: 1.5, 8: 3.0}, 4) == (8, 8)
    assert doctor.in_flight_for({1: 1.0, 2: 1.0}, 32) == (32, 1)
    assert doctor.prefetch_for(1.0, 64 * mib) == 128 * mib  # 102 MiB -> the 2-group floor
    assert doctor.prefetch_for(3.2, 64 * mib) == 352 * mib  # 328 MiB, rounded up to 32 MiB
    assert doctor.prefetch_for(25.0, 64 * mib) == gib  # the cap
    assert doctor._env_size(90 * gib + 5, down=True) == "90GiB"
    assert doctor._env_size(352 * mib) == "352MiB"
    assert doctor._env_size(gib) == "1GiB"


def test_quota_is_split_over_local_ranks(capsys, spill, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    real = os.statvfs
    gib = 1 << 30

    def big(path):  # 200 GiB, 101 GiB free
        st = real(path)
        blocks, free = 200 * gib // 4096, 101 * gib // 4096
        return os.statvfs_result((4096, 4096, blocks, free, free, *st[5:]))

    monkeypatch.setattr(os, "statvfs", big)
    rc, text = run_doctor(capsys, spill)
    assert rc == 0, text
    assert "export TBA_MAX_DISK_BYTES=22GiB" in text  # 90% of (101 - 1) GiB / 4
    assert "split over 4 ranks on this node (LOCAL_WORLD_SIZE)" in text


# -- unusable spill dirs: exit 1 with the reason -------------------------------------------------
def test_path_under_a_regular_file(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    rc, text = run_doctor(capsys, f / "spill")
    assert rc == 1
    assert status(text, "spill dir") == "FAIL"
    assert "Not a directory" in row(text, "spill dir")
    for label in ("O_DIRECT", "backend", "write", "read"):
        assert status(text, label) == "skip"
    assert "result: UNUSABLE: spill dir: " in text
    assert f.read_text() == "x" and os.listdir(tmp_path) == ["file"]


def test_spill_dir_that_is_a_file(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    rc, j = run_json(capsys, f)
    assert rc == 1 and j["usable"] is False
    assert j["checks"]["spill_dir"]["status"] == "FAIL"
    assert "is not a directory" in j["problem"]


def test_read_only_even_for_root(capsys):
    # sysfs refuses mkdir to everyone, root included (EPERM); a real user gets EACCES/EPERM.
    target = Path("/sys/fs/tba-doctor-test")
    if not Path("/sys/fs").is_dir() or target.exists():
        pytest.skip("needs sysfs at /sys")
    rc, text = run_doctor(capsys, target)
    assert rc == 1
    assert status(text, "spill dir") == "FAIL"
    assert "cannot create /sys/fs/tba-doctor-test" in row(text, "spill dir")
    assert not target.exists()


def test_read_only_filesystem(capsys, tmp_path, monkeypatch):
    real = os.mkdir

    def erofs(path, mode=0o777, *, dir_fd=None):
        if str(path).startswith(str(tmp_path)) or dir_fd is not None:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real(path, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", erofs)
    root = tmp_path / "ro"
    real(root)
    rc, text = run_doctor(capsys, root)
    assert rc == 1
    assert "Read-only file system" in row(text, "spill dir")
    assert "result: UNUSABLE: spill dir: " in text
    assert os.listdir(root) == []


def test_full_disk(capsys, spill, monkeypatch):
    real = os.statvfs

    def full(path):
        st = real(path)
        return os.statvfs_result((4096, 4096, st.f_blocks, 16, 16, *st[5:]))  # 64 KiB free

    monkeypatch.setattr(os, "statvfs", full)
    rc, text = run_doctor(capsys, spill)
    assert rc == 1
    assert status(text, "free space") == "FAIL"
    assert "64.0 KiB free of " in row(text, "free space")
    assert "less than the 8.0 MiB probe (--probe-bytes)" in row(text, "free space")
    assert status(text, "write") == "skip" and status(text, "read") == "skip"
    assert status(text, "cleanup") == "ok"
    assert "result: UNUSABLE: free space: 64.0 KiB free" in text
    assert_nothing_left(spill, existed=False)


def test_free_space_below_the_probe(capsys, spill, monkeypatch):
    real = os.statvfs
    free = 5 << 20

    def small(path):
        st = real(path)
        return os.statvfs_result((4096, 4096, st.f_blocks, free // 4096, free // 4096, *st[5:]))

    monkeypatch.setattr(os, "statvfs", small)
    rc, j = run_json(capsys, spill)
    assert rc == 1 and j["checks"]["free_space"]["status"] == "FAIL"
    assert j["spill_dir"]["free_bytes"] == free
    assert j["problem"].startswith("free space: 5.0 MiB free of ")
    assert j["throughput"]["write_gib_s"] is None


def test_free_space_below_min_free_is_a_warning(capsys, spill, monkeypatch):
    monkeypatch.setenv("TBA_MIN_FREE_BYTES", "1000TiB")
    rc, text = run_doctor(capsys, spill)
    assert rc == 0, text
    assert status(text, "free space") == "warn"
    assert "tba would offload nothing" in row(text, "free space")


def _fail_big(real, op):
    def fake(fd, *args):
        buf = args[0] if op == "write" else args[0][0]
        if len(buf) >= 1 << 20:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, *args)

    return fake


@pytest.mark.parametrize("op", ["write", "read"])
def test_probe_failing_midway_leaves_nothing(capsys, spill, monkeypatch, op):
    if op == "write":
        monkeypatch.setattr(os, "pwrite", _fail_big(os.pwrite, op))
    else:
        monkeypatch.setattr(os, "preadv", _fail_big(os.preadv, op))
    rc, text = run_doctor(capsys, spill, "--backend", "posix")  # the faults are posix's syscalls
    assert rc == 1, text
    assert status(text, op) == "FAIL"
    assert "probe failed: " in row(text, op) and "EIO (Input/output error)" in row(text, op)
    assert status(text, "cleanup") == "ok"
    assert f"result: UNUSABLE: {op}: probe failed" in text
    assert_nothing_left(spill, existed=False)


def test_no_backend_works(capsys, spill, monkeypatch):
    fake_native(monkeypatch, built=False, build_error="not built for this test", io_uring=False)
    real = os.pwrite

    def eio(fd, buf, off):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "pwrite", eio)
    rc, text = run_doctor(capsys, spill)
    assert rc == 1
    assert status(text, "O_DIRECT") == "warn"
    assert status(text, "backend") == "FAIL"
    assert "no storage backend works" in row(text, "backend")
    assert status(text, "write") == "skip"
    monkeypatch.setattr(os, "pwrite", real)
    assert_nothing_left(spill, existed=False)


# -- warnings that leave the dir usable -----------------------------------------------------------
def test_without_o_direct_auto_falls_back_to_buffered(capsys, spill, monkeypatch):
    fake_native(monkeypatch, built=False, build_error="not built for this test", io_uring=False)
    real = os.pwrite

    def no_direct(fd, buf, off):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, buf, off)

    monkeypatch.setattr(os, "pwrite", no_direct)
    rc, text = run_doctor(capsys, spill)
    assert rc == 0, text
    assert status(text, "O_DIRECT") == "warn"
    assert "refused on this filesystem" in row(text, "O_DIRECT")
    assert status(text, "backend") == "warn" and "auto picks buffered" in row(text, "backend")
    assert "partly from the page cache" in row(text, "read")
    assert "export TBA_BACKEND=buffered" in text
    assert_nothing_left(spill, existed=False)


def test_forced_backend(capsys, spill):
    rc, text = run_doctor(capsys, spill, "--backend", "buffered")
    assert rc == 0, text
    assert "buffered (TBA_BACKEND=buffered; auto would pick " in row(text, "backend")
    assert "# TBA_BACKEND: you set buffered; auto would pick " in text


@pytest.mark.parametrize(
    "fs, words",
    [
        ("tmpfs", "lives in RAM: spilling there frees no memory"),
        ("overlayfs", "copy-on-write layer"),
        ("nfs", "a network filesystem"),
    ],
)
def test_memory_and_network_filesystems_warn(capsys, spill, monkeypatch, fs, words):
    monkeypatch.setattr(doctor, "fs_type", lambda path: fs)
    rc, text = run_doctor(capsys, spill)
    assert rc == 0, text
    assert status(text, "filesystem") == "warn"
    assert row(text, "filesystem").split()[2] == fs
    assert words in row(text, "filesystem")
    if fs == "tmpfs":
        assert "export TBA_SPILL_DIR" not in text
        assert "# TBA_SPILL_DIR: " in text and "frees no memory" in text
    else:
        assert "export TBA_SPILL_DIR" in text


def test_tba_disabled_and_unknown_variables_warn(capsys, spill, monkeypatch):
    monkeypatch.setenv("TBA_ENABLED", "0")
    monkeypatch.setenv("TBA_DOCTOR_TEST_PREFETCH_BYTES", "1")
    rc, text = run_doctor(capsys, spill)
    assert rc == 0
    assert status(text, "config") == "warn"
    assert "TBA_ENABLED=0: tba is switched off here" in row(text, "config")
    assert "unknown environment variable TBA_DOCTOR_TEST_PREFETCH_BYTES" in row(text, "config")


# -- the optional engines -------------------------------------------------------------------------
def test_native_not_built(capsys, spill, monkeypatch):
    fake_native(
        monkeypatch,
        built=False,
        library=None,
        build_error="liburing.h: No such file or directory",
    )
    rc, j = run_json(capsys, spill)
    assert rc == 0
    c = j["checks"]["native_engine"]
    assert c["status"] == "warn"
    assert c["detail"].startswith("not built: liburing.h: No such file or directory. Fix: ")
    assert "Until then auto uses the posix backend" in c["detail"]
    assert j["native"]["module"] is True and j["native"]["built"] is False
    tba_backend = next(r for r in j["recommendations"] if r["env"] == "TBA_BACKEND")
    assert tba_backend["value"] is None and "native engine is not built" in tba_backend["reason"]


def test_native_not_built_with_its_own_fix(capsys, spill, monkeypatch):
    why = "no C compiler was found. Reinstall tba where a C compiler is available."
    fake_native(monkeypatch, built=False, library=None, build_error=why)
    rc, j = run_json(capsys, spill)
    detail = j["checks"]["native_engine"]["detail"]
    assert detail == (
        "not built: no C compiler was found. Reinstall tba where a C compiler is available. "
        "Until then auto uses the posix backend."
    )


def test_native_built(capsys, spill, monkeypatch):
    fake_native(monkeypatch)
    rc, text = run_doctor(capsys, spill)
    assert status(text, "native engine") == "ok"
    assert "built: /x/libtba_native.so" in row(text, "native engine")
    assert status(text, "io_uring") == "ok"


def test_native_module_missing(capsys, spill, monkeypatch):
    monkeypatch.setitem(sys.modules, "tba.storage.native", None)
    monkeypatch.setattr(doctor, "_probe_io_uring", lambda: (True, "io_uring_setup works"))
    rc, j = run_json(capsys, spill)
    c = j["checks"]["native_engine"]
    assert c["status"] == "ok" and c["detail"].startswith("not in this install")
    assert j["io_uring"] == {
        "available": True,
        "reason": "io_uring_setup works",
        "source": "doctor probe",
        "sysctl": j["io_uring"]["sysctl"],
    }


def test_io_uring_is_probed_when_the_engine_is_not_built(capsys, spill, monkeypatch):
    fake_native(monkeypatch, built=False, build_error="no compiler", io_uring=False)
    monkeypatch.setattr(doctor, "_probe_io_uring", lambda: (True, "io_uring_setup works"))
    rc, j = run_json(capsys, spill)
    assert j["checks"]["native_engine"]["status"] == "warn"
    assert j["io_uring"]["available"] is True and j["io_uring"]["source"] == "doctor probe"


@pytest.mark.parametrize("sysctl", [0, 2])
def test_io_uring_eperm(capsys, spill, monkeypatch, sysctl):
    fake_native(
        monkeypatch,
        io_uring=False,
        io_uring_reason="io_uring_setup: EPERM (Operation not permitted)",
    )
    monkeypatch.setattr(doctor, "_read_int", lambda path: sysctl)
    rc, text = run_doctor(capsys, spill)
    assert rc == 0, text
    r = row(text, "io_uring")
    assert status(text, "io_uring") == "warn"
    assert "unavailable: io_uring_setup: EPERM (Operation not permitted)." in r
    if sysctl:
        assert "kernel.io_uring_disabled=2 (off for everyone)" in r
        assert "sysctl -w kernel.io_uring_disabled=0" in r
    else:
        assert "seccomp" in r and "Docker" in r
    assert "thread pool of TBA_IO_DEPTH threads" in r


def test_io_uring_eperm_without_the_engine(capsys, spill, monkeypatch):
    monkeypatch.setitem(sys.modules, "tba.storage.native", None)
    why = "io_uring_setup failed: EPERM (Operation not permitted)"
    monkeypatch.setattr(doctor, "_probe_io_uring", lambda: (False, why))
    monkeypatch.setattr(doctor, "_read_int", lambda path: 0)
    rc, j = run_json(capsys, spill)
    assert j["checks"]["io_uring"]["status"] == "warn"
    assert j["io_uring"]["available"] is False and j["io_uring"]["source"] == "doctor probe"


def test_memlock(capsys, spill, monkeypatch):
    monkeypatch.setattr(doctor, "_has_cap_ipc_lock", lambda: False)
    fake_native(monkeypatch, memlock_bytes=64 << 10)
    rc, text = run_doctor(capsys, spill)
    r = row(text, "memlock")
    assert status(text, "memlock") == "warn"
    assert r.split()[1:5] == ["warn", "64.0", "KiB", "(ulimit"]
    assert "registered (fixed) buffers are pinned and charged to RLIMIT_MEMLOCK" in r
    assert "does not fit" in r and "ulimit -l unlimited" in r

    fake_native(monkeypatch, memlock_bytes=None)
    rc, text = run_doctor(capsys, spill)
    assert status(text, "memlock") == "ok" and "unlimited" in row(text, "memlock")

    monkeypatch.setattr(doctor, "_has_cap_ipc_lock", lambda: True)
    fake_native(monkeypatch, memlock_bytes=64 << 10)
    rc, text = run_doctor(capsys, spill)
    assert status(text, "memlock") == "ok" and "CAP_IPC_LOCK" in row(text, "memlock")


def test_memlock_only_matters_with_the_engine(capsys, spill, monkeypatch):
    monkeypatch.setattr(doctor, "_has_cap_ipc_lock", lambda: False)
    fake_native(monkeypatch, built=False, build_error="no compiler", memlock_bytes=64 << 10)
    rc, j = run_json(capsys, spill)
    m = j["checks"]["memlock"]
    assert m["status"] == "ok" and "not in use here" in m["detail"]
    assert j["memlock"]["limit_bytes"] == 64 << 10 and j["memlock"]["unlimited"] is False


def test_kvikio_absent(capsys, spill, monkeypatch):
    fake_kvikio(
        monkeypatch,
        importable=False,
        version=None,
        gds_available=None,
        compat_mode=None,
        reason="kvikio is not installed (pip install 'tba[gds]')",
    )
    rc, text = run_doctor(capsys, spill)
    assert rc == 0, text
    assert status(text, "kvikio/GDS") == "ok"
    assert "kvikio is not installed (pip install 'tba[gds]')" in row(text, "kvikio/GDS")


def test_kvikio_module_missing(capsys, spill, monkeypatch):
    monkeypatch.setitem(sys.modules, "tba.storage.kvikio", None)
    rc, j = run_json(capsys, spill)
    c = j["checks"]["kvikio"]
    assert c["status"] == "ok" and c["detail"].startswith("not in this install")
    assert j["kvikio"]["module"] is False and j["kvikio"]["importable"] is None


def test_kvikio_without_gds(capsys, spill, monkeypatch):
    fake_kvikio(
        monkeypatch,
        gds_available=False,
        compat_mode="ON",
        reason="cuFile: nvidia-fs driver not loaded",
    )
    rc, j = run_json(capsys, spill)
    assert rc == 0
    c = j["checks"]["kvikio"]
    assert c["status"] == "warn"
    assert c["detail"].startswith("kvikio 25.06.00 without GDS, compat mode ON: ")
    assert "auto does not pick it" in c["detail"]
    assert c["detail"].endswith("cuFile: nvidia-fs driver not loaded")
    assert j["kvikio"]["gds_available"] is False and j["kvikio"]["compat_mode"] == "ON"


def test_kvikio_with_gds(capsys, spill, monkeypatch):
    import torch

    fake_kvikio(monkeypatch)
    rc, text = run_doctor(capsys, spill)
    r = row(text, "kvikio/GDS")
    if torch.cuda.is_available():
        assert status(text, "kvikio/GDS") == "ok"
        assert "kvikio 25.06.00: GDS available, compat mode OFF; auto prefers kvikio" in r
    else:
        assert status(text, "kvikio/GDS") == "warn"
        assert "kvikio 25.06.00: GDS reported, but no CUDA device is visible" in r


def test_cuda_row(capsys, spill):
    import torch

    rc, j = run_json(capsys, spill)
    cuda = j["cuda"]
    assert cuda["torch"] == torch.__version__
    assert cuda["available"] is torch.cuda.is_available()
    assert cuda["device_count"] == len(cuda["devices"])
    if not torch.backends.cuda.is_built():
        assert j["checks"]["cuda"]["detail"].startswith("none: torch ")


def test_status_functions_that_raise_are_reported(capsys, spill, monkeypatch):
    def boom():
        raise RuntimeError("driver exploded")

    fake_native(monkeypatch)
    monkeypatch.setattr(sys.modules["tba.storage.native"], "engine_status", boom)
    rc, j = run_json(capsys, spill)
    c = j["checks"]["native_engine"]
    assert c["status"] == "warn"
    assert "engine_status() failed: RuntimeError: driver exploded" in c["detail"]


# -- bad arguments ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, words",
    [
        (["doctor", "--probe-bytes", "lots"], "'lots' is invalid; expected a size of at least"),
        (["doctor", "--probe-bytes", "4096"], "expected a size of at least 1.0 MiB"),
        (["doctor", "--backend", "nvme"], "invalid choice: 'nvme'"),
        (["doctor", "--bogus"], "unrecognized arguments: --bogus"),
        ([], "the following arguments are required: COMMAND"),
        (["nope"], "invalid choice: 'nope'"),
    ],
)
def test_bad_arguments_exit_2(capsys, argv, words):
    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_bad_tba_settings_exit_2(capsys, spill, monkeypatch):
    monkeypatch.setenv("TBA_IO_THREADS", "0")
    monkeypatch.setenv("TBA_STAGING_BYTES", "huge")
    rc, text = run_doctor(capsys, spill)
    assert rc == 2
    assert "tba doctor: tba.config: 2 problems" in text
    assert "TBA_IO_THREADS='0' is invalid" in text
    assert not spill.exists()


def test_help_exits_0(capsys):
    assert main(["doctor", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--spill-dir", "--probe-bytes", "--backend", "--json"):
        assert flag in out


class _Stop(Exception):
    pass


def test_probe_bytes_parses_sizes(monkeypatch):
    seen = {}

    def fake_run(**kw):
        seen.update(kw)
        raise _Stop

    monkeypatch.setattr(doctor, "run", fake_run)
    with pytest.raises(_Stop):
        main(["doctor", "--probe-bytes", "64MiB"])
    assert seen["probe_bytes"] == 64 << 20
    with pytest.raises(_Stop):
        main(["doctor"])
    assert seen["probe_bytes"] == doctor.DEFAULT_PROBE_BYTES
    assert seen["spill_dir"] is None and seen["backend"] is None


# -- as a program -------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TBA_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.integration
def test_python_dash_m_json(tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    p = subprocess.run(
        [sys.executable, "-m", "tba.cli", "doctor", "--spill-dir", str(spill)]
        + ["--probe-bytes", PROBE, "--json"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    j = json.loads(p.stdout)
    assert j["exit_code"] == 0 and list(j["checks"]) == KEYS
    assert os.listdir(spill) == []


@pytest.mark.integration
def test_python_dash_m_table_and_exit_codes(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    cmd = [sys.executable, "-m", "tba.cli", "doctor", "--probe-bytes", PROBE]
    ok = subprocess.run(cmd + ["--spill-dir", str(tmp_path / "s")], **_kw())
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for label in LABELS:
        assert f"\n{label} " in ok.stdout
    bad = subprocess.run(cmd + ["--spill-dir", str(f / "s")], **_kw())
    assert bad.returncode == 1
    assert "result: UNUSABLE: spill dir: " in bad.stdout
    usage = subprocess.run(cmd + ["--probe-bytes", "x"], **_kw())
    assert usage.returncode == 2 and "'x' is invalid; expected a size" in usage.stderr
    assert sorted(os.listdir(tmp_path)) == ["file"]


def _kw() -> dict:
    return {"capture_output": True, "text": True, "env": _env(), "timeout": 120}


@pytest.mark.integration
def test_import_tba_does_not_import_the_cli():
    code = (
        "import sys, tba; print(sorted(m for m in sys.modules if m in ('tba.cli', 'tba.doctor')))"
    )
    p = subprocess.run([sys.executable, "-c", code], **_kw())
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "lib, name",
    [
        ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10", "tcmalloc"),
        ("/opt/lib/libtcmalloc.so.4", "tcmalloc"),
        ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "jemalloc"),
        ("/usr/local/lib/libmimalloc.so.2.1", "mimalloc"),
        ("/usr/lib/x86_64-linux-gnu/libm.so.6", "glibc"),
        ("/lib/x86_64-linux-gnu/libc.so.6", "glibc"),
    ],
)
def test_malloc_family_by_library_name(lib, name):
    assert malloc_family(lib) == name


def test_find_tcmalloc(tmp_path):
    assert doctor.find_tcmalloc((str(tmp_path),)) is None
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert doctor.find_tcmalloc(("/nonexistent", str(tmp_path))) == str(
        tmp_path / "libtcmalloc_minimal.so.4"
    )


def test_glibc_on_the_cpu_is_a_warning_that_names_the_fix(capsys, spill, monkeypatch):
    monkeypatch.setattr(doctor, "find_tcmalloc", lambda: "/x/libtcmalloc_minimal.so.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU host, on a GPU one too
    rc, j = run_json(capsys, spill)
    assert rc == 0  # advice, not a failure
    row = j["checks"]["host_malloc"]
    if j["host_malloc"]["malloc"] != "glibc":  # pragma: no cover - the suite run under tcmalloc
        pytest.skip("this test process is not using glibc malloc")
    assert row["status"] == "warn"
    assert "LD_PRELOAD=/x/libtcmalloc_minimal.so.4" in row["detail"]
    assert j["host_malloc"]["suggested"] == "/x/libtcmalloc_minimal.so.4"


def test_glibc_on_a_gpu_host_is_fine(capsys, spill, monkeypatch):
    """Activations live in the CUDA caching allocator there (seen on an H200 in the GPU
    check, where the test above, then without its CPU-host patch, failed)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    rc, j = run_json(capsys, spill)
    if j["host_malloc"]["malloc"] != "glibc":  # pragma: no cover - the suite run under tcmalloc
        pytest.skip("this test process is not using glibc malloc")
    assert j["checks"]["host_malloc"]["status"] == "ok"
    assert "CUDA caching allocator" in j["checks"]["host_malloc"]["detail"]


@pytest.mark.skipif(doctor.find_tcmalloc() is None, reason="tcmalloc is not installed")
def test_a_preloaded_tcmalloc_is_seen(tmp_path):
    """A real LD_PRELOAD in a child process (CI installs libtcmalloc-minimal4)."""
    env = {**_env(), "LD_PRELOAD": doctor.find_tcmalloc()}
    out = subprocess.run(
        [sys.executable, "-m", "tba.cli", "doctor", "--json", "--spill-dir", str(tmp_path / "s")]
        + ["--probe-bytes", PROBE],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    j = json.loads(out.stdout)
    assert j["host_malloc"]["malloc"] == "tcmalloc", out.stderr
    assert j["checks"]["host_malloc"]["status"] == "ok"
