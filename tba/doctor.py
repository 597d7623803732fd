"""``tba doctor``: check a node before a training run, and say which ``TBA_*`` settings fit it.

NOTE [Doctor]
1. Every check is one row: a key, a status and a one-line detail. The status is ``ok``,
   ``warn``, ``FAIL``, or ``skip`` (not run because a check it depends on failed). Any FAIL means
   the spill dir is unusable and the exit code is 1; warnings alone leave it at 0.
2. It writes only inside the spill dir, through the same code tba uses: per-process directories
   made by :class:`SpillDir` (removed on close), nameless files (``O_TMPFILE``, or unlinked at
   once), and the components of the root that did not exist before the run, which are removed
   at the end when still empty. The ``cleanup`` row checks that nothing is left, also after a
   probe that failed midway.
3. Throughput goes through the backend tba would use (``auto``'s pick, or the one named), on
   16 MiB extents of one preallocated slab with several requests in flight: one write pass
   (first writes into preallocated space, as in the first training step), then read passes with
   1, 2, 4 and 8 requests in flight. Under O_DIRECT every read comes from the device. Each 4 KiB
   block carries a tag (run, extent, block) that the reads check, so a misplaced or stale block
   fails the probe, and no two blocks are identical (a deduplicating device cannot cheat).
4. The native engine (``tba.storage.native``) and kvikio (``tba.storage.kvikio``) are optional
   modules, imported lazily; a missing module is reported, never raised.
5. The recommendations are rules of thumb, each stated next to its code in
   :func:`_recommend` and printed with its reason. The doctor measures one node at one moment.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import errno
import importlib
import json
import logging
import math
import os
import platform
import resource
import shlex
import textwrap
import time
import warnings
from concurrent.futures import Future
from typing import Any

import numpy as np

from . import __version__
from ._memory import align_up, aligned_empty, as_memoryview
from .config import Config, format_size
from .errors import ConfigError
from .storage import open_backend
from .storage.blockdev import block_device
from .storage.slab import open_unnamed
from .storage.spilldir import SpillDir, dir_name_pattern, host_tag
from .storage.statx import dio_alignment, fs_type, io_alignment

__all__ = [
    "DEFAULT_PROBE_BYTES",
    "Check",
    "Recommendation",
    "Report",
    "run",
    "render_json",
    "render_table",
]

GIB = 1 << 30
MIB = 1 << 20
DEFAULT_PROBE_BYTES = 256 * MIB
MIN_PROBE_BYTES = MIB
EXTENT_BYTES = 16 * MIB
SWEEP = (1, 2, 4, 8)  # requests in flight for the read passes; also the most buffers we hold
TABLE_WIDTH = 100

STATUSES = ("ok", "warn", "FAIL", "skip")

# (key, label) of every row, in table order. JSON uses the keys.
ROWS = (
    ("config", "config"),
    ("spill_dir", "spill dir"),
    ("filesystem", "filesystem"),
    ("free_space", "free space"),
    ("o_direct", "O_DIRECT"),
    ("io_uring", "io_uring"),
    ("native_engine", "native engine"),
    ("memlock", "memlock"),
    ("host_malloc", "host malloc"),
    ("kvikio", "kvikio/GDS"),
    ("cuda", "CUDA"),
    ("backend", "backend"),
    ("write", "write"),
    ("read", "read"),
    ("cleanup", "cleanup"),
)

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
_SLOW_GIB_S = 0.5  # below this a measured rate gets a warning (a SATA SSD does about 0.5)

# The fix printed when the native engine is not built and its build_error names no fix.
_NATIVE_FIX = (
    "reinstall tba where a C compiler is available (e.g. apt-get install gcc, then pip install "
    "-e . -v), or use TBA_BACKEND=posix"
)

_NO_VALUE: Any = object()  # "the engine did not say" (None means unlimited)


# -- results -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Check:
    key: str
    label: str
    status: str
    detail: str


@dataclasses.dataclass
class Recommendation:
    env: str
    value: str | None  # None: advice only, printed as a comment, nothing to export
    reason: str

    @property
    def line(self) -> str:
        if self.value is None:
            return f"# {self.env}: {self.reason}"
        return f"export {self.env}={shlex.quote(self.value)}"


@dataclasses.dataclass
class Report:
    checks: dict[str, Check]
    facts: dict[str, Any]
    recommendations: list[Recommendation]
    elapsed: float = 0.0

    @property
    def exit_code(self) -> int:
        return 1 if any(c.status == "FAIL" for c in self.checks.values()) else 0

    @property
    def problem(self) -> str | None:
        """The first failed check, as ``label: detail``; None when the spill dir is usable."""
        for c in self.checks.values():
            if c.status == "FAIL":
                return f"{c.label}: {c.detail}"
        return None

    def as_json(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "usable": self.exit_code == 0,
            "exit_code": self.exit_code,
            "problem": self.problem,
            "elapsed_seconds": round(self.elapsed, 3),
            "checks": {k: {"status": c.status, "detail": c.detail} for k, c in self.checks.items()},
            **self.facts,
            "recommendations": [
                {
                    "env": r.env,
                    "value": r.value,
                    "reason": r.reason,
                    "export": r.line if r.value is not None else None,
                }
                for r in self.recommendations
            ],
        }


class _Doctor:
    """One run: fills the rows and the facts; see :func:`run`."""

    def __init__(self, cfg: Config, probe_bytes: int, environ: dict[str, str]):
        self.cfg = cfg
        self.probe_bytes = probe_bytes
        self.environ = environ
        self.checks = {k: Check(k, label, "skip", "not run") for k, label in ROWS}
        self.facts: dict[str, Any] = {
            "probe_bytes": probe_bytes,
            "spill_dir": {
                "root": cfg.spill_dir,
                "source": cfg.sources["spill_dir"],
                "created_root": False,
                "fs_type": None,
                "device": None,
                "mount_point": None,
                "free_bytes": None,
                "total_bytes": None,
            },
            "o_direct": {
                "works": None,
                "error": None,
                "dio_mem_align": None,
                "dio_offset_align": None,
                "alignment": None,
            },
            "io_uring": {"available": None, "reason": None, "source": None, "sysctl": None},
            "native": {
                "module": False,
                "error": None,
                "built": None,
                "library": None,
                "build_error": None,
            },
            "memlock": {
                "limit_bytes": None,
                "unlimited": False,
                "cap_ipc_lock": False,
                "needed_bytes": cfg.staging_bytes,
            },
            "kvikio": {
                "module": False,
                "error": None,
                "importable": None,
                "version": None,
                "gds_available": None,
                "compat_mode": None,
                "reason": None,
            },
            "cuda": {
                "torch": None,
                "built": False,
                "available": False,
                "device_count": 0,
                "devices": [],
            },
            "backend": {
                "requested": cfg.backend,
                "auto": None,
                "auto_reason": None,
                "name": None,
                "reason": None,
                "alignment": None,
                "error": None,
            },
            "throughput": {
                "bytes": None,
                "extent_bytes": None,
                "extents": None,
                "in_flight": None,
                "write_gib_s": None,
                "write_seconds": None,
                "read_gib_s": None,
                "read_seconds": None,
                "read_sweep_gib_s": {},
                "error": None,
            },
            "cleanup": {"clean": None, "leftovers": [], "removed": []},
            "host_malloc": {"malloc": None, "library": None, "suggested": None},
        }
        self.made_dirs: list[str] = []  # per-process directories this run made
        self.created: list[str] = []  # root components that did not exist, shallowest first
        self.ours_before: set[str] = set()  # this pid's directories already there (Offloaders)
        self.memlock_from_engine: Any = _NO_VALUE

    def set(self, key: str, status: str, detail: str) -> None:
        assert status in STATUSES, status
        c = self.checks[key]
        c.status, c.detail = status, detail

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> None:
        self.check_config()
        self.check_native_and_io_uring()
        self.check_kvikio_and_cuda()
        self.check_memlock()
        self.check_host_malloc()
        root = self.cfg.spill_dir
        self.created = _missing_components(root)
        self.facts["spill_dir"]["created_root"] = bool(self.created)
        self.ours_before = set(_our_dirs(root))
        try:
            sd = self.check_spill_dir()
            if sd is not None:
                try:
                    room = self.check_filesystem()
                    self.check_o_direct(sd)
                finally:
                    sd.close()
                backend = self.check_backend()
                if backend is not None:
                    try:
                        if room:
                            self.measure(backend)
                        else:
                            self.set("write", "skip", "not enough free space for the probe")
                            self.set("read", "skip", "not enough free space for the probe")
                    finally:
                        backend.close()
        finally:
            self.cleanup()

    # -- config ----------------------------------------------------------------------------
    def check_config(self) -> None:
        cfg = self.cfg
        set_vars = sorted(k for k in self.environ if k.startswith("TBA_"))
        shown = ", ".join(f"{k}={self.environ[k]}" for k in set_vars)
        detail = f"from the environment: {shown}" if shown else "no TBA_* variables set: defaults"
        if not cfg.enabled:
            self.set("config", "warn", f"TBA_ENABLED=0: tba is switched off here; {detail}")
        else:
            self.set("config", "ok", detail)

    # -- spill dir, filesystem, free space ---------------------------------------------------
    def check_spill_dir(self) -> SpillDir | None:
        cfg = self.cfg
        source = {
            "argument": "from --spill-dir",
            "env": "from TBA_SPILL_DIR",
            "default": "the default, /var/tmp/tba-<uid>",
        }[cfg.sources["spill_dir"]]
        try:
            sd = SpillDir(cfg.spill_dir, cfg.rank)
        except (ConfigError, OSError) as e:
            self.set("spill_dir", "FAIL", f"{cfg.spill_dir} ({source}): {_strip(e)}")
            for key in ("filesystem", "free_space", "o_direct", "backend", "write", "read"):
                self.set(key, "skip", "the spill dir is unusable")
            return None
        self.made_dirs.append(sd.path)
        note = "; created for this check, removed afterwards" if self.created else ""
        self.set("spill_dir", "ok", f"{cfg.spill_dir} ({source}): writable{note}")
        return sd

    def check_filesystem(self) -> bool:
        """Filesystem type and free space; False when there is less room than the probe."""
        root = self.cfg.spill_dir
        fs = fs_type(root)
        found = block_device(root)  # the device the ranks' metrics label their bytes with
        device, mount_point = found.source, found.mount_point
        facts = self.facts["spill_dir"]
        facts.update(fs_type=fs, device=device, mount_point=mount_point)
        where = f"{fs}" + (f" on {device}" if device else "")
        where += f", mounted at {mount_point}" if mount_point else ""
        if fs in _RAM_FS:
            self.set(
                "filesystem",
                "warn",
                f"{where}: {_RAM_FS[fs]}. Point TBA_SPILL_DIR at a local NVMe drive.",
            )
        elif fs in _SLOW_FS:
            self.set("filesystem", "warn", f"{where}: {_SLOW_FS[fs]}. Prefer a local NVMe drive.")
        elif fs.startswith("0x") or fs == "unknown":
            self.set("filesystem", "ok", f"{where} (not a filesystem tba knows)")
        else:
            self.set("filesystem", "ok", where)

        try:
            st = os.statvfs(root)
        except OSError as e:
            self.set("free_space", "FAIL", f"statvfs({root}) failed: {os.strerror(e.errno or 0)}")
            return False
        free = st.f_bavail * st.f_frsize
        total = st.f_blocks * st.f_frsize
        facts.update(free_bytes=free, total_bytes=total)
        probe = self.probe_total()
        text = f"{format_size(free)} free of {format_size(total)}"
        if free < probe:
            self.set(
                "free_space",
                "FAIL",
                f"{text}: less than the {format_size(probe)} probe (--probe-bytes). Free space "
                "on this filesystem, or point --spill-dir/TBA_SPILL_DIR at another drive.",
            )
            return False
        floor = self.cfg.min_free_bytes
        if free <= floor:
            self.set(
                "free_space",
                "warn",
                f"{text}: not above TBA_MIN_FREE_BYTES={format_size(floor)}, so tba would "
                "offload nothing (every tensor stays in memory). Free space or lower "
                "TBA_MIN_FREE_BYTES.",
            )
        else:
            self.set(
                "free_space",
                "ok",
                f"{text}; tba may use {format_size(free - floor)} (it leaves "
                f"TBA_MIN_FREE_BYTES={format_size(floor)})",
            )
        return True

    def probe_total(self, align: int = 4096) -> int:
        extent = min(EXTENT_BYTES, align_up(self.probe_bytes, align))
        return math.ceil(self.probe_bytes / extent) * extent

    # -- O_DIRECT ------------------------------------------------------------------------------
    def check_o_direct(self, sd: SpillDir) -> None:
        facts = self.facts["o_direct"]
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
            self.set(
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
        self.set(
            "o_direct",
            "ok",
            f"aligned {align}-byte write+read on a nameless file; {statx}; tba aligns to {align}",
        )

    # -- native engine, io_uring, memlock -----------------------------------------------------
    def check_native_and_io_uring(self) -> None:
        nat = self.facts["native"]
        uring = self.facts["io_uring"]
        sysctl = _read_int("/proc/sys/kernel/io_uring_disabled")
        uring["sysctl"] = sysctl
        status, err = _optional_status("tba.storage.native", "engine_status")
        if status is None:
            nat["error"] = err
            missing = err is not None and err.startswith("not in this install")
            self.set(
                "native_engine",
                "ok" if missing else "warn",
                f"{err}; auto uses the posix backend (thread pool)",
            )
        else:
            nat["module"] = True
            for k in ("built", "library", "build_error"):
                nat[k] = status.get(k)
            if status.get("built"):
                self.set("native_engine", "ok", f"built: {status.get('library') or '?'}")
            else:
                why = (status.get("build_error") or "no reason given").rstrip(". ")
                # The engine's own message usually ends with the fix; add ours when it does not.
                fix = "" if "install" in why.lower() else f". Fix: {_NATIVE_FIX}"
                self.set(
                    "native_engine",
                    "warn",
                    f"not built: {why}{fix}. Until then auto uses the posix backend.",
                )
            self.memlock_from_engine = status.get("memlock_bytes", _NO_VALUE)
        if status is not None and status.get("built"):
            uring.update(
                available=bool(status.get("io_uring")),
                reason=status.get("io_uring_reason") or "",
                source="native engine",
            )
        else:
            # Without a built engine, ask the kernel directly (io_uring_setup, a 1-entry ring):
            # whether io_uring works here does not depend on the build.
            ok, why = _probe_io_uring()
            uring.update(available=ok, reason=why, source="doctor probe")
        ok, why = uring["available"], uring["reason"] or ""
        if ok:
            self.set("io_uring", "ok", f"available ({why})" if why else "available")
        elif ok is None:
            self.set("io_uring", "ok", f"not checked: {why}")
        else:
            hint = _io_uring_hint(why, sysctl)
            self.set(
                "io_uring",
                "warn",
                f"unavailable: {why}.{hint} The native engine then runs a thread pool of "
                "TBA_IO_DEPTH threads instead.",
            )

    def check_memlock(self) -> None:
        facts = self.facts["memlock"]
        limit = self.memlock_from_engine
        if limit is _NO_VALUE:
            soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            limit = None if soft == resource.RLIM_INFINITY else soft
        cap = _has_cap_ipc_lock()
        need = self.cfg.staging_bytes
        facts.update(limit_bytes=limit, unlimited=limit is None, cap_ipc_lock=cap)
        what = (
            "io_uring registered (fixed) buffers are pinned and charged to RLIMIT_MEMLOCK; the "
            f"native engine registers the staging pool (TBA_STAGING_BYTES={format_size(need)}) "
            "when it is pinned CUDA memory, or with TBA_CHECKSUM on"
        )
        fallback = (
            "I/O still works through unregistered buffers, whose pages the kernel pins on "
            "every request"
        )
        if limit is None:
            self.set("memlock", "ok", f"unlimited: {what}, and any size fits")
            return
        shown = f"{format_size(limit)} (ulimit -l {limit // 1024})"
        if cap:
            self.set(
                "memlock",
                "ok",
                f"{shown}, but this process has CAP_IPC_LOCK, so io_uring does not charge "
                "registered buffers to it",
            )
        elif limit >= need:
            self.set("memlock", "ok", f"{shown}: {what}, which fits")
        else:
            relevant = bool(self.facts["native"]["built"]) and bool(
                self.facts["io_uring"]["available"]
            )
            fix = (
                "raise it: ulimit -l unlimited, systemd LimitMEMLOCK=infinity, or docker run "
                "--ulimit memlock=-1"
            )
            if relevant:
                self.set(
                    "memlock",
                    "warn",
                    f"{shown}: {what}, which does not fit: registration fails and {fallback}; "
                    f"{fix}",
                )
            else:
                self.set(
                    "memlock",
                    "ok",
                    f"{shown}: too small for the native engine to register its "
                    f"{format_size(need)} staging pool, but that engine is not in use here; "
                    f"before enabling it, {fix}",
                )

    def check_host_malloc(self) -> None:
        """Which malloc serves this process's CPU tensors, and whether it gives back what tba
        frees early (BENCHMARKS.md, "Batch headroom")."""
        facts = self.facts["host_malloc"]
        name, lib = malloc_in_use(_read_text("/proc/self/maps"))
        facts.update(malloc=name, library=lib)
        if name != "glibc":
            self.set(
                "host_malloc",
                "ok",
                f"{name} ({lib}): reuses the memory autograd frees once tba has written a tensor",
            )
            return
        if self.facts["cuda"]["available"]:
            self.set(
                "host_malloc",
                "ok",
                "glibc malloc; activations live in the CUDA caching allocator, which reuses "
                "what tba frees at once",
            )
            return
        found = find_tcmalloc()
        facts["suggested"] = found
        fix = (
            f"run training with LD_PRELOAD={found}"
            if found
            else "install tcmalloc (Debian/Ubuntu: apt install libtcmalloc-minimal4) and run "
            "training with LD_PRELOAD set to its libtcmalloc_minimal.so.4"
        )
        self.set(
            "host_malloc",
            "warn",
            "glibc malloc with CPU tensors: the memory autograd frees once tba has written a "
            "tensor mostly stays in glibc's heap, so a larger batch gains little (W1 under a "
            "1280 MiB cap: 1.25-1.4x the batch with glibc, 2.8x with tcmalloc, whose steps were "
            f"not slower; BENCHMARKS.md); {fix}",
        )

    # -- kvikio, CUDA ------------------------------------------------------------------------
    def check_kvikio_and_cuda(self) -> None:
        cuda = self.facts["cuda"]
        import torch  # already imported by tba

        cuda["torch"] = torch.__version__
        cuda["built"] = bool(torch.backends.cuda.is_built())
        if not cuda["built"]:
            self.set(
                "cuda",
                "ok",
                f"none: torch {torch.__version__} is a CPU build; saved tensors are offloaded "
                "from host memory",
            )
        elif torch.cuda.is_available():
            n = torch.cuda.device_count()
            names = [torch.cuda.get_device_name(i) for i in range(n)]
            cuda.update(available=True, device_count=n, devices=names)
            counted = collections.Counter(names)
            listing = ", ".join(f"{c} x {name}" for name, c in counted.items())
            self.set(
                "cuda",
                "ok",
                f"{n} device(s): {listing}; torch {torch.__version__}, CUDA {torch.version.cuda}",
            )
        else:
            visible = self.environ.get("CUDA_VISIBLE_DEVICES")
            hidden = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            self.set(
                "cuda",
                "warn",
                f"torch {torch.__version__} is built with CUDA {torch.version.cuda} but sees no "
                f"device{hidden}: no driver, or the devices are hidden",
            )

        kv = self.facts["kvikio"]
        status, err = _optional_status("tba.storage.kvikio", "kvikio_status")
        gpu = cuda["available"]
        if status is None:
            kv["error"] = err
            self.set("kvikio", "ok", f"{err}; only useful with CUDA and GPUDirect Storage")
            return
        kv["module"] = True
        for k in ("importable", "version", "gds_available", "compat_mode", "reason"):
            kv[k] = status.get(k)
        why = status.get("reason") or ""
        if not status.get("importable"):
            why = why or "kvikio is not importable"
            extra = "" if gpu else "; only useful with a CUDA device and GPUDirect Storage"
            self.set("kvikio", "ok", f"{why}{extra}")
            return
        name = f"kvikio {status.get('version') or '?'}"
        mode = status.get("compat_mode")
        mode_s = f", compat mode {mode}" if mode is not None else ""
        gds = status.get("gds_available")
        if gds:
            if gpu:
                self.set("kvikio", "ok", f"{name}: GDS available{mode_s}; auto prefers kvikio")
            else:
                self.set("kvikio", "warn", f"{name}: GDS reported, but no CUDA device is visible")
        elif gds is None:
            self.set("kvikio", "warn", f"{name}: GDS status unknown{mode_s}: {why}")
        else:
            self.set(
                "kvikio",
                "warn",
                f"{name} without GDS{mode_s}: it would move data through host bounce buffers "
                f"(compat mode), so auto does not pick it. {why}".rstrip(),
            )

    # -- backend and throughput -------------------------------------------------------------
    def _probe_cfg(self, backend: str) -> Config:
        # One slab holds the whole probe; no quota and no free-space floor (free space was
        # checked against the probe size above); enough threads for the widest sweep.
        fields = self.cfg.as_dict()
        fields.update(
            backend=backend,
            slab_bytes=max(MIB, self.probe_total()),
            max_disk_bytes=None,
            min_free_bytes=0,
            io_threads=max(self.cfg.io_threads, max(SWEEP)),
            io_depth=max(self.cfg.io_depth, max(SWEEP)),
        )
        return Config(environ={}, **fields)

    def _open(self, name: str):
        b = open_backend(self._probe_cfg(name))
        path = getattr(b, "spill_path", None)
        if path:
            self.made_dirs.append(path)
        return b

    def check_backend(self):
        """Open auto (and the requested backend if another); return the one to measure."""
        facts = self.facts["backend"]
        requested = self.cfg.backend
        auto = None
        try:
            auto = self._open("auto")
            facts.update(auto=auto.name, auto_reason=auto.reason)
        except Exception as e:  # a broken backend module must not stop the doctor
            facts["auto_reason"] = _why(e)
            if requested == "auto":
                facts["error"] = _why(e)
                self.set("backend", "FAIL", f"auto: {_why(e)}")
                self._no_backend()
                return None
        if requested == "auto":
            b = auto
            detail = f"auto picks {b.name}: {_strip_prefix(b.reason).removeprefix('auto: ')}"
        else:
            if auto is not None:
                auto.close()
            try:
                b = self._open(requested)
            except Exception as e:
                facts["error"] = _why(e)
                self.set("backend", "FAIL", f"TBA_BACKEND={requested}: {_why(e)}")
                self._no_backend()
                return None
            reason = _strip_prefix(b.reason).removeprefix(f"TBA_BACKEND={requested}: ")
            detail = (
                f"{b.name} (TBA_BACKEND={requested}; auto would pick {facts['auto']}): {reason}"
            )
        facts.update(name=b.name, reason=b.reason, alignment=b.alignment)
        if b.name == "buffered":
            self.set(
                "backend",
                "warn",
                f"{detail}. O_DIRECT does not work here, so spill I/O goes through the page cache.",
            )
        elif b.name == "memory":
            self.set("backend", "warn", f"{detail}. Nothing is written to disk.")
        else:
            self.set("backend", "ok", detail)
        return b

    def _no_backend(self) -> None:
        self.set("write", "skip", "no backend to measure")
        self.set("read", "skip", "no backend to measure")

    def measure(self, backend) -> None:
        t = self.facts["throughput"]
        align = backend.alignment
        # Whole 4 KiB blocks, for the tags (see NOTE 3).
        extent = min(EXTENT_BYTES, align_up(self.probe_bytes, max(align, 4096)))
        count = math.ceil(self.probe_bytes / extent)
        total = count * extent
        native = backend.name == "native"
        configured = self.cfg.io_depth if native else self.cfg.io_threads
        nbufs = min(max(SWEEP), count)
        window = max(1, min(configured, nbufs))
        t.update(bytes=total, extent_bytes=extent, extents=count, in_flight=window)
        extents = []
        try:
            for _ in range(count):
                e = backend.allocate(extent)
                if e is None:
                    raise _ProbeFailed(
                        f"could not allocate {format_size(extent)} for the probe (quota or free "
                        f"space): {backend.usage()}"
                    )
                extents.append(e)
            tensors = [aligned_empty(extent, align) for _ in range(nbufs)]
            for x in tensors:
                x.random_(0, 256)
            bufs = [as_memoryview(x) for x in tensors]
            tag = int.from_bytes(os.urandom(8), "little") | 1
            dt = _pass(backend, extents, bufs, window, True, tag)
            t.update(write_gib_s=round(total / dt / GIB, 3), write_seconds=round(dt, 3))
            sweep = sorted({w for w in SWEEP if w <= nbufs} | {window})
            rates: dict[int, float] = {}
            for w in sweep:
                dt_r = _pass(backend, extents, bufs, w, False, tag)
                rates[w] = total / dt_r / GIB
                if w == window:
                    t.update(read_gib_s=round(rates[w], 3), read_seconds=round(dt_r, 3))
            t["read_sweep_gib_s"] = {str(w): round(r, 3) for w, r in rates.items()}
        except Exception as e:  # StorageError, _ProbeFailed, or a backend's own bug
            t["error"] = _why(e)
            done = "write" if t["write_gib_s"] is None else "read"
            self.set(done, "FAIL", f"probe failed: {_why(e)}")
            if done == "write":
                self.set("read", "skip", "the write probe failed")
            return
        finally:
            for e in extents:
                backend.free(e)
        how = f"{format_size(total)} in {count} x {format_size(extent)}, {window} in flight"
        w_rate, r_rate = t["write_gib_s"], t["read_gib_s"]
        self.set(
            "write",
            _rate_status(w_rate),
            f"{w_rate:.2f} GiB/s: {how}, {t['write_seconds']:.2f} s (first write into "
            "preallocated space)" + _slow_note(w_rate),
        )
        source = (
            "from the device (O_DIRECT)"
            if getattr(backend, "direct", False) or backend.name in ("native", "kvikio")
            else "partly from the page cache"
            if backend.name == "buffered"
            else "from host memory"
        )
        sweep_s = ", ".join(f"{w}: {r:.2f}" for w, r in rates.items())
        self.set(
            "read",
            _rate_status(r_rate),
            f"{r_rate:.2f} GiB/s: {how}, {t['read_seconds']:.2f} s, {source}; GiB/s by requests "
            f"in flight: {sweep_s}" + _slow_note(r_rate),
        )

    # -- cleanup -----------------------------------------------------------------------------
    def cleanup(self) -> None:
        facts = self.facts["cleanup"]
        root = self.cfg.spill_dir
        left = [p for p in self.made_dirs if os.path.lexists(p)]
        left += [p for p in _our_dirs(root) if p not in self.ours_before and p not in left]
        removed, kept = [], []
        for comp in reversed(self.created):
            try:
                os.rmdir(comp)
                removed.append(comp)
            except FileNotFoundError:
                continue
            except OSError:
                # Not empty: our leftovers (listed above) or another process's directory.
                kept = [c for c in self.created if os.path.lexists(c)]
                break
        facts.update(clean=not left, leftovers=left, removed=removed)
        if left:
            self.set("cleanup", "FAIL", "left behind: " + ", ".join(left))
            return
        made = len(self.made_dirs)
        what = f"removed its {made} per-process director{'y' if made == 1 else 'ies'}"
        if removed:
            what += f" and {removed[-1]}, which it had created"
        elif made and not kept:
            what += f"; {root} was there before and stays"
        if kept:
            what += f"; kept {kept[0]}: another process uses it now"
        self.set("cleanup", "ok", f"nothing left on disk: {what}")


# -- recommendations -----------------------------------------------------------------------------
def _recommend(d: _Doctor) -> list[Recommendation]:
    """The TBA_* settings this node suggests, each with the reason. Rules, one per setting:

    - TBA_SPILL_DIR: the checked directory when a backend works there and it is not RAM-backed.
    - TBA_BACKEND: exported only when auto falls back to ``buffered`` (O_DIRECT refused here),
      a property of the filesystem; pinning it makes the choice explicit. A fallback caused by a
      missing build or driver (native, kvikio) is fixable, so we print the fix instead of
      pinning a slower backend.
    - TBA_MAX_DISK_BYTES: 90% of the free space above TBA_MIN_FREE_BYTES (10% left for
      checkpoints and logs that grow during the run), divided by the ranks on this node
      (LOCAL_WORLD_SIZE, else one per CUDA device, else 1), because the quota is per process.
    - TBA_IO_THREADS (posix, buffered, kvikio) / TBA_IO_DEPTH (native): the smallest number of
      16 MiB reads in flight that reaches 90% of the best measured rate, but never below the
      default: offloaded tensors are often smaller than 16 MiB and need more requests in flight
      for the same rate, and an idle thread or ring slot costs almost nothing.
    - TBA_PREFETCH_BYTES: about 100 ms of reads at the measured rate, at least two groups
      (2 x TBA_GROUP_BYTES: one being consumed while the next is read), at most 1 GiB, rounded
      up to 32 MiB. It is host memory (pinned on CUDA) held during backward; more helps only if
      backward briefly outruns the disk. `tba plan` will size it from the model instead.
    """
    cfg, facts = d.cfg, d.facts
    out: list[Recommendation] = []
    sd, be, tp = facts["spill_dir"], facts["backend"], facts["throughput"]
    usable = be["name"] is not None and not any(c.status == "FAIL" for c in d.checks.values())

    # TBA_SPILL_DIR
    if not usable:
        out.append(Recommendation("TBA_SPILL_DIR", None, "no recommendation: see the FAIL above"))
    elif sd["fs_type"] in _RAM_FS:
        out.append(
            Recommendation(
                "TBA_SPILL_DIR",
                None,
                f"{cfg.spill_dir} is on {sd['fs_type']}, which frees no memory; pick a directory "
                "on a local NVMe drive and run tba doctor --spill-dir on it",
            )
        )
    else:
        free = format_size(sd["free_bytes"]) if sd["free_bytes"] is not None else "?"
        caveat = (
            f" (but {sd['fs_type']}: see the filesystem row)" if sd["fs_type"] in _SLOW_FS else ""
        )
        out.append(
            Recommendation(
                "TBA_SPILL_DIR",
                cfg.spill_dir,
                f"checked: {sd['fs_type']}, the {be['name']} backend works there, {free} "
                f"free{caveat}",
            )
        )

    # TBA_BACKEND
    if be["requested"] == "auto" and be["auto"] == "buffered":
        out.append(
            Recommendation(
                "TBA_BACKEND",
                "buffered",
                "auto falls back to buffered here because O_DIRECT fails; pinning it makes that "
                "explicit (unset it if you move TBA_SPILL_DIR to a drive with O_DIRECT)",
            )
        )
    elif be["auto"] is not None:
        fixable = []
        if facts["native"]["module"] and not facts["native"]["built"]:
            fixable.append("the native engine is not built (see its row for the fix)")
        elif facts["native"]["built"] and facts["io_uring"]["available"] is False:
            fixable.append("io_uring is unavailable (see its row)")
        kv = facts["kvikio"]
        if facts["cuda"]["available"] and kv["importable"] and kv["gds_available"] is False:
            fixable.append("kvikio has no GDS (needs the nvidia-fs driver and a supported drive)")
        if fixable:
            why = "; ".join(fixable)
            text = f"leave it at auto (picks {be['auto']} now): {why}; fix that rather than pin"
        else:
            text = f"leave it at auto: it picks {be['auto']} here with nothing to fall back from"
        if be["requested"] != "auto":
            text = f"you set {be['requested']}; auto would pick {be['auto']}"
        out.append(Recommendation("TBA_BACKEND", None, text))

    # TBA_MAX_DISK_BYTES
    if usable and sd["free_bytes"] is not None:
        ranks, ranks_from = _ranks_per_node(d)
        room = sd["free_bytes"] - cfg.min_free_bytes
        share = quota_for(sd["free_bytes"], cfg.min_free_bytes, ranks)
        now = f"; now {format_size(cfg.max_disk_bytes)}" if cfg.max_disk_bytes else ""
        if share >= 64 * MIB:
            out.append(
                Recommendation(
                    "TBA_MAX_DISK_BYTES",
                    _env_size(share, down=True),
                    f"per-process quota: {QUOTA_SHARE:.0%} of the {format_size(room)} free above "
                    f"TBA_MIN_FREE_BYTES, split over {_plural(ranks, 'rank')} on this node "
                    f"({ranks_from}){now}",
                )
            )
        else:
            out.append(
                Recommendation(
                    "TBA_MAX_DISK_BYTES",
                    None,
                    f"only {format_size(max(room, 0))} free above TBA_MIN_FREE_BYTES: too little "
                    "to offload to; free space first",
                )
            )

    # TBA_IO_THREADS / TBA_IO_DEPTH
    name = be["name"]
    native = name == "native"
    env, default = ("TBA_IO_DEPTH", 32) if native else ("TBA_IO_THREADS", 4)
    current = cfg.io_depth if native else cfg.io_threads
    sweep = {int(k): v for k, v in tp["read_sweep_gib_s"].items()}
    if name in ("memory", None):
        pass
    elif name == "buffered":
        out.append(
            Recommendation(env, None, "not measured: buffered reads partly hit the page cache")
        )
    elif len(sweep) < 2:
        out.append(
            Recommendation(
                env,
                None,
                f"not measured: the probe has {_plural(tp['extents'] or 0, 'extent')}; use "
                "--probe-bytes 128MiB or more to compare requests in flight",
            )
        )
    else:
        value, enough = in_flight_for(sweep, default)
        widest = max(sweep)
        more = (
            f"; still rising at {widest}, so more may help (benchmarks/bench_engine.py --threads)"
            if enough == widest
            else ""
        )
        now = (
            f"; now {current}"
            if cfg.sources["io_depth" if native else "io_threads"] != "default"
            else ""
        )
        out.append(
            Recommendation(
                env,
                str(value),
                f"with {enough} in flight, 16 MiB reads reach {SATURATION:.0%} of the best read "
                f"rate; kept at >= the default {default}, as smaller tensors need more in flight"
                f"{more}{now}",
            )
        )
    if name not in ("memory", None):
        other = "TBA_IO_THREADS" if native else "TBA_IO_DEPTH"
        used_by = "posix, buffered and kvikio backends" if native else "native engine"
        out.append(Recommendation(other, None, f"not used by {name} (only by the {used_by})"))

    # TBA_PREFETCH_BYTES
    rate = tp["read_gib_s"]
    if rate and name != "memory":
        value_b = prefetch_for(rate, cfg.group_bytes)
        bound = ""
        if value_b == 2 * cfg.group_bytes:
            bound = " (raised to the floor, 2 x TBA_GROUP_BYTES)"
        elif value_b == PREFETCH_CAP:
            bound = f" (capped at {format_size(PREFETCH_CAP)})"
        out.append(
            Recommendation(
                "TBA_PREFETCH_BYTES",
                _env_size(value_b),
                f"~{PREFETCH_SECONDS * 1000:.0f} ms of reads at the measured {rate:.2f} GiB/s"
                f"{bound}; host memory held during backward",
            )
        )
    return out


# The numbers behind the rules in _recommend's docstring.
QUOTA_SHARE = 0.9  # of the free space above TBA_MIN_FREE_BYTES
SATURATION = 0.9  # "enough" requests in flight reach this share of the best read rate
PREFETCH_SECONDS = 0.1  # read-ahead covers this much time at the measured read rate
PREFETCH_CAP = GIB
PREFETCH_STEP = 32 * MIB


_MALLOCS = (("tcmalloc", "libtcmalloc"), ("jemalloc", "libjemalloc"), ("mimalloc", "libmimalloc"))
_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)


def malloc_in_use(maps: str) -> tuple[str, str | None]:
    """("tcmalloc" | "jemalloc" | "mimalloc", its path) when one is mapped into the process
    whose /proc/<pid>/maps text is ``maps``, else ("glibc", None)."""
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue  # an anonymous mapping
        path = parts[5].strip()
        base = os.path.basename(path)
        for name, prefix in _MALLOCS:
            if base.startswith(prefix + ".so") or base.startswith(prefix + "_minimal.so"):
                return name, path
    return "glibc", None


def find_tcmalloc(dirs: tuple[str, ...] = _LIB_DIRS) -> str | None:
    """The path of an installed libtcmalloc_minimal.so.4 (or libtcmalloc.so.4), if any."""
    for d in dirs:
        for lib in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            path = os.path.join(d, lib)
            if os.path.exists(path):
                return path
    return None


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def quota_for(free: int, min_free: int, ranks: int) -> int:
    """Per-process TBA_MAX_DISK_BYTES: QUOTA_SHARE of the room above the floor, per rank."""
    return max(0, int((free - min_free) * QUOTA_SHARE)) // max(1, ranks)


def in_flight_for(sweep: dict[int, float], default: int) -> tuple[int, int]:
    """(recommended, enough): enough = fewest requests in flight within SATURATION of the best
    measured rate; recommended = at least ``default``."""
    best = max(sweep.values())
    enough = min(w for w, r in sweep.items() if r >= SATURATION * best)
    return max(default, enough), enough


def prefetch_for(read_gib_s: float, group_bytes: int) -> int:
    """TBA_PREFETCH_BYTES: PREFETCH_SECONDS of reads, within [2 groups, PREFETCH_CAP]."""
    raw = align_up(int(read_gib_s * GIB * PREFETCH_SECONDS), PREFETCH_STEP)
    return min(PREFETCH_CAP, max(2 * group_bytes, raw))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _ranks_per_node(d: _Doctor) -> tuple[int, str]:
    v = d.environ.get("LOCAL_WORLD_SIZE", "")
    if v.strip().isdigit() and int(v) > 0:
        return int(v), "LOCAL_WORLD_SIZE"
    n = d.facts["cuda"]["device_count"]
    if n > 0:
        return n, "one per CUDA device"
    return 1, "no LOCAL_WORLD_SIZE, no GPU"


def _env_size(n: int, down: bool = False) -> str:
    """A size as a TBA_* value: whole GiB when exact (or when rounding down), else whole MiB."""
    if n >= GIB and (n % GIB == 0 or down):
        return f"{n // GIB}GiB"
    return f"{n // MIB}MiB"


# -- helpers -----------------------------------------------------------------------------------
class _ProbeFailed(Exception):
    pass


def _strip(e: BaseException) -> str:
    return _strip_prefix(str(e))


def _why(e: BaseException) -> str:
    """A failure as text: our own errors speak for themselves; others are named."""
    if isinstance(e, (ConfigError, OSError, _ProbeFailed)):
        return _strip(e)
    return f"{type(e).__name__}: {e}"


def _strip_prefix(text: str) -> str:
    for p in ("tba.config: ", "tba.storage: "):
        text = text.removeprefix(p)
    return text.replace("TBA_SPILL_DIR: ", "")


def _rate_status(rate: float) -> str:
    return "warn" if rate < _SLOW_GIB_S else "ok"


def _slow_note(rate: float) -> str:
    if rate >= _SLOW_GIB_S:
        return ""
    return f"; slow for offload: each GiB takes {1 / max(rate, 1e-9):.1f} s"


def _our_dirs(root: str) -> list[str]:
    """Per-process directories of this process (host and pid) in ``root``."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    pattern, host, pid = dir_name_pattern(), host_tag(), str(os.getpid())
    out = []
    for name in names:
        m = pattern.match(name)
        if m and m.group("host") == host and m.group("pid") == pid:
            out.append(os.path.join(root, name))
    return out


