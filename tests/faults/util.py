"""The fault suite's helpers: a small ext4 filesystem on a loop device, the model and batch
every fault trains on, and the checks each test ends with.

Every fault is injected from outside tba, through the kernel: a full or fragmented filesystem,
the ext4 shutdown ioctl, a read-only remount, bytes flipped through /proc/self/fd, a chmod under
another uid, SIGKILL. Whatever the machine cannot do (not root, no loop device, no mkfs.ext4,
a kernel that refuses the mount) skips with the reason. Only the loop filesystem made here is
ever shut down or remounted; the fixture checks that it is not the root filesystem first.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import struct
import subprocess
import time

import pytest
import torch
import torch.nn as nn

import tba
from tba.storage.native import engine_status

MiB = 1 << 20

_NATIVE = engine_status()
# The backends with slab files on the spill filesystem; the faults run on each.
BACKENDS = [
    "posix",
    "buffered",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(
            not _NATIVE["built"],
            reason=f"the native engine is not built: {_NATIVE.get('build_error')}",
        ),
    ),
]

# <linux/ext4.h>: EXT4_IOC_SHUTDOWN = _IOR('X', 125, __u32); the flag drops the journal too,
# as a device that vanished would.
EXT4_IOC_SHUTDOWN = (2 << 30) | (4 << 16) | (ord("X") << 8) | 125
EXT4_GOING_FLAGS_NOLOGFLUSH = 2


_INVERT = bytes(b ^ 0xFF for b in range(256))


def flip_spill_bytes(spill_path: str, nbytes: int) -> int:
    """Invert the first ``nbytes`` of every slab file under ``spill_path``, through
    /proc/self/fd (the files have no name; any process allowed to open them can do this).
    Returns how many files were changed."""
    changed = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.startswith(spill_path + "/") or not os.path.isfile(f"/proc/self/fd/{fd}"):
            continue
        with open(f"/proc/self/fd/{fd}", "r+b", buffering=0) as f:
            data = f.read(nbytes)
            f.seek(0)
            f.write(data.translate(_INVERT))
        changed += 1
    return changed


def run_cmd(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def loop_unavailable() -> str | None:
    """Why this machine cannot mount a loop ext4 here, or None when it can."""
    if os.geteuid() != 0:
        return f"needs root to attach a loop device and mount it (running as uid {os.geteuid()})"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control: this kernel or container has no loop devices"
    for tool in ("mkfs.ext4", "losetup", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (e2fsprogs, util-linux)"
    with open("/proc/filesystems") as f:
        if not any(line.split()[-1:] == ["ext4"] for line in f):
            return "the kernel has no ext4 (not in /proc/filesystems)"
    return None


class LoopExt4:
    """An ext4 filesystem in an image file under pytest's tmp_path, mounted through a loop
    device. ``root`` is the spill root tests give tba (``<mount>/spill``)."""

    def __init__(self, image: str, mnt: str, dev: str):
        self.image = image
        self.mnt = mnt
        self.dev = dev
        self.root = os.path.join(mnt, "spill")
        self.st_dev = os.stat(mnt).st_dev

    # -- measurements ---------------------------------------------------------------------
    def counts(self) -> tuple[int, int]:
        """(free blocks, free inodes), after a sync (ext4 returns freed blocks to the free
        count when the journal commits)."""
        os.sync()
        st = os.statvfs(self.mnt)
        return st.f_bfree, st.f_ffree

    def baseline(self) -> tuple[int, int]:
        """The counts to come back to: take it before the first Offloader."""
        return self.counts()

    def free_bytes(self) -> int:
        st = os.statvfs(self.mnt)
        return st.f_bavail * st.f_frsize

    def block_bytes(self) -> int:
        return os.statvfs(self.mnt).f_frsize

    def files_under_root(self) -> list[str]:
        """Every path under the spill root (directories included), relative to it."""
        found = []
        for top, dirs, files in os.walk(self.root):
            found += [os.path.relpath(os.path.join(top, n), self.root) for n in dirs + files]
        return sorted(found)

    def assert_no_bytes_left(self, baseline: tuple[int, int], timeout: float = 15.0) -> None:
        """Nothing under the spill root, and the filesystem's free blocks and inodes back to
        ``baseline`` exactly (waiting for the journal to commit the frees)."""
        assert self.files_under_root() == [], self.files_under_root()
        deadline = time.monotonic() + timeout
        now = self.counts()
        while now != baseline and time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.counts()
        bs = self.block_bytes()
        assert now == baseline, (
            f"free blocks {now[0]} (baseline {baseline[0]}: {(baseline[0] - now[0]) * bs} bytes "
            f"still used), free inodes {now[1]} (baseline {baseline[1]})"
        )

    # -- faults ---------------------------------------------------------------------------
    def _own_fd(self) -> int:
        """An fd on the mount point, checked to be this loop filesystem and not the root one."""
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY)
        dev = os.fstat(fd).st_dev
        if dev != self.st_dev or dev == os.stat("/").st_dev:
            os.close(fd)
            raise RuntimeError(f"{self.mnt} is not the loop filesystem any more; not touching it")
        return fd

    def shutdown(self) -> None:
        """The ext4 shutdown ioctl: from now on every I/O on this filesystem fails with EIO.
        A sync first commits what was made before (the per-process directory, the nameless
        slabs on the orphan list), so what survives does not depend on the journal's timer."""
        fd = self._own_fd()
        os.sync()
        try:
            fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
        finally:
            os.close(fd)

    def remount(self, mode: str) -> subprocess.CompletedProcess:
        """``mount -o remount,<mode>`` of this filesystem (never another)."""
        os.close(self._own_fd())
        return run_cmd("mount", "-o", f"remount,{mode}", self.mnt)

    def must_remount(self, mode: str) -> None:
        """:meth:`remount`, which must succeed."""
        r = self.remount(mode)
        assert r.returncode == 0, f"mount -o remount,{mode}: {r.stderr.strip()}"

    def cycle(self) -> None:
        """Unmount and mount again: after a shutdown, the journal replays and the orphan list
        (nameless files still open at the shutdown) is cleaned, so the counts mean something."""
        deadline = time.monotonic() + 10
        # io_uring drops a closed ring's registered files from a kernel worker, a moment
        # after the close: the native backend's slabs may hold the mount that long.
        while (r := run_cmd("umount", self.mnt)).returncode != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.returncode == 0, f"umount {self.mnt}: {r.stderr.strip()} (a file left open?)"
        r = run_cmd("mount", "-t", "ext4", self.dev, self.mnt)
        assert r.returncode == 0, f"mount {self.dev}: {r.stderr.strip()}"
        self.st_dev = os.stat(self.mnt).st_dev

    def fill(self, piece: int = 256 << 10) -> list[str]:
        """Fill the filesystem with files of ``piece`` bytes (fallocated) until ENOSPC."""
        hog = os.path.join(self.mnt, "hog")
        os.makedirs(hog, exist_ok=True)
        made = []
        while True:
            path = os.path.join(hog, str(len(made)))
            fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
            try:
                os.posix_fallocate(fd, 0, piece)
            except OSError:
                os.close(fd)
                os.unlink(path)
                return made
            os.close(fd)
            made.append(path)

    def remove_hog(self) -> None:
        """Delete what :meth:`fill` made."""
        shutil.rmtree(os.path.join(self.mnt, "hog"))

    def fragment(self, free: int, piece: int = 256 << 10) -> int:
        """Fill the filesystem, then delete every other file until at least ``free`` bytes are
        free: free space in holes of ``piece`` bytes, so a file that takes all of it needs
        more extents than its inode holds, hence a block more than statvfs says is free.
        Returns the free bytes."""
        made = self.fill(piece)
        for path in made[::2]:
            if self.free_bytes() >= free:
                break
            os.unlink(path)
        os.sync()
        return self.free_bytes()


