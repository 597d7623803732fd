"""The machine line every benchmark prints next to its figures."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import torch

from tba.storage.statx import fs_type


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _disk(path: str) -> str:
    """The block device under ``path``, with its model or driver when sysfs tells."""
    try:
        st = os.stat(path)
        dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
    except OSError:
        return "unknown disk"
    for sub in ("device/model", "../device/model"):
        p = dev / sub
        if p.exists():
            return f"{dev.name} ({p.read_text().strip()})"
    drv = dev / "device/driver"
    return f"{dev.name} ({drv.resolve().name})" if drv.exists() else dev.name


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
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
        f"kernel {platform.release()}, spill dir {spill_dir} ({fs_type(spill_dir)} on "
        f"{_disk(spill_dir)}), python {platform.python_version()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), commit {_commit()}"
    )


def dump_json(path: str | None, spill_dir: str, **parts) -> None:
    """Write ``{"machine": machine_line(spill_dir), **parts}`` to ``path`` (None: nothing)."""
    if path:
        with open(path, "w") as f:
            json.dump({"machine": machine_line(spill_dir), **parts}, f, indent=2)
