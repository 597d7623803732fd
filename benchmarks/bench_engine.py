"""Throughput of the posix storage backend against a plain O_DIRECT loop (and fio, if present).

    python benchmarks/bench_engine.py [--spill-dir /var/tmp] [--total 1GiB] [--repeats 5]

For each extent size (64 KiB, 1 MiB, 16 MiB) and each repeat, it runs, interleaved:
- ``reference``: one thread, sequential ``os.pwrite`` / ``os.preadv`` of extent-sized chunks
  from an aligned buffer over an O_DIRECT file of ``--total`` bytes;
- ``posix``: the tba posix backend, every extent of the round submitted at once (as the cache
  keeps several writes in flight), then all futures awaited;
- ``fio`` (when on PATH): the same size and pattern with libaio at queue depth ``--threads``.
Disk speed drifts over minutes, so the modes alternate within each repeat and the report gives
medians and the backend/reference ratio. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


from _machine import machine_line  # noqa: E402

from tba._memory import aligned_empty, as_memoryview  # noqa: E402
from tba.config import Config, format_size, parse_size  # noqa: E402
from tba.storage import open_backend  # noqa: E402
from tba.storage.slab import open_unnamed  # noqa: E402

GIB = 1 << 30
POOL_BYTES = 256 << 20  # distinct source/destination memory, cycled through by both modes


def run_reference(fd: int, pool: memoryview, size: int, count: int, write: bool) -> float:
    """Seconds for a single-threaded sequential pass of ``count`` transfers of ``size``."""
    slots = len(pool) // size
    t0 = time.perf_counter()
    for i in range(count):
        j = (i % slots) * size
        view = pool[j : j + size]
        off = i * size
        done = 0
        while done < size:
            if write:
                k = os.pwrite(fd, view[done:], off + done)
            else:
                k = os.preadv(fd, [view[done:]], off + done)
            if k <= 0:
                raise OSError(f"reference {'write' if write else 'read'} returned {k}")
            done += k
    return time.perf_counter() - t0


def run_backend(backend, extents, pool: memoryview, size: int, write: bool) -> float:
    slots = len(pool) // size
    t0 = time.perf_counter()
    futs = []
    for i, ext in enumerate(extents):
        j = (i % slots) * size
        view = pool[j : j + size]
        futs.append(backend.write(ext, view) if write else backend.read(ext, view))
    for f in futs:
        f.result()
    return time.perf_counter() - t0


def run_fio(directory: str, size: int, total: int, write: bool, depth: int) -> float | None:
    # The file stays between passes (overwrites, like the other modes); rmtree removes it.
    path = os.path.join(directory, "tba-bench-fio.tmp")
    cmd = [
        "fio",
        "--name=tba",
        f"--filename={path}",
        f"--rw={'write' if write else 'read'}",
        f"--bs={size}",
        f"--size={total}",
        "--direct=1",
        "--ioengine=libaio",
        f"--iodepth={depth}",
        "--numjobs=1",
        "--output-format=json",
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        job = json.loads(out)["jobs"][0]["write" if write else "read"]
        return job["bw_bytes"] / GIB
    except (OSError, subprocess.CalledProcessError, KeyError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spill-dir", default="/var/tmp")
    ap.add_argument("--total", default="1GiB", help="bytes per pass and per mode")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default="64KiB,1MiB,16MiB")
    ap.add_argument("--threads", type=int, default=4, help="io_threads of the backend")
    args = ap.parse_args(argv)
    total = parse_size(args.total)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.repeats < 1 or any(total < s for s in sizes):
        ap.error("need --repeats >= 1 and --total at least the largest size")

    root = tempfile.mkdtemp(prefix="tba-bench-", dir=args.spill_dir)
    cfg = Config(
        spill_dir=root,
        backend="posix",
        io_threads=args.threads,
        slab_bytes=total,
        min_free_bytes=0,
        environ={},
    )
    backend = open_backend(cfg)
    have_fio = shutil.which("fio") is not None
    print(machine_line(args.spill_dir))
    print(f"backend: {backend.reason}; io_threads={args.threads}")
    print(f"total {format_size(total)} per pass, {args.repeats} repeats, fio: {have_fio}")
    pool_t = aligned_empty(min(POOL_BYTES, total), backend.alignment)
    pool_t.random_(0, 256)
    pool = as_memoryview(pool_t)
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    ref_fd = open_unnamed(dir_fd, root, True, "ref")
    os.close(dir_fd)
    os.posix_fallocate(ref_fd, 0, total)

    modes = ["reference", "posix"] + (["fio"] if have_fio else [])
    results: dict[tuple[int, str, str], list[float]] = {}
    t_start = time.perf_counter()
    try:
        for size in sizes:
            count = total // size
            extents = [backend.allocate(size) for _ in range(count)]
            if any(e is None for e in extents):
                raise SystemExit(f"could not allocate {count} extents of {size}: {backend.usage()}")
            # Untimed warm-up: first writes to fallocated space convert unwritten extents.
            run_reference(ref_fd, pool, size, count, True)
            run_backend(backend, extents, pool, size, True)
            if have_fio:
                run_fio(root, size, total, True, args.threads)
            for rep in range(args.repeats):
                order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
                for write in (True, False):
                    for mode in order:
                        if mode == "reference":
                            dt = run_reference(ref_fd, pool, size, count, write)
                            gibs = count * size / dt / GIB
                        elif mode == "posix":
                            dt = run_backend(backend, extents, pool, size, write)
                            gibs = count * size / dt / GIB
                        else:
                            gibs = run_fio(root, size, total, write, args.threads) or float("nan")
                        op = "write" if write else "read"
                        results.setdefault((size, op, mode), []).append(gibs)
            for e in extents:
                backend.free(e)
    finally:
        os.close(ref_fd)
        backend.close()
        shutil.rmtree(root, ignore_errors=True)

    header = f"{'extent':>8} {'op':>5} {'reference':>10} {'posix':>8} {'ratio':>6} {'paired':>6}"
    header += f" {'fio':>8}" if have_fio else ""
    header += "   posix min-max"
    print()
    print(
        f"median GiB/s over {args.repeats} repeats; ratio = posix/reference medians, "
        "paired = median of the per-repeat ratios (robust to drift)"
    )
    print(header)
    for size in sizes:
        for op in ("write", "read"):
            ref = statistics.median(results[(size, op, "reference")])
            pos_all = results[(size, op, "posix")]
            pos = statistics.median(pos_all)
            refs = results[(size, op, "reference")]
            paired = statistics.median(p / r for p, r in zip(pos_all, refs))
            row = f"{format_size(size):>8} {op:>5} {ref:>10.2f} {pos:>8.2f} {pos / ref:>6.2f}"
            row += f" {paired:>6.2f}"
            if have_fio:
                row += f" {statistics.median(results[(size, op, 'fio')]):>8.2f}"
            row += f"   {min(pos_all):.2f}-{max(pos_all):.2f}"
            print(row)
    print(f"\nelapsed {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
