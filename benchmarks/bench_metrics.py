"""What the Prometheus metrics (tba/metrics/__init__.py) add per saved tensor.

    python benchmarks/bench_metrics.py [--tensors 2000] [--size 64KiB] [--rounds 7]

A chain of ``torch.sin`` calls saves one tensor each; every step is forward, backward and
``stats()``. Three Offloaders run interleaved, round by round: metrics off (a no-op object in
place of ``Offloader.metrics``), metrics in memory (no TBA_METRICS_DIR) and metrics written to a
multiprocess directory (TBA_METRICS_DIR). Coalescing is off by default, so every tensor is its
own write and read: the per-I/O work (histogram, device bytes) is paid once per tensor, the
worst case. Columns, per tensor, medians over the rounds:

- ``pack``/``unpack``: time inside the hooks (as benchmarks/bench_hotpath.py measures it);
- ``metrics``: CPU time inside the metrics code (``Offloader._publish`` at the step boundaries
  and in ``stats()``, and every other RankMetrics call, on whichever thread), measured around
  each call with the thread's CPU clock, less the measured cost of that measurement;
  ``calls``: such calls per tensor. The one list append per I/O in ``_io_finished`` is inline,
  so only ``replay`` measures it;
- ``step``: the whole step (forward, backward, stats()) and its difference from metrics off.

On a busy machine everything above is inflated by preemption, so the script also replays the
metrics work of one step on its own (``replay``): each I/O's record (one list append, as
``Offloader._io_finished`` does it), and a ``publish`` that pushes one changed value of every
counter and a step's worth of I/O records, each timed as the best of 7 repeats; per tensor =
2 I/Os x record + (3 publishes + 1 track) / tensors.

Issue 5's goal is under 5 us per tensor. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
import timeit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _machine import machine_line  # noqa: E402

import tba  # noqa: E402
from tba import metrics  # noqa: E402
from tba.config import parse_size  # noqa: E402
from tba.datapath import hook, offloader  # noqa: E402
from tba.records.step import StepState  # noqa: E402

_CALLS = ("track", "io_error", "publish", "close")


class _NoMetrics:
    """Metrics off: every call the Offloader makes, doing nothing."""

    def track(self, *a):
        pass

    def __init__(self):
        self.io_log = []

    def io_error(self, *a):
        pass

    def publish(self, *a):
        pass

    def close(self):
        pass


def _best(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number


def replay(off, orig, n: int) -> tuple[float, float, float]:
    """The metrics work of one step of ``n`` tensors, alone: (record, publishes, per tensor),
    in us."""
    m = off.metrics
    empty = _best(lambda: None, 100_000)
    record = _best(lambda: m.io_log.append((True, 0.001, 65536)), 100_000) - empty
    m.io_log.clear()
    best = float("inf")
    with off.io.lock:
        for _ in range(7):
            st = StepState(-1)
            m.io_log.extend([(True, 0.001, 65536), (False, 0.002, 65536)] * n)
            t0 = time.perf_counter()
            orig["track"](m, st)
            for last in (False, False, True):  # step start, end of forward, stats()
                for f in ("bytes_offloaded", "bytes_reloaded", "tensors_offloaded"):
                    setattr(st, f, getattr(st, f) + 1)
                st.dedup_hits += 1
                st.forwarded += 1
                st.sync_loads += 1
                st.stall_seconds += 1e-6
                st.kept_reasons["small"] += 1
                st.forward_end = 1.0 if last else 0.0  # the last one settles it
                orig["publish"](m, set(), 1 << 20, 1 << 20, 1 << 20, 2)
            best = min(best, time.perf_counter() - t0)
    return record * 1e6, best * 1e6, (2 * record + best / n) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--size", default="64KiB")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--coalesce-bytes", default="0")
    ap.add_argument("--spill-dir", default="/var/tmp")
    args = ap.parse_args(argv)
    n, size = args.tensors, parse_size(args.size)
    torch.set_num_threads(1)
    spent = {"pack": 0.0, "unpack": 0.0, "metrics": 0.0, "calls": 0}

    def timed(kind, real):
        @functools.wraps(real)
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                spent[kind] += time.perf_counter() - t0

        return call

    def cpu_timed(real):  # on any thread: that thread's CPU time, immune to preemption
        @functools.wraps(real)
        def call(*a, **kw):
            t0 = time.thread_time()
            try:
                return real(*a, **kw)
            finally:
                spent["metrics"] += time.thread_time() - t0
                spent["calls"] += 1

        return call

    noop = cpu_timed(lambda: None)
    for k in ("metrics", "calls"):
        spent[k] = 0
    for _ in range(100_000):
        noop()
    probe_cost = spent["metrics"] / spent["calls"]  # the clock's own cost, per call

    orig = {name: getattr(metrics.RankMetrics, name) for name in _CALLS}
    hook.OffloadHooks.pack = timed("pack", hook.OffloadHooks.pack)
    hook.OffloadHooks.unpack = timed("unpack", hook.OffloadHooks.unpack)
    for name in _CALLS:
        setattr(metrics.RankMetrics, name, cpu_timed(getattr(metrics.RankMetrics, name)))
    # Offloader._publish exists for the metrics only: its own work (the steps still alive, the
    # staging sum) counts too; it calls RankMetrics.publish, which is then not timed twice.
    metrics.RankMetrics.publish = orig["publish"]
    offloader.Offloader._publish = cpu_timed(offloader.Offloader._publish)
    x = torch.randn(size // 4, requires_grad=True)

    def step(off):
        for k in spent:
            spent[k] = 0.0
        t0 = time.perf_counter()
        with off.step():
            h = x
            for _ in range(n):
                h = torch.sin(h)
        h.sum().backward()
        off.stats()
        wall = time.perf_counter() - t0
        out = {**spent, "step": wall}
        out["metrics"] = max(0.0, spent["metrics"] - spent["calls"] * probe_cost)
        return out

    work = tempfile.mkdtemp(prefix="tba-bench-metrics-", dir=args.spill_dir)
    offs = {}
    try:
        for label, mdir in (("off", None), ("memory", None), ("dir", f"{work}/metrics")):
            cfg = tba.Config(
                spill_dir=f"{work}/spill",
                backend=args.backend,
                min_offload_bytes=1,
                keep_last=0,
                coalesce_bytes=args.coalesce_bytes,
                metrics_dir=mdir,
                environ={},
            )
            off = offs[label] = tba.Offloader(cfg)
            if label == "off":
                off.metrics.close()
                off.metrics = _NoMetrics()
            step(off)  # warm-up: slabs, staging, first writes
        rows: dict[str, list[dict]] = {k: [] for k in offs}
        for r in range(args.rounds):
            order = list(offs) if r % 2 == 0 else list(reversed(offs))
            for label in order:
                rows[label].append(step(offs[label]))
        backend = offs["off"].backend.name
        print(machine_line(args.spill_dir))
        print(
            f"{n} saved tensors of {args.size} per step, backend {backend}, coalesce "
            f"{args.coalesce_bytes}, {args.rounds} interleaved rounds, 1 thread; us per tensor "
            f"(the CPU clock costs {probe_cost * 1e6:.2f} us per read pair, subtracted)"
        )
        head = ("metrics", "pack", "unpack", "metrics", "calls", "step", "step +")
        print(f"{head[0]:<8}" + "".join(f"{h:>9}" for h in head[1:]))
        base = statistics.median(row["step"] for row in rows["off"]) / n * 1e6
        for label, got in rows.items():
            med = {k: statistics.median(row[k] for row in got) / n * 1e6 for k in got[0]}
            print(
                f"{label:<8}{med['pack']:>9.2f}{med['unpack']:>9.2f}{med['metrics']:>9.3f}"
                f"{med['calls'] / 1e6:>9.3f}{med['step']:>9.2f}{med['step'] - base:>+9.2f}"
            )
        print(f"{'replay':<8}{'record':>9}{'publishes':>11}{'per tensor':>12}  (us)")
        for label in ("memory", "dir"):
            io, pub, per = replay(offs[label], orig, n)
            print(f"{label:<8}{io:>9.3f}{pub:>11.1f}{per:>12.3f}")
    finally:
        for off in offs.values():
            off.close()
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
