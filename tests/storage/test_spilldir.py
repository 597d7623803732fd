"""The spill directory: modes, symlink refusal, cleanup, and the stale-directory sweep."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from storage_util import SLAB_BACKENDS, filled

from tba.errors import ConfigError
from tba.storage import open_backend
from tba.storage.spilldir import SpillDir, host_tag

REPO = Path(__file__).resolve().parents[2]


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("name", SLAB_BACKENDS)
def test_created_root_and_process_dir_are_0700(tmp_path, make_cfg, name):
    root = tmp_path / "a" / "b" / "spill"
    old = os.umask(0o022)
    try:
        b = open_backend(make_cfg(backend=name, spill_dir=str(root), rank=3))
    finally:
        os.umask(old)
    try:
        for p in (tmp_path / "a", tmp_path / "a" / "b", root):
            assert mode(p) == 0o700, p
        own = Path(b.spill_path)
        assert own.parent == root
        assert own.name == f"{host_tag()}-{os.getpid()}-rank3"
        assert mode(own) == 0o700
        assert own.stat().st_uid == os.geteuid()
    finally:
        b.close()


def test_existing_root_mode_is_left_alone(tmp_path, make_cfg):
    root = tmp_path / "spill"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    b = open_backend(make_cfg(backend="posix", spill_dir=str(root)))
    b.close()
    assert mode(root) == 0o755


@pytest.mark.parametrize("name", SLAB_BACKENDS)
def test_root_symlink_is_refused(tmp_path, make_cfg, name):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(
        ConfigError,
        match=r"tba\.config: TBA_SPILL_DIR: .*/link is a symbolic link \(it points to .*/real\); "
        r"tba does not follow symbolic links .* Set TBA_SPILL_DIR to a real directory",
    ):
        open_backend(make_cfg(backend=name, spill_dir=str(link)))
    assert list(real.iterdir()) == []


def test_root_that_is_a_file_is_refused(tmp_path, make_cfg):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"TBA_SPILL_DIR: .*/file is not a directory"):
        open_backend(make_cfg(backend="posix", spill_dir=str(f)))


def test_uncreatable_root_is_a_config_error(tmp_path, make_cfg, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "mkdir", refuse)
    with pytest.raises(
        ConfigError, match=r"TBA_SPILL_DIR: cannot create .*/spill: Permission denied\. Set"
    ):
        open_backend(make_cfg(backend="posix"))


def test_planted_symlink_at_our_name_is_not_followed(tmp_path, make_cfg):
    root = tmp_path / "spill"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = root / f"{host_tag()}-{os.getpid()}-rank0"
    planted.symlink_to(outside)
    b = open_backend(make_cfg(backend="posix", spill_dir=str(root)))
    try:
        assert Path(b.spill_path) == root / f"{planted.name}.1"
        ext = b.allocate(8192)
        b.write(ext, filled(8192)).result()
    finally:
        b.close()
    assert planted.is_symlink()  # neither followed nor removed
    assert list(outside.iterdir()) == []


def test_symlink_swapped_in_after_mkdir_is_refused(tmp_path, make_cfg, monkeypatch):
    root = tmp_path / "spill"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    real_mkdir = os.mkdir

    def racing_mkdir(path, mode=0o777, *, dir_fd=None):
        if dir_fd is None:
            return real_mkdir(path, mode)
        os.symlink(outside, path, dir_fd=dir_fd)  # an attacker wins the race

    monkeypatch.setattr(os, "mkdir", racing_mkdir)
    with pytest.raises(ConfigError, match=r"TBA_SPILL_DIR: .*-rank0 is a symbolic link"):
        SpillDir(str(root), 0)
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("name", SLAB_BACKENDS)
def test_no_named_files_while_slabs_are_open(make_cfg, name):
    b = open_backend(make_cfg(backend=name))
    try:
        exts = [b.allocate(n) for n in (4096, 600_000, 600_000, 3 << 20)]
        assert b.usage()["slabs"] >= 3
        for e in exts:
            b.write(e, filled(e.length)).result()
        assert os.listdir(b.spill_path) == []
        assert os.listdir(Path(b.spill_path).parent) == [Path(b.spill_path).name]
    finally:
        b.close()


def test_without_o_tmpfile_files_are_unlinked_at_once(make_cfg, monkeypatch):
    real_open = os.open
    tmpfile_tries = []

    def no_tmpfile(path, flags, mode=0o777, *, dir_fd=None):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            tmpfile_tries.append(path)
            raise OSError(95, "Operation not supported")  # EOPNOTSUPP
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", no_tmpfile)
    b = open_backend(make_cfg(backend="posix"))
    try:
        e = b.allocate(65536)
        data = filled(e.length)
        b.write(e, data).result()
        back = filled(e.length)
        b.read(e, back).result()
        assert back == data
        assert tmpfile_tries
        assert os.listdir(b.spill_path) == []
    finally:
        b.close()


def test_close_removes_the_process_dir(make_cfg):
    b1 = open_backend(make_cfg(backend="posix"))
    b2 = open_backend(make_cfg(backend="buffered"))  # same root, same process
    assert b1.spill_path != b2.spill_path
    root = Path(b1.spill_path).parent
    b1.write(b1.allocate(4096), filled(4096)).result()
    b1.close()
    b1.close()  # idempotent
    assert sorted(os.listdir(root)) == [Path(b2.spill_path).name]
    b2.close()
    assert os.listdir(root) == []


def test_sweep_removes_only_empty_dirs_of_dead_local_pids(tmp_path, make_cfg, caplog):
    root = tmp_path / "spill"
    root.mkdir()
    host, dead, me = host_tag(), dead_pid(), os.getpid()
    stale = root / f"{host}-{dead}-rank0"
    stale_seq = root / f"{host}-{dead}-rank1.2"
    mine_stale = root / f"{host}-{me}-rank7"  # our pid, but not made by this process
    keep = {
        "full": root / f"{host}-{dead}-rank2",
        "alive": root / f"{host}-{os.getppid()}-rank0",
        "other_host": root / f"otherhost-{dead}-rank0",
        "unrelated": root / "my-data",
        "locked": root / f"{host}-{dead}-rank3",  # a live process in another pid namespace
    }
    for d in (stale, stale_seq, mine_stale, *keep.values()):
        d.mkdir()
    (keep["full"] / "precious").write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    link = root / f"{host}-{dead}-rank4"
    link.symlink_to(outside)
    file_named_like_us = root / f"{host}-{dead}-rank5"
    file_named_like_us.write_text("x")
    lock_fd = os.open(keep["locked"], os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    caplog.set_level(logging.INFO, logger="tba.storage")
    try:
        b = open_backend(make_cfg(backend="posix", spill_dir=str(root)))
        b.close()
    finally:
        os.close(lock_fd)
    for d in (stale, stale_seq, mine_stale):
        assert not d.exists(), d
        assert f"removed stale empty spill directory {d}" in caplog.text
    for d in keep.values():
        assert d.is_dir(), d
    assert (keep["full"] / "precious").read_text() == "x"
    assert link.is_symlink() and outside.is_dir()
    assert file_named_like_us.read_text() == "x"


def test_sigkill_leaves_only_an_empty_dir_that_the_next_process_sweeps(tmp_path, make_cfg):
    root = tmp_path / "spill"
    script = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
from tba.host.memory import aligned_empty, as_memoryview
from tba.config import Config
from tba.storage import open_backend
b = open_backend(Config(spill_dir={str(root)!r}, slab_bytes="1MiB", min_free_bytes=0,
                        backend="posix", environ={{}}))
e = b.allocate(1 << 20)
b.write(e, as_memoryview(aligned_empty(e.length))).result()
print(b.spill_path, flush=True)
time.sleep(60)
"""
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child_dir = Path(p.stdout.readline().strip())
        assert child_dir.parent == root
        fds = os.listdir(f"/proc/{p.pid}/fd")
        slab_links = [os.readlink(f"/proc/{p.pid}/fd/{fd}") for fd in fds]
        assert any(str(child_dir) in t and "(deleted)" in t for t in slab_links)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
    assert os.listdir(root) == [child_dir.name]
    assert os.listdir(child_dir) == []
    b = open_backend(make_cfg(backend="posix", spill_dir=str(root)))
    b.close()
    assert os.listdir(root) == []


