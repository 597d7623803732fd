"""Python cost of tba's pack and unpack hooks per saved tensor.

    python benchmarks/bench_hotpath.py [--tensors 2000] [--size 64KiB] [--backends kept,native]

A chain of ``torch.sin`` calls saves one tensor each. The hooks are timed from the inside (the
time spent in ``OffloadHooks.pack``/``unpack``), and the whole forward and backward are timed
against the same chain without tba, interleaved over ``--repeats`` rounds; medians. The capture
memcpy is part of pack. ``kept`` is tba with ``TBA_POLICY=keep`` (hooks on, every tensor kept in
memory: the path of what tba does not move); the backends offload every tensor. Not collected by
pytest.

The last column is deterministic where the times are not: the objects the cyclic GC tracks that
a forward of ``--tensors`` packs leaves alive, per pack (GC off while counting). Young collections
run once per ~700 of them, and a full collection (all of torch's objects) once the survivors
reach a quarter of the tracked total, so this count sets how often pack pays for GC.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _machine import machine_line  # noqa: E402

import tba  # noqa: E402
from tba.config import parse_size  # noqa: E402
from tba.datapath import hook  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--size", default="64KiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", default="kept,memory,native")
    ap.add_argument("--spill-dir", default="/var/tmp")
    args = ap.parse_args(argv)
    n, size = args.tensors, parse_size(args.size)
    torch.set_num_threads(1)
    spent = {"pack": 0.0, "unpack": 0.0}
    real_pack, real_unpack = hook.OffloadHooks.pack, hook.OffloadHooks.unpack

    def timed(kind, real):
        def call(self, x):
            t0 = time.perf_counter()
            try:
                return real(self, x)
            finally:
                spent[kind] += time.perf_counter() - t0

        return call

    hook.OffloadHooks.pack = timed("pack", real_pack)
    hook.OffloadHooks.unpack = timed("unpack", real_unpack)
    x = torch.randn(size // 4, requires_grad=True)

    def chain(off):
        t0 = time.perf_counter()
        with off.step() if off is not None else torch.enable_grad():
            h = x
            for _ in range(n):
                h = torch.sin(h)
        t1 = time.perf_counter()
        h.sum().backward()
        return t1 - t0, time.perf_counter() - t1

    print(machine_line(args.spill_dir))
    print(f"{n} saved tensors of {args.size}, {args.repeats} interleaved rounds, 1 thread")
    head = f"{'backend':<9}{'pack us':>9}{'unpack us':>11}{'fwd +us':>9}{'bwd +us':>9}"
    print(head + f"{'GC objs/pack':>14}")
    spill = tempfile.mkdtemp(prefix="tba-bench-", dir=args.spill_dir)
    try:
        for name in args.backends.split(","):
            kept = name == "kept"
            cfg = tba.Config(
                spill_dir=spill,
                backend="memory" if kept else name,
                policy="keep" if kept else "offload",
                min_offload_bytes=1,
                keep_last=0,
                environ={},
            )
            with tba.Offloader(cfg) as off:
                chain(off)  # warm-up: slabs, staging, first writes
                off.synchronize()
                rows = []
                for _ in range(args.repeats):
                    spent["pack"] = spent["unpack"] = 0.0
                    f1, b1 = chain(off)
                    off.synchronize()
                    pack, unpack = spent["pack"], spent["unpack"]
                    f0, b0 = chain(None)
                    rows.append((pack / n, unpack / n, (f1 - f0) / n, (b1 - b0) / n))
                objs = tracked_per_pack(off, x, n)
            med = [statistics.median(r[i] for r in rows) * 1e6 for i in range(4)]
            print(
                f"{name:<9}{med[0]:>9.1f}{med[1]:>11.1f}{med[2]:>9.1f}{med[3]:>9.1f}{objs:>14.2f}"
            )
    finally:
        os.rmdir(spill)
    return 0


def tracked_per_pack(off, x, n: int) -> float:
    """GC-tracked objects alive after a forward of ``n`` packs (writes settled), per pack."""
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        with off.step():
            h = x
            for _ in range(n):
                h = torch.sin(h)
        off.synchronize()
        alive = len(gc.get_objects()) - before
        h.sum().backward()
        off.synchronize()
    finally:
        gc.enable()
    return alive / n


if __name__ == "__main__":
    raise SystemExit(main())
