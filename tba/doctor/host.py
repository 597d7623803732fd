"""Checks of the host: the settings, the native engine and io_uring, memlock, the malloc in use,
kvikio and CUDA. Each fills its row and facts in a :class:`Run`."""

from __future__ import annotations

import collections
import resource

from ..config import format_size
from ..host.malloc import malloc_library
from .probes import _optional_status
from .state import _NO_VALUE, Run

# The fix printed when the native engine is not built and its build_error names no fix.
_NATIVE_FIX = (
    "reinstall tba where a C compiler is available (e.g. apt-get install gcc, then pip install "
    "-e . -v), or use TBA_BACKEND=posix"
)


# -- config ----------------------------------------------------------------------------
def check_config(d: Run) -> None:
    cfg = d.cfg
    set_vars = sorted(k for k in d.variables if k.startswith("TBA_"))
    shown = ", ".join(f"{k}={d.variables[k]}" for k in set_vars)
    detail = f"from the environment: {shown}" if shown else "no TBA_* variables set: defaults"
    if not cfg.enabled:
        d.set("config", "warn", f"TBA_ENABLED=0: tba is switched off here; {detail}")
    else:
        d.set("config", "ok", detail)


# -- native engine, io_uring, memlock -----------------------------------------------------
def check_native_and_io_uring(d: Run) -> None:
    nat = d.facts["native"]
    uring = d.facts["io_uring"]
    sysctl = d.probes.read_int("/proc/sys/kernel/io_uring_disabled")
    uring["sysctl"] = sysctl
    status, err = _optional_status("tba.storage.native", "engine_status")
    if status is None:
        nat["error"] = err
        missing = err is not None and err.startswith("not in this install")
        d.set(
            "native_engine",
            "ok" if missing else "warn",
            f"{err}; auto uses the posix backend (thread pool)",
        )
    else:
        nat["module"] = True
        for k in ("built", "library", "build_error"):
            nat[k] = status.get(k)
        if status.get("built"):
            d.set("native_engine", "ok", f"built: {status.get('library') or '?'}")
        else:
            why = (status.get("build_error") or "no reason given").rstrip(". ")
            # The engine's own message usually ends with the fix; add ours when it does not.
            fix = "" if "install" in why.lower() else f". Fix: {_NATIVE_FIX}"
            d.set(
                "native_engine",
                "warn",
                f"not built: {why}{fix}. Until then auto uses the posix backend.",
            )
        d.memlock_from_engine = status.get("memlock_bytes", _NO_VALUE)
    if status is not None and status.get("built"):
        uring.update(
            available=bool(status.get("io_uring")),
            reason=status.get("io_uring_reason") or "",
            source="native engine",
        )
    else:
        # Without a built engine, ask the kernel directly (io_uring_setup, a 1-entry ring):
        # whether io_uring works here does not depend on the build.
        ok, why = d.probes.probe_io_uring()
        uring.update(available=ok, reason=why, source="doctor probe")
    ok, why = uring["available"], uring["reason"] or ""
    if ok:
        d.set("io_uring", "ok", f"available ({why})" if why else "available")
    elif ok is None:
        d.set("io_uring", "ok", f"not checked: {why}")
    else:
        hint = _io_uring_hint(why, sysctl)
        d.set(
            "io_uring",
            "warn",
            f"unavailable: {why}.{hint} The native engine then runs a thread pool of "
            "TBA_IO_DEPTH threads instead.",
        )


def check_memlock(d: Run) -> None:
    facts = d.facts["memlock"]
    limit = d.memlock_from_engine
    if limit is _NO_VALUE:
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = None if soft == resource.RLIM_INFINITY else soft
    cap = d.probes.has_cap_ipc_lock()
    need = d.cfg.staging_bytes
    facts.update(limit_bytes=limit, unlimited=limit is None, cap_ipc_lock=cap)
    what = (
        "io_uring registered (fixed) buffers are pinned and charged to RLIMIT_MEMLOCK; the "
        f"native engine registers the staging pool (TBA_STAGING_BYTES={format_size(need)}) "
        "when it is pinned CUDA memory, or with TBA_CHECKSUM on"
    )
    fallback = (
        "I/O still works through unregistered buffers, whose pages the kernel pins on every request"
    )
    if limit is None:
        d.set("memlock", "ok", f"unlimited: {what}, and any size fits")
        return
    shown = f"{format_size(limit)} (ulimit -l {limit // 1024})"
    if cap:
        d.set(
            "memlock",
            "ok",
            f"{shown}, but this process has CAP_IPC_LOCK, so io_uring does not charge "
            "registered buffers to it",
        )
    elif limit >= need:
        d.set("memlock", "ok", f"{shown}: {what}, which fits")
    else:
        relevant = bool(d.facts["native"]["built"]) and bool(d.facts["io_uring"]["available"])
        fix = (
            "raise it: ulimit -l unlimited, systemd LimitMEMLOCK=infinity, or docker run "
            "--ulimit memlock=-1"
        )
        if relevant:
            d.set(
                "memlock",
                "warn",
                f"{shown}: {what}, which does not fit: registration fails and {fallback}; {fix}",
            )
        else:
            d.set(
                "memlock",
                "ok",
                f"{shown}: too small for the native engine to register its "
                f"{format_size(need)} staging pool, but that engine is not in use here; "
                f"before enabling it, {fix}",
            )


