"""W1 with tba plus each tba.layers conversion, against stock: saved bytes, peak, step time.

For each conversion the model is built from the same seed, converted, and stepped with tba and
without it, interleaved with the other conversions; step times are medians over the repeats and
are compared with stock W1 without offload.

    python benchmarks/bench_layers.py [--repeats 3] [--spill-dir /var/tmp] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _machine import machine_line  # noqa: E402
from bench_step import one_step  # noqa: E402

import tba  # noqa: E402
import tba.layers as tl  # noqa: E402
from tba.testing import GPT, W1, W1_MICRO_BATCH, random_batch  # noqa: E402

OPTIONS = {
    "stock": {},
    "gelu=tempo": {"gelu": "tempo"},
    "norm=tempo": {"norm": "tempo"},
    "gelu=tempo,norm=tempo": {"gelu": "tempo", "norm": "tempo"},
    "norm=ms": {"norm": "ms"},
    "gelu=tempo,norm=ms": {"gelu": "tempo", "norm": "ms"},
    "gelu=regelu2": {"gelu": "regelu2"},
}
EXACT = {"stock", "gelu=tempo", "norm=tempo", "gelu=tempo,norm=tempo"}


def build(option: dict) -> GPT:
    torch.manual_seed(0)
    model = GPT(W1)
    if option:
        tl.convert(model, **option)
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spill-dir", default="/var/tmp")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    batch = random_batch(W1, W1_MICRO_BATCH)
    models = {name: build(opt) for name, opt in OPTIONS.items()}
    spill = tempfile.mkdtemp(prefix="tba-bench-", dir=args.spill_dir)
    off = tba.Offloader(tba.Config(spill_dir=spill))
    times = {(n, m): [] for n in OPTIONS for m in ("none", "tba")}
    stats = {}
    try:
        for r in range(1 + args.repeats):
            for name, model in models.items():
                for mode in ("none", "tba"):
                    dt, st, _ = one_step(model, batch, mode, off)
                    if r:
                        times[(name, mode)].append(dt)
                    if st is not None and r:
                        stats[name] = st
                    print(f"  round {r} {name:<24}{mode:<6}{dt:7.3f} s", flush=True)
    finally:
        off.close()
        os.rmdir(spill)

    med = {k: statistics.median(v) for k, v in times.items()}
    base = med[("stock", "none")]
    stock_saved = stats["stock"]["saved_bytes"]
    rows = []
    for name in OPTIONS:
        st = stats[name]
        rows.append(
            {
                "conversion": name,
                "gradient": "exact" if name in EXACT else "changed (see docs/layers.md)",
                "saved_bytes": st["saved_bytes"],
                "saved_vs_stock": st["saved_bytes"] / stock_saved,
                "peak_resident_bytes_tba": st["peak_resident_bytes"],
                "peak_vs_stock_saved": st["peak_resident_bytes"] / stock_saved,
                "step_none_vs_stock": med[(name, "none")] / base,
                "step_tba_vs_stock": med[(name, "tba")] / base,
            }
        )
    print()
    print(machine_line(args.spill_dir))
    print(f"W1 micro-batch {W1_MICRO_BATCH}, {args.repeats} interleaved repeats; ratios against")
    print(f"stock W1 without offload ({base:.3f} s, {stock_saved / 2**20:.1f} MiB saved)")
    cols = ("conversion", "saved MiB", "vs stock", "tba peak MiB", "vs stock", "step", "step+tba")
    print(
        f"{cols[0]:<24}{cols[1]:>10}{cols[2]:>9}{cols[3]:>14}{cols[4]:>9}{cols[5]:>7}{cols[6]:>10}"
    )
    for row in rows:
        print(
            f"{row['conversion']:<24}{row['saved_bytes'] / 2**20:>10.1f}"
            f"{row['saved_vs_stock']:>9.3f}{row['peak_resident_bytes_tba'] / 2**20:>14.1f}"
            f"{row['peak_vs_stock_saved']:>9.3f}{row['step_none_vs_stock']:>7.3f}"
            f"{row['step_tba_vs_stock']:>10.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "machine": machine_line(args.spill_dir)}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
