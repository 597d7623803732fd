"""Throughput and CPU cost of the storage engines against fio (or a plain O_DIRECT loop).

    python benchmarks/bench_engine.py [--spill-dir /var/tmp] [--total 1GiB] [--repeats 5]

Modes, for each extent size (16 MiB and 64 KiB by default) and each repeat, interleaved:
- ``reference``: one thread, sequential ``os.pwrite`` / ``os.preadv`` over an O_DIRECT file;
- ``fio`` (when on PATH): the same sizes with libaio at queue depth ``--depth``;
- ``posix``, ``native`` (when built): the tba backends, every extent of the pass submitted at
  once (as the offloader keeps many writes in flight), then all futures awaited; the source
  and destination pool is registered with native (as the offloader registers its staging);
- ``posix+<checksum>``, ``native+<checksum>`` (with ``--checksum``): the same passes with the
  checksum computed on every write and verified on every read;
- ``posix+coalesce``, ``native+coalesce`` (64 KiB only): 64 KiB *tensors* as the offloader
  handles them with coalescing on: each is copied into a slot of a 4 MiB batch (the staging
  copy, the only one) and each full batch is written with one request; reads fetch whole
  batches and split them into per-tensor views. The copy is inside the timing.

Disk speed drifts about 2x over minutes, so every repeat runs each mode once, in a rotating
order; the report gives medians, each mode's ratio to the baseline (fio when present, else the
reference loop) at 16 MiB, and CPU-seconds per GiB (user + system time of this process, or of
fio's process including its start-up, over the bytes moved). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import dump_json, machine_line  # noqa: E402

from tba.config import Config, format_size, parse_size  # noqa: E402
from tba.datapath.capture.coalesce import Batch, batch_bytes  # noqa: E402
from tba.datapath.capture.staging import StagingPool  # noqa: E402
from tba.errors import ConfigError  # noqa: E402
from tba.host.memory import aligned_empty, as_memoryview  # noqa: E402
from tba.storage import open_backend  # noqa: E402
from tba.storage.slab import open_unnamed  # noqa: E402

GIB = 1 << 30
POOL_BYTES = 256 << 20  # distinct source/destination memory, cycled through by every mode
TENSOR = 64 << 10  # the small-tensor size of the coalesce modes
INFLIGHT_BATCHES = 16  # batches in flight in the coalesce modes (64 MiB of staging)


def register(backend, buf) -> None:
    """Register a long-lived buffer with backends that can (native: fixed buffers)."""
    if hasattr(backend, "register"):
        backend.register(buf)


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def run_reference(fd: int, pool: memoryview, size: int, count: int, write: bool) -> None:
    slots = len(pool) // size
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


def run_backend(
    backend, extents, pool: memoryview, size: int, write: bool, checksum="off", digests=None
) -> None:
    """One pass over ``extents``; with a ``checksum``, writes record each extent's digest in
    ``digests`` and reads verify it, as the offloader does."""
    slots = len(pool) // size
    futs = []
    for i, ext in enumerate(extents):
        j = (i % slots) * size
        view = pool[j : j + size]
        if write:
            futs.append(backend.write(ext, view, checksum))
        else:
            futs.append(backend.read(ext, view, checksum, digests[i] if digests else None))
    got = [f.result() for f in futs]
    if write and digests is not None:
        digests[:] = got


class Coalesced:
    """64 KiB tensors through real batches (tba.datapath.capture.coalesce), on one backend."""

    def __init__(self, backend, total: int, source):
        self.backend = backend
        self.bb = batch_bytes(1 << 20, 256 << 20, backend.alignment)
        self.arena = aligned_empty(self.bb * INFLIGHT_BATCHES, backend.alignment)
        self.pool = StagingPool(self.arena, backend.alignment)
        register(backend, self.arena)  # as the offloader registers its staging arena
        self.per_batch = self.bb // TENSOR
        self.batches = total // self.bb
        self.extents = [backend.allocate(self.bb) for _ in range(self.batches)]
        if any(e is None for e in self.extents):
            raise SystemExit(f"could not allocate batch extents: {backend.usage()}")
        self.tensors = source.view(-1, TENSOR)  # the saved tensors: 64 KiB rows of the pool
        self.reads = [aligned_empty(self.bb, backend.alignment) for _ in range(INFLIGHT_BATCHES)]

    def write(self) -> None:
        inflight: list = []
        n = 0
        for k in range(self.batches):
            if len(inflight) == INFLIGHT_BATCHES:
                fut, block = inflight.pop(0)
                fut.result()
                self.pool.free(block)
            block = self.pool.alloc(self.bb)
            batch = Batch(block, self.arena.device, 0, 0)
            for _ in range(self.per_batch):
                slot = batch.carve(TENSOR)
                slot.tensor.copy_(self.tensors[n % len(self.tensors)])
                n += 1
            view = block.view[: batch.write_length(self.backend.alignment)]
            inflight.append((self.backend.write(self.extents[k], view), block))
        for fut, block in inflight:
            fut.result()
            self.pool.free(block)

    def read(self) -> None:
        inflight: list = []
        for k in range(self.batches):
            if len(inflight) == INFLIGHT_BATCHES:
                self._split(*inflight.pop(0))
            buf = self.reads[k % INFLIGHT_BATCHES]
            inflight.append((self.backend.read(self.extents[k], as_memoryview(buf)), buf))
        for item in inflight:
            self._split(*item)

    def _split(self, fut, buf) -> None:
        fut.result()
        views = [buf[i * TENSOR : (i + 1) * TENSOR] for i in range(self.per_batch)]
        assert len(views) == self.per_batch

    def close(self) -> None:
        for e in self.extents:
            self.backend.free(e)


def run_fio(directory: str, size: int, total: int, write: bool, depth: int):
    """(GiB/s, fio's CPU-seconds) for one fio pass, or None when fio fails."""
    path = os.path.join(directory, "tba-bench-fio.tmp")  # kept between passes; rmtree removes it
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
    c0 = cpu_seconds(resource.RUSAGE_CHILDREN)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        job = json.loads(out)["jobs"][0]["write" if write else "read"]
    except (OSError, subprocess.CalledProcessError, KeyError, ValueError):
        return None
    return job["bw_bytes"] / GIB, cpu_seconds(resource.RUSAGE_CHILDREN) - c0


def timed(fn: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``fn()``."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_seconds() - c0


def open_named(name: str, root: str, total: int, args) -> object | None:
    cfg = Config(
        spill_dir=root,
        backend=name,
        io_threads=args.threads,
        io_depth=args.depth,
        slab_bytes=total,
        min_free_bytes=0,
        environ={},
    )
    try:
        return open_backend(cfg)
    except ConfigError as e:
        print(f"{name}: not measured: {e}")
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spill-dir", default="/var/tmp")
    ap.add_argument("--total", default="1GiB", help="bytes per pass and per mode")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default="16MiB,64KiB")
    ap.add_argument("--threads", type=int, default=4, help="io_threads of posix")
    ap.add_argument("--depth", type=int, default=32, help="io_depth of native; fio's iodepth")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument(
        "--checksum",
        default="",
        help="also run each backend with this TBA_CHECKSUM (e.g. auto), as mode <backend>+<name>",
    )
    args = ap.parse_args(argv)
    total = parse_size(args.total)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.repeats < 1 or any(total < s for s in sizes) or total < (4 << 20):
        ap.error("need --repeats >= 1 and --total at least 4 MiB and the largest size")

    root = tempfile.mkdtemp(prefix="tba-bench-", dir=args.spill_dir)
    # Each backend: one slab for the raw passes and one for the coalesced passes.
    backends = {n: open_named(n, root, 2 * total, args) for n in ("posix", "native")}
    backends = {n: b for n, b in backends.items() if b is not None}
    have_fio = shutil.which("fio") is not None
    align = next(iter(backends.values())).alignment
    pool_t = aligned_empty(min(POOL_BYTES, total), align)
    pool_t.random_(0, 256)
    pool = as_memoryview(pool_t)
    for b in backends.values():
        register(b, pool_t)
    print(machine_line(args.spill_dir))
    for name, b in backends.items():
        print(f"{name}: {b.reason}")
    print(f"total {format_size(total)} per pass, {args.repeats} repeats, fio: {have_fio}")
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    ref_fd = open_unnamed(dir_fd, root, True, "ref")
    os.close(dir_fd)
    os.posix_fallocate(ref_fd, 0, total)

    base_modes = ["reference", *(["fio"] if have_fio else []), *backends]
    results: dict[tuple[str, str, str], list[tuple[float, float]]] = {}  # (GiB/s, cpu s/GiB)
    t_start = time.perf_counter()
    try:
        for size in sizes:
            count = total // size
            label = format_size(size)
            extents = {n: [b.allocate(size) for _ in range(count)] for n, b in backends.items()}
            coalesced = {}
            modes = list(base_modes)
            if args.checksum:
                modes += [f"{n}+{args.checksum}" for n in backends]
            digests = {n: [] for n in backends}
            if size == TENSOR:
                coalesced = {n: Coalesced(b, total, pool_t) for n, b in backends.items()}
                modes += [f"{n}+coalesce" for n in coalesced]
            # Untimed warm-up: first writes to fallocated space convert unwritten extents.
            run_reference(ref_fd, pool, size, count, True)
            for n, b in backends.items():
                run_backend(b, extents[n], pool, size, True)
            for c in coalesced.values():
                c.write()
            if have_fio:
                run_fio(root, size, total, True, args.depth)
            for rep in range(args.repeats):
                order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
                for write in (True, False):
                    op = "write" if write else "read"
                    for mode in order:
                        if mode == "fio":
                            got = run_fio(root, size, total, write, args.depth)
                            gibs, cpu = got if got else (float("nan"), float("nan"))
                            moved = total / GIB
                        else:
                            if mode == "reference":
                                fn = partial(run_reference, ref_fd, pool, size, count, write)
                            elif mode.endswith("+coalesce"):
                                c = coalesced[mode.split("+")[0]]
                                fn = c.write if write else c.read
                            elif "+" in mode:  # a backend with the checksum on
                                n = mode.split("+")[0]
                                b, ext = backends[n], extents[n]
                                fn = partial(
                                    run_backend, b, ext, pool, size, write, args.checksum,
                                    digests[n],
                                )  # fmt: skip
                            else:
                                b, ext = backends[mode], extents[mode]
                                fn = partial(run_backend, b, ext, pool, size, write)
                            dt, cpu = timed(fn)
                            moved = total / GIB
                            gibs = moved / dt
                        results.setdefault((label, op, mode), []).append((gibs, cpu / moved))
            for n, b in backends.items():
                for e in extents[n]:
                    b.free(e)
            for c in coalesced.values():
                c.close()
    finally:
        os.close(ref_fd)
        for b in backends.values():
            b.close()
        shutil.rmtree(root, ignore_errors=True)

    base = "fio" if have_fio else "reference"
    big = format_size(max(sizes))
    summary: dict[str, dict] = {}
    print()
    print(
        f"median GiB/s and CPU-s/GiB over {args.repeats} repeats; 'vs {base}@{big}' = the "
        f"mode's median over {base}'s median at {big} for the same op; 'vs {base}' = over "
        f"{base} at the same size; 'paired' = median of per-repeat ratios (robust to drift)"
    )
    print(
        f"{'size':>6} {'op':>5} {'mode':<16} {'GiB/s':>7} {'min-max':>11} {'cpu s/GiB':>9} "
        f"{'vs ' + base:>10} {'paired':>6} {'vs ' + base + '@' + big:>16}"
    )
    for (label, op, mode), vals in results.items():
        gibs = [v[0] for v in vals]
        med = statistics.median(gibs)
        cpu = statistics.median(v[1] for v in vals)
        ref_vals = [v[0] for v in results[(label, op, base)]]
        ref = statistics.median(ref_vals)
        paired = statistics.median(g / r for g, r in zip(gibs, ref_vals))
        top = statistics.median(v[0] for v in results[(big, op, base)])
        summary[f"{label} {op} {mode}"] = {
            "gibs": med,
            "cpu_s_per_gib": cpu,
            f"vs_{base}": med / ref,
            "paired": paired,
            f"vs_{base}_{big}": med / top,
            "all": gibs,
        }
        print(
            f"{label:>6} {op:>5} {mode:<16} {med:>7.2f} {min(gibs):>5.2f}-{max(gibs):<5.2f} "
            f"{cpu:>9.3f} {med / ref:>10.2f} {paired:>6.2f} {med / top:>16.2f}"
        )
    print(f"\nelapsed {time.perf_counter() - t_start:.0f} s")
    dump_json(args.json, args.spill_dir, results=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