def check_host_malloc(d: Run) -> None:
    """Which malloc serves this process's CPU tensors, and whether it gives back what tba
    frees early (BENCHMARKS.md, "Batch headroom")."""
    facts = d.facts["host_malloc"]
    name, lib = malloc_library()  # the one tba reads back into (NOTE [Read buffers from the heap])
    facts.update(malloc=name, library=lib)
    if name != "glibc":
        d.set(
            "host_malloc",
            "ok",
            f"{name} ({lib}): reuses the memory autograd frees once tba has written a "
            "tensor, and tba reads back into it",
        )
        return
    if d.facts["cuda"]["available"]:
        d.set(
            "host_malloc",
            "ok",
            "glibc malloc; activations live in the CUDA caching allocator, which reuses "
            "what tba frees at once",
        )
        return
    found = d.probes.find_tcmalloc()
    facts["suggested"] = found
    fix = (
        f"run training with LD_PRELOAD={found}"
        if found
        else "install tcmalloc (Debian/Ubuntu: apt install libtcmalloc-minimal4) and run "
        "training with LD_PRELOAD set to its libtcmalloc_minimal.so.4"
    )
    d.set(
        "host_malloc",
        "warn",
        "glibc malloc with CPU tensors: the memory autograd frees once tba has written a "
        "tensor mostly stays in glibc's heap, so a larger batch gains little (W1 under a "
        "1280 MiB cap: 1.25-1.4x the batch with glibc, 3.6x with tcmalloc, whose steps were "
        f"not slower; BENCHMARKS.md); {fix}",
    )


# -- kvikio, CUDA ------------------------------------------------------------------------
def check_kvikio_and_cuda(d: Run) -> None:
    cuda = d.facts["cuda"]
    import torch  # already imported by tba

    cuda["torch"] = torch.__version__
    cuda["built"] = bool(torch.backends.cuda.is_built())
    if not cuda["built"]:
        d.set(
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
        d.set(
            "cuda",
            "ok",
            f"{n} device(s): {listing}; torch {torch.__version__}, CUDA {torch.version.cuda}",
        )
    else:
        visible = d.variables.get("CUDA_VISIBLE_DEVICES")
        hidden = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        d.set(
            "cuda",
            "warn",
            f"torch {torch.__version__} is built with CUDA {torch.version.cuda} but sees no "
            f"device{hidden}: no driver, or the devices are hidden",
        )

    kv = d.facts["kvikio"]
    status, err = _optional_status("tba.storage.kvikio", "kvikio_status")
    gpu = cuda["available"]
    if status is None:
        kv["error"] = err
        d.set("kvikio", "ok", f"{err}; only useful with CUDA and GPUDirect Storage")
        return
    kv["module"] = True
    for k in ("importable", "version", "gds_available", "compat_mode", "reason"):
        kv[k] = status.get(k)
    why = status.get("reason") or ""
    if not status.get("importable"):
        why = why or "kvikio is not importable"
        extra = "" if gpu else "; only useful with a CUDA device and GPUDirect Storage"
        d.set("kvikio", "ok", f"{why}{extra}")
        return
    name = f"kvikio {status.get('version') or '?'}"
    mode = status.get("compat_mode")
    mode_s = f", compat mode {mode}" if mode is not None else ""
    gds = status.get("gds_available")
    if gds:
        if gpu:
            d.set("kvikio", "ok", f"{name}: GDS available{mode_s}; auto prefers kvikio")
        else:
            d.set("kvikio", "warn", f"{name}: GDS reported, but no CUDA device is visible")
    elif gds is None:
        d.set("kvikio", "warn", f"{name}: GDS status unknown{mode_s}: {why}")
    else:
        d.set(
            "kvikio",
            "warn",
            f"{name} without GDS{mode_s}: it would move data through host bounce buffers "
            f"(compat mode), so auto does not pick it. {why}".rstrip(),
        )


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