def _missing_components(root: str) -> list[str]:
    """The components of ``root`` that do not exist yet, shallowest first."""
    missing: list[str] = []
    path = os.path.abspath(root)
    while True:
        try:
            os.lstat(path)
            break
        except FileNotFoundError:
            missing.append(path)
        except OSError:
            break
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return list(reversed(missing))


def _aligned_roundtrip(fd: int, align: int) -> None:
    out = as_memoryview(aligned_empty(align, align))
    out[:] = os.urandom(align)
    back = as_memoryview(aligned_empty(align, align))
    n = os.pwrite(fd, out, 0)
    if n != align:
        raise OSError(errno.EIO, f"short O_DIRECT write: {n} of {align} bytes")
    n = os.preadv(fd, [back], 0)
    if n != align:
        raise OSError(errno.EIO, f"short O_DIRECT read: {n} of {align} bytes")
    if back != out:
        raise OSError(errno.EIO, "O_DIRECT read returned other bytes than were written")


def _optional_status(module: str, func: str) -> tuple[dict[str, Any] | None, str | None]:
    """``module.func()``, or (None, why) when the module is missing or the call fails."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:  # also when sys.modules[module] is None
            return None, f"not in this install ({module} is missing)"
        return None, f"{module} cannot be imported: {e}"
    except ImportError as e:
        return None, f"{module} cannot be imported: {e}"
    except Exception as e:  # a broken optional module must not stop the doctor
        return None, f"{module} failed to import: {type(e).__name__}: {e}"
    fn = getattr(mod, func, None)
    if fn is None:
        return None, f"{module} has no {func}()"
    try:
        status = fn()
    except Exception as e:
        return None, f"{module}.{func}() failed: {type(e).__name__}: {e}"
    if not isinstance(status, dict):
        return None, f"{module}.{func}() returned {type(status).__name__}, not a dict"
    return status, None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _io_uring_hint(reason: str, sysctl: int | None) -> str:
    low = reason.lower()
    if "eperm" in low or "not permitted" in low or "permission" in low or "eacces" in low:
        if sysctl:
            meaning = "off for everyone" if sysctl == 2 else "only for kernel.io_uring_group"
            return (
                f" kernel.io_uring_disabled={sysctl} ({meaning}): sysctl -w "
                "kernel.io_uring_disabled=0 allows it."
            )
        return (
            " Likely a seccomp profile: Docker 25+ blocks io_uring by default; run the container "
            "with a profile that allows io_uring_setup, io_uring_enter and io_uring_register."
        )
    if "enosys" in low or "not implemented" in low:
        return " The kernel has no io_uring (older than 5.1, or built without it)."
    return ""


# io_uring_setup is 425 on x86_64 and in the generic table (arm64, riscv64, ...).
_IO_URING_SETUP = {"x86_64": 425, "aarch64": 425, "arm64": 425, "riscv64": 425, "ppc64le": 425}


def _probe_io_uring() -> tuple[bool | None, str]:
    """Create and close a 1-entry io_uring: (True, ...) works, (False, why) refused."""
    nr = _IO_URING_SETUP.get(platform.machine())
    if nr is None:
        return None, f"no io_uring probe for {platform.machine()}"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError as e:  # pragma: no cover
        return None, f"libc: {e}"
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    libc.syscall.restype = ctypes.c_long
    fd = libc.syscall(ctypes.c_long(nr), ctypes.c_long(1), params)
    if fd >= 0:
        os.close(fd)
        return True, "io_uring_setup works"
    code = ctypes.get_errno()
    name = errno.errorcode.get(code, str(code))
    return False, f"io_uring_setup failed: {name} ({os.strerror(code)})"


def _has_cap_ipc_lock() -> bool:
    """CAP_IPC_LOCK in the effective set, in the initial user namespace (what io_uring checks)."""
    try:
        with open("/proc/self/status") as f:
            caps = next((ln for ln in f if ln.startswith("CapEff:")), "")
        with open("/proc/self/uid_map") as f:
            uid_map = f.read().split()
    except OSError:
        return False
    if uid_map[:3] != ["0", "0", "4294967295"]:
        return False  # in a user namespace: its capabilities do not count for the initial one
    try:
        return bool(int(caps.split()[1], 16) >> 14 & 1)
    except (IndexError, ValueError):
        return False


def _pass(backend, extents, bufs, window: int, write: bool, tag: int) -> float:
    """Seconds to write (or read and verify) every extent, ``window`` requests in flight."""
    inflight: collections.deque[tuple[Future, int]] = collections.deque()

    def finish() -> None:
        fut, i = inflight.popleft()
        fut.result()
        if not write and not _tag_ok(bufs[i % window], tag, i):
            raise _ProbeFailed(
                f"extent {i} read back other bytes than were written to it (stale or misplaced "
                "blocks): do not trust this filesystem with spill files"
            )

    t0 = time.perf_counter()
    try:
        for i, ext in enumerate(extents):
            if len(inflight) == window:
                finish()
            buf = bufs[i % window][: ext.length]
            if write:
                _tag(buf, tag, i)
                inflight.append((backend.write(ext, buf), i))
            else:
                inflight.append((backend.read(ext, buf), i))
        while inflight:
            finish()
    finally:
        # Never free extents or buffers under I/O still in flight.
        for fut, _ in inflight:
            try:
                fut.result()
            except BaseException:
                pass
    return time.perf_counter() - t0


def _tags(buf: memoryview) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint64).reshape(-1, 512)  # one row per 4 KiB block


def _expected(tag: int, index: int, blocks: int) -> tuple[int, np.ndarray]:
    return tag, (np.uint64(index) << np.uint64(32)) | np.arange(blocks, dtype=np.uint64)


def _tag(buf: memoryview, tag: int, index: int) -> None:
    rows = _tags(buf)
    first, second = _expected(tag, index, len(rows))
    rows[:, 0] = first
    rows[:, 1] = second


def _tag_ok(buf: memoryview, tag: int, index: int) -> bool:
    rows = _tags(buf)
    first, second = _expected(tag, index, len(rows))
    return bool((rows[:, 0] == np.uint64(first)).all() and np.array_equal(rows[:, 1], second))


# -- entry points --------------------------------------------------------------------------------
def run(
    spill_dir: str | None = None,
    probe_bytes: int = DEFAULT_PROBE_BYTES,
    backend: str | None = None,
    environ: dict[str, str] | None = None,
) -> Report:
    """Run every check. Raises :class:`ConfigError` for bad settings (arguments or TBA_*)."""
    t0 = time.perf_counter()
    env = dict(os.environ if environ is None else environ)
    if probe_bytes < MIN_PROBE_BYTES:
        raise ConfigError(f"--probe-bytes must be at least {format_size(MIN_PROBE_BYTES)}")
    kw: dict[str, Any] = {}
    if spill_dir is not None:
        kw["spill_dir"] = spill_dir
    if backend is not None:
        kw["backend"] = backend
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = Config(environ=env, **kw)
    d = _Doctor(cfg, probe_bytes, env)
    storage_log = logging.getLogger("tba.storage")
    level = storage_log.level
    storage_log.setLevel(logging.ERROR)  # the rows say it all; no duplicate log lines
    try:
        d.run()
    finally:
        storage_log.setLevel(level)
    for w in caught:
        c = d.checks["config"]
        d.set("config", "warn", f"{c.detail}; {str(w.message).removeprefix('tba.config: ')}")
    rep = Report(d.checks, d.facts, [], 0.0)
    rep.recommendations = _recommend(d)
    rep.elapsed = time.perf_counter() - t0
    return rep


def render_table(rep: Report, width: int = TABLE_WIDTH) -> str:
    """The report as a table (check, status, detail), the export lines and a verdict."""
    label_w = max(len(c.label) for c in rep.checks.values())
    status_w = max(len("status"), *(len(s) for s in STATUSES))
    indent = label_w + status_w + 4
    lines = [
        f"tba doctor {__version__}: spill dir {rep.facts['spill_dir']['root']}, probe "
        f"{format_size(rep.facts['probe_bytes'])}, {rep.elapsed:.1f} s",
        "",
        f"{'check':<{label_w}}  {'status':<{status_w}}  detail",
    ]
    for c in rep.checks.values():
        wrapped = textwrap.wrap(
            c.detail, max(40, width - indent), break_long_words=False, break_on_hyphens=False
        ) or [""]
        lines.append(f"{c.label:<{label_w}}  {c.status:<{status_w}}  {wrapped[0]}")
        lines.extend(" " * indent + more for more in wrapped[1:])
    lines += ["", "recommended settings (rules: tba/doctor.py, _recommend):"]
    exports = [r for r in rep.recommendations if r.value is not None]
    pad = max((len(r.line) for r in exports), default=0)
    for r in rep.recommendations:
        lines.append(f"{r.line:<{pad}}  # {r.reason}" if r.value is not None else r.line)
    lines.append("")
    warn = sum(c.status == "warn" for c in rep.checks.values())
    if rep.exit_code:
        lines.append(f"result: UNUSABLE: {rep.problem}")
    else:
        lines.append(f"result: usable ({warn} warning{'' if warn == 1 else 's'})")
    return "\n".join(lines)


def render_json(rep: Report) -> str:
    return json.dumps(rep.as_json(), indent=2)