class PlainDir:
    """Where no loop filesystem can be made: a plain spill root, for the faults that need no
    filesystem of their own. Bytes left are checked by listing only (statvfs of a shared filesystem
    cannot tell tba's blocks from another writer's)."""

    def __init__(self, root: str):
        self.root = root
        os.mkdir(root, 0o700)

    def baseline(self) -> None:
        return None

    def files_under_root(self) -> list[str]:
        return LoopExt4.files_under_root(self)  # type: ignore[arg-type]

    def assert_no_bytes_left(self, baseline: None) -> None:
        assert self.files_under_root() == [], self.files_under_root()


# -- what every fault trains ----------------------------------------------------------------
WIDTH = 128  # narrow: little compute for the bytes saved (each activation is rows x 512 B)


def make_model(layers: int = 4, seed: int = 0) -> nn.Module:
    """An MLP: each Linear saves its input and each GELU its own, so a step saves
    ``2 * layers`` activations of the batch's size."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*mods, nn.Linear(WIDTH, 1))


def make_batch(mib: float, seed: int = 1) -> torch.Tensor:
    """A batch whose activations are ``mib`` MiB each."""
    rows = int(mib * MiB) // (WIDTH * 4)
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed))


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of one step without tba: what every run with tba must match bit for bit."""
    model.zero_grad(set_to_none=True)
    loss_of(model, x).backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def assert_exact(model: nn.Module, want: list[torch.Tensor]) -> None:
    got = [p.grad for p in model.parameters()]
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g is None or not torch.equal(g, w)]
    assert not bad, f"gradients of parameters {bad} differ from the run without tba"


def config(root: str, **kw) -> tba.Config:
    """Test-sized settings: offload everything (no keep-last, no size floor, no free floor)."""
    kw.setdefault("spill_dir", root)
    kw.setdefault("min_offload_bytes", 1)
    kw.setdefault("keep_last", 0)
    kw.setdefault("staging_bytes", "128MiB")  # never full here: a kept reason names the fault
    kw.setdefault("prefetch_bytes", "16MiB")
    kw.setdefault("slab_bytes", "4MiB")
    kw.setdefault("min_free_bytes", 0)
    return tba.Config(environ={}, **kw)


def sweep(root: str) -> None:
    """What the next Offloader on the node does at start: remove the empty directories of
    per-process spill dirs no process holds (NOTE [Spill directory safety] 3)."""
    tba.Offloader(config(root)).close()


def train_step(off: tba.Offloader, model: nn.Module, x: torch.Tensor) -> dict:
    """One step with ``off``: forward under it, backward, writes settled; returns its stats,
    checked to count every saved tensor once."""
    model.zero_grad(set_to_none=True)
    with off.step(model):
        loss = loss_of(model, x)
    loss.backward()
    off.synchronize()
    st = off.stats()
    # NOTE [Counted once] in tba/records/reasons.py holds under faults too.
    ends = st["tensors_offloaded"] + st["tensors_kept"] + st["dedup_hits"]
    assert ends + st["recomputed_tensors"] == st["packs"], st
    assert sum(st["kept_reasons"].values()) == st["tensors_kept"], st
    return st


def warnings_text(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("tba"))


def tba_warnings(caplog) -> list[str]:
    """tba's WARNING records: one per cause (issue 15 item 3), not one per layer or step."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("tba") and r.levelno == logging.WARNING
    ]
