"""Fixtures of the fault suite: the loop ext4 (or a skip with the reason), Offloaders closed at
teardown, and no error that is only logged. The helpers are in util.py."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time

import pytest

import tba

from .util import LoopExt4, MiB, PlainDir, config, loop_unavailable, run_cmd


@pytest.fixture
def loop_ext4(tmp_path):
    """A fresh 64 MiB ext4 (4 KiB blocks, no reserved blocks) on a loop device, or a skip with
    the reason. Unmounted and detached at teardown, even when the test failed."""
    why = loop_unavailable()
    if why:
        pytest.skip(why)
    image = str(tmp_path / "fs.img")
    with open(image, "wb") as f:
        f.truncate(64 * MiB)
    r = run_cmd("mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", image)
    if r.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {r.stderr.strip()}")
    r = run_cmd("losetup", "--find", "--show", image)
    if r.returncode != 0:
        pytest.skip(f"losetup refused to attach a loop device: {r.stderr.strip()}")
    dev = r.stdout.strip()
    # Not under tmp_path: an unprivileged uid must reach the mount point (tmp_path is 0700).
    mnt = tempfile.mkdtemp(prefix="tba-faults-mnt-")
    os.chmod(mnt, 0o755)
    try:
        r = run_cmd("mount", "-t", "ext4", dev, mnt)
        if r.returncode != 0:
            pytest.skip(f"the kernel refused to mount ext4 from {dev}: {r.stderr.strip()}")
        fs = LoopExt4(image, mnt, dev)
        if fs.st_dev == os.stat(os.path.dirname(mnt)).st_dev:
            pytest.fail(f"{mnt} is not a mount point after mount: refusing to go on")
        os.mkdir(fs.root, 0o700)
        yield fs
    finally:
        for _ in range(50):
            if not os.path.ismount(mnt) or run_cmd("umount", mnt).returncode == 0:
                break
            time.sleep(0.1)  # a subprocess may still be closing its files
        else:
            run_cmd("umount", "-l", mnt)
        run_cmd("losetup", "-d", dev)
        with contextlib.suppress(OSError):
            os.rmdir(mnt)


@pytest.fixture
def spill_fs(request):
    """The loop ext4 where the machine allows it, else a plain directory (for the faults that
    need neither root nor a filesystem of their own)."""
    if loop_unavailable() is None:
        yield request.getfixturevalue("loop_ext4")
        return
    base = tempfile.mkdtemp(prefix="tba-faults-dir-")  # not under tmp_path: see loop_ext4
    os.chmod(base, 0o755)
    try:
        yield PlainDir(os.path.join(base, "spill"))
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def offloaders():
    """Build Offloaders; those a test did not close are closed at teardown."""
    made: list[tba.Offloader] = []

    def build(root: str, **kw) -> tba.Offloader:
        off = tba.Offloader(config(root, **kw))
        made.append(off)
        return off

    yield build
    for off in made:
        off.close()


@pytest.fixture(autouse=True)
def no_hidden_errors(caplog):
    """A fault must surface as a typed error or a warning, never as an error only logged from
    an I/O thread (an exception in a future's callback, say)."""
    caplog.set_level(logging.WARNING)
    yield
    errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors
