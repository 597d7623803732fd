"""W1 step time under two allocator settings, in two worker processes run in turn.

    python benchmarks/bench_malloc.py [--repeats 7] [--env MALLOC_MMAP_THRESHOLD_=1048576]

glibc reads its malloc tunables once, at process start, so the two settings need two
processes. Each worker builds W1 (same seed) and a tba Offloader, then runs one step per
command; the parent interleaves them (A none, B none, A tba, B tba, per round) so that drift
on this machine hits both alike, and reports medians and per-round paired ratios. This is the
step-time side of the batch-headroom finding in BENCHMARKS.md: a fixed mmap threshold returns
the memory that tba frees early to the kernel, at the price of page faults on every large
allocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _machine import machine_line  # noqa: E402

WORKER = r"""
import json, sys, tempfile, time, torch, tba
from tba.testing import GPT, W1, W1_MICRO_BATCH, random_batch, warm_cpu_math
warm_cpu_math()  # the losses of all workers are compared bit for bit
torch.manual_seed(0)
model = GPT(W1)
batch = random_batch(W1, int(sys.argv[2]))
off = tba.Offloader(tba.Config(spill_dir=sys.argv[1]))
for line in sys.stdin:
    mode = line.strip()
    if mode == "quit":
        break
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    if mode == "tba":
        with off.step(model):
            loss = model(*batch)
    else:
        loss = model(*batch)
    loss.backward()
    print(json.dumps({"seconds": time.perf_counter() - t0, "loss": loss.item()}), flush=True)
off.close()
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--env", default="MALLOC_MMAP_THRESHOLD_=1048576", help="KEY=VALUE for B")
    ap.add_argument("--spill-dir", default="/var/tmp")
    args = ap.parse_args(argv)
    key, _, value = args.env.partition("=")
    if not key or not _:
        ap.error(f"--env wants KEY=VALUE, not {args.env!r}")
    spill = tempfile.mkdtemp(prefix="tba-bench-", dir=args.spill_dir)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = {**os.environ, "PYTHONPATH": here}
    base.pop(key, None)
    envs = {"A": base, "B": {**base, key: value}}
    workers = {
        n: subprocess.Popen(
            [sys.executable, "-c", WORKER, spill, str(args.batch)],
            env=e,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for n, e in envs.items()
    }
    times = {(w, m): [] for w in workers for m in ("none", "tba")}
    losses = set()
    try:
        for r in range(args.warmup + args.repeats):
            for m in ("none", "tba"):
                for w, p in workers.items():
                    p.stdin.write(m + "\n")
                    p.stdin.flush()
                    got = json.loads(p.stdout.readline())
                    losses.add(got["loss"])
                    if r >= args.warmup:
                        times[(w, m)].append(got["seconds"])
                    print(f"  round {r} {w} {m:<5} {got['seconds']:7.3f} s", flush=True)
    finally:
        for p in workers.values():
            if p.poll() is None:
                p.stdin.write("quit\n")
                p.stdin.flush()
                p.wait(timeout=120)
        os.rmdir(spill)
    med = {k: statistics.median(v) for k, v in times.items()}

    def paired(a, b):
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    print()
    print(machine_line(args.spill_dir))
    print(f"W1 micro-batch {args.batch}, {args.repeats} rounds; A = glibc defaults, B = {args.env}")
    for k, v in med.items():
        print(f"  {k[0]} {k[1]:<5} median {v:.3f} s")
    for m in ("none", "tba"):
        r = med[("B", m)] / med[("A", m)]
        print(f"B / A, {m}: median {r:.3f}, paired {paired(('B', m), ('A', m)):.3f}")
    for w in workers:
        r = med[(w, "tba")] / med[(w, "none")]
        print(f"{w}: tba / none median {r:.3f}, paired {paired((w, 'tba'), (w, 'none')):.3f}")
    print(f"losses identical across allocators and modes: {len(losses) == 1}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
