"""Checks of the spill dir: that tba can make its directories there, the filesystem and its free
space, O_DIRECT on a nameless file, and that nothing is left afterwards (NOTE [Doctor] 2)."""

from __future__ import annotations

import os

from ..config import format_size
from ..errors import ConfigError
from ..storage.blockdev import block_device
from ..storage.slab import open_unnamed
from ..storage.spilldir import SpillDir
from ..storage.statx import dio_alignment, io_alignment
from .probes import _aligned_roundtrip, _our_dirs
from .state import Run, _strip

_RAM_FS = {
    "tmpfs": "tmpfs lives in RAM: spilling there frees no memory",
    "ramfs": "ramfs lives in RAM: spilling there frees no memory",
}
_SLOW_FS = {
    "overlayfs": "an overlay (container) filesystem: spill files go to the container's "
    "copy-on-write layer; mount a host NVMe directory into the container instead",
    "nfs": "a network filesystem: slow, and it shares the network with training",
    "cifs": "a network filesystem: slow, and it shares the network with training",
    "smb2": "a network filesystem: slow, and it shares the network with training",
    "9p": "a 9p (VM host share) filesystem: usually slow",
    "afs": "a network filesystem: slow, and it shares the network with training",
    "lustre": "a parallel network filesystem: shared by every node, and slower per node than a "
    "local drive",
    "gpfs": "a parallel network filesystem: shared by every node, and slower per node than a "
    "local drive",
    "fuse": "a FUSE filesystem: every I/O goes through a user-space daemon (often a network store)",
}


# -- spill dir, filesystem, free space ---------------------------------------------------
def check_spill_dir(d: Run) -> SpillDir | None:
    cfg = d.cfg
    source = {
        "argument": "from --spill-dir",
        "env": "from TBA_SPILL_DIR",
        "default": "the default, /var/tmp/tba-<uid>",
    }[cfg.sources["spill_dir"]]
    try:
        sd = SpillDir(cfg.spill_dir, cfg.rank)
    except (ConfigError, OSError) as e:
        d.set("spill_dir", "FAIL", f"{cfg.spill_dir} ({source}): {_strip(e)}")
        for key in ("filesystem", "free_space", "o_direct", "backend", "write", "read"):
            d.set(key, "skip", "the spill dir is unusable")
        return None
    d.made_dirs.append(sd.path)
    note = "; created for this check, removed afterwards" if d.created else ""
    d.set("spill_dir", "ok", f"{cfg.spill_dir} ({source}): writable{note}")
    return sd


def check_filesystem(d: Run) -> bool:
    """Filesystem type and free space; False when there is less room than the probe."""
    root = d.cfg.spill_dir
    fs = d.probes.fs_type(root)
    found = block_device(root)  # the device the ranks' metrics label their bytes with
    device, mount_point = found.source, found.mount_point
    facts = d.facts["spill_dir"]
    facts.update(fs_type=fs, device=device, mount_point=mount_point)
    where = f"{fs}" + (f" on {device}" if device else "")
    where += f", mounted at {mount_point}" if mount_point else ""
    if fs in _RAM_FS:
        d.set(
            "filesystem",
            "warn",
            f"{where}: {_RAM_FS[fs]}. Point TBA_SPILL_DIR at a local NVMe drive.",
        )
    elif fs in _SLOW_FS:
        d.set("filesystem", "warn", f"{where}: {_SLOW_FS[fs]}. Prefer a local NVMe drive.")
    elif fs.startswith("0x") or fs == "unknown":
        d.set("filesystem", "ok", f"{where} (not a filesystem tba knows)")
    else:
        d.set("filesystem", "ok", where)

    try:
        st = os.statvfs(root)
    except OSError as e:
        d.set("free_space", "FAIL", f"statvfs({root}) failed: {os.strerror(e.errno or 0)}")
        return False
    free = st.f_bavail * st.f_frsize
    total = st.f_blocks * st.f_frsize
    facts.update(free_bytes=free, total_bytes=total)
    probe = d.probe_total()
    text = f"{format_size(free)} free of {format_size(total)}"
    if free < probe:
        d.set(
            "free_space",
            "FAIL",
            f"{text}: less than the {format_size(probe)} probe (--probe-bytes). Free space "
            "on this filesystem, or point --spill-dir/TBA_SPILL_DIR at another drive.",
        )
        return False
    floor = d.cfg.min_free_bytes
    if free <= floor:
        d.set(
            "free_space",
            "warn",
            f"{text}: not above TBA_MIN_FREE_BYTES={format_size(floor)}, so tba would "
            "offload nothing (every tensor stays in memory). Free space or lower "
            "TBA_MIN_FREE_BYTES.",
        )
    else:
        d.set(
            "free_space",
            "ok",
            f"{text}; tba may use {format_size(free - floor)} (it leaves "
            f"TBA_MIN_FREE_BYTES={format_size(floor)})",
        )
    return True


# -- O_DIRECT ------------------------------------------------------------------------------
def check_o_direct(d: Run, sd: SpillDir) -> None:
    facts = d.facts["o_direct"]
    try:
        fd = open_unnamed(sd.fd, sd.path, True, "doctor-probe")
        try:
            dio = dio_alignment(fd)
            align = io_alignment(dio)
            facts.update(dio_mem_align=dio[0], dio_offset_align=dio[1], alignment=align)
            _aligned_roundtrip(fd, align)
        finally:
            os.close(fd)
    except OSError as e:
        facts.update(works=False, error=_strip(e))
        d.set(
            "o_direct",
            "warn",
            f"refused on this filesystem: {_strip(e)} tba falls back to buffered I/O "
            "through the page cache (the buffered backend).",
        )
        return
    facts["works"] = True
    m, o = dio
    if m or o:
        statx = f"statx DIOALIGN: memory {m}, offset {o}"
    else:
        statx = "statx reports no DIO alignment (kernel < 6.1, or the filesystem does not say)"
    d.set(
        "o_direct",
        "ok",
        f"aligned {align}-byte write+read on a nameless file; {statx}; tba aligns to {align}",
    )


# -- cleanup -----------------------------------------------------------------------------
def cleanup(d: Run) -> None:
    facts = d.facts["cleanup"]
    root = d.cfg.spill_dir
    left = [p for p in d.made_dirs if os.path.lexists(p)]
    left += [p for p in _our_dirs(root) if p not in d.ours_before and p not in left]
    removed, kept = [], []
    for comp in reversed(d.created):
        try:
            os.rmdir(comp)
            removed.append(comp)
        except FileNotFoundError:
            continue
        except OSError:
            # Not empty: our leftovers (listed above) or another process's directory.
            kept = [c for c in d.created if os.path.lexists(c)]
            break
    facts.update(clean=not left, leftovers=left, removed=removed)
    if left:
        d.set("cleanup", "FAIL", "left behind: " + ", ".join(left))
        return
    made = len(d.made_dirs)
    what = f"removed its {made} per-process director{'y' if made == 1 else 'ies'}"
    if removed:
        what += f" and {removed[-1]}, which it had created"
    elif made and not kept:
        what += f"; {root} was there before and stays"
    if kept:
        what += f"; kept {kept[0]}: another process uses it now"
    d.set("cleanup", "ok", f"nothing left on disk: {what}")
