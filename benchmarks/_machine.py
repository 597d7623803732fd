"""The machine line every benchmark prints next to its figures."""

from __future__ import annotations

import os
import platform
import subprocess

import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _fs_type(path: str) -> str:
    best, fstype = "", "unknown"
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, fstype = mnt, f"{parts[2]} on {parts[0]}"
    except OSError:
        pass
    return fstype


def _commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def machine_line(spill_dir: str) -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"machine: {_cpu_model()}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, "
        f"kernel {platform.release()}, spill dir {spill_dir} ({_fs_type(spill_dir)}), "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), commit {_commit()}"
    )