@pytest.mark.parametrize("name", SLAB_BACKENDS)
def test_dropped_backend_cleans_up(make_cfg, name):
    import gc

    b = open_backend(make_cfg(backend=name))
    b.write(b.allocate(4096), filled(4096)).result()
    path = b.spill_path
    del b
    gc.collect()
    assert not os.path.exists(path)


def test_unreadable_root_is_a_config_error(tmp_path, make_cfg, monkeypatch):
    root = tmp_path / "spill"
    root.mkdir()
    real_open = os.open

    def refuse_dirs(path, flags, mode=0o777, *, dir_fd=None):
        if flags & os.O_DIRECTORY:
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", refuse_dirs)
    with pytest.raises(
        ConfigError,
        match=r"TBA_SPILL_DIR: cannot open .*/spill: Permission denied\. Set TBA_SPILL_DIR to a "
        r"writable directory",
    ):
        open_backend(make_cfg(backend="posix", spill_dir=str(root)))


def test_uninspectable_root_is_a_config_error(tmp_path, make_cfg, monkeypatch):
    def refuse(path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "lstat", refuse)
    with pytest.raises(
        ConfigError, match=r"TBA_SPILL_DIR: cannot inspect .*/spill: Permission denied\. Set"
    ):
        open_backend(make_cfg(backend="posix"))
