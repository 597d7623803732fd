"""Step time and memory on workload W1: no offload vs tba vs per-block checkpointing.

W1: 6 pre-LN causal transformer blocks, H=512, 8 heads, MLP 4H with GELU, S=512, micro-batch
8, fp32, on the CPU, spill dir on local disk. The modes run interleaved (one step of each, in
turn), since disk and CPU speed drift over minutes; the figures are medians over the repeats.

    python benchmarks/bench_step.py [--repeats 5] [--spill-dir /var/tmp] [--json out.json]
    python benchmarks/bench_step.py --backends native,posix   # one tba mode per backend
    python benchmarks/bench_step.py --max-bps 100MB/s --keeps auto,0  # one mode per keep-K
    python benchmarks/bench_step.py --checksums auto,off  # the checksum's cost
    python benchmarks/bench_step.py --autocast bf16 --recompute-weights 1,0  # weight casts

With ``--backends`` (or ``--keeps``, ``--checksums``), each value gets its own Offloader and
its own interleaved mode (``tba:native``, ``tba:posix``; ``tba:keep=auto``, ``tba:keep=0``;
``tba:checksum=auto``; ``tba:recompute=1``), and the report adds the ratio of the first two.
``--autocast bf16`` (or ``fp16``) runs every mode's forward under ``torch.autocast``; the
report then shows, per tba mode, the bytes written and the weight casts recomputed instead
(NOTE [Weight-derived tensors] in tba/datapath/capture/derived.py). ``--max-bps`` caps
both directions (TBA_MAX_WRITE_BPS/READ_BPS) to emulate a slower disk. ``--io-load`` adds a
mode "none+io": the no-offload step while a background loop writes and reads at the rates
the first tba mode moved in its previous step (benchmarks/_ioload.py), to separate what the
disk traffic itself costs compute here from what tba adds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _ioload import IoLoad  # noqa: E402
from _machine import machine_line  # noqa: E402

import tba  # noqa: E402
from tba.testing import GPT, W1, W1_MICRO_BATCH, random_batch, warm_cpu_math  # noqa: E402


def one_step(model, batch, mode, off, autocast=None):
    """Forward and backward once; returns (seconds, tba stats or None)."""
    model.zero_grad(set_to_none=True)
    model.checkpoint_blocks = mode == "checkpoint"
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        if mode.startswith("tba"):
            with off.step(model):
                loss = model(*batch)
        else:
            loss = model(*batch)
    loss.backward()
    dt = time.perf_counter() - t0
    if off is not None and mode.startswith("tba"):
        off.synchronize()  # outside the time: the last writes are counted once they land
    return dt, (off.stats() if mode.startswith("tba") else None), loss.item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="measured steps per mode")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps per mode first")
    ap.add_argument("--spill-dir", default="/var/tmp", help="root of the spill dir (local disk)")
    ap.add_argument("--batch", type=int, default=W1_MICRO_BATCH)
    ap.add_argument("--seq", type=int, default=W1.seq, help="tokens per sequence (at most 512)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--backends", default="", help="e.g. native,posix: one tba mode per backend")
    ap.add_argument("--keeps", default="", help="e.g. auto,0: one tba mode per TBA_KEEP_LAST")
    ap.add_argument("--checksums", default="", help="e.g. auto,off: one tba mode per TBA_CHECKSUM")
    ap.add_argument(
        "--recompute-weights", default="", help="e.g. 1,0: one tba mode per TBA_RECOMPUTE_WEIGHTS"
    )
    ap.add_argument("--autocast", choices=("bf16", "fp16"), help="forward under torch.autocast")
    ap.add_argument("--max-bps", default=None, help="cap on spill write and read, e.g. 100MB/s")
    ap.add_argument("--no-checkpoint", action="store_true", help="skip the checkpointing mode")
    ap.add_argument(
        "--io-load",
        action="store_true",
        help="add none+io: no offload under disk traffic at the rates tba moved",
    )
    args = ap.parse_args(argv)
    warm_cpu_math()  # losses are compared bit for bit (NOTE [First-call math])
    variants: dict[str, dict] = {}
    for b in (b for b in args.backends.split(",") if b):
        variants[f"tba:{b}"] = {"backend": b}
    for k in (k for k in args.keeps.split(",") if k):
        variants[f"tba:keep={k}"] = {"keep_last": k}
    for c in (c for c in args.checksums.split(",") if c):
        variants[f"tba:checksum={c}"] = {"checksum": c}
    for w in (w for w in args.recompute_weights.split(",") if w):
        variants[f"tba:recompute={w}"] = {"recompute_weights": w}
    if not variants:
        variants["tba"] = {}
    if args.max_bps:
        for v in variants.values():
            v.update(max_write_bps=args.max_bps, max_read_bps=args.max_bps)
    tba_modes = list(variants)
    modes = ["none", *tba_modes] + ([] if args.no_checkpoint else ["checkpoint"])
    if args.io_load:
        modes.insert(1 + len(tba_modes), "none+io")

    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast or "")
    torch.manual_seed(0)
    model = GPT(W1)
    batch = tuple(t[:, : args.seq] for t in random_batch(W1, args.batch))
    spill = tempfile.mkdtemp(prefix="tba-bench-", dir=args.spill_dir)
    offs = {m: tba.Offloader(tba.Config(spill_dir=spill, **v)) for m, v in variants.items()}
    load = IoLoad(spill) if args.io_load else None
    rates = (0.0, 0.0)  # bytes/s written and read by the first tba mode's last step
    moved: list[float] = []  # achieved load rate / target, per none+io step
    times = {m: [] for m in modes}
    stats: dict[str, list] = {m: [] for m in tba_modes}
    losses = {m: set() for m in modes}
    try:
        for r in range(args.warmup + args.repeats):
            for mode in modes:
                if mode == "none+io":
                    load.start(*rates)
                run = mode.removesuffix("+io")
                dt, st, loss = one_step(model, batch, run, offs.get(mode), autocast)
                if mode == "none+io":
                    load.stop()
                    if r >= args.warmup:
                        moved.append(sum(load.moved.values()) / dt / max(sum(rates), 1.0))
                if mode == tba_modes[0]:
                    rates = (st["bytes_offloaded"] / dt, st["bytes_reloaded"] / dt)
                losses[mode].add(loss)
                if r >= args.warmup:
                    times[mode].append(dt)
                if st is not None:
                    stats[mode].append(st)
                print(f"  round {r} {mode:<12} {dt:7.3f} s", flush=True)
    finally:
        for off in offs.values():
            off.close()
        if load is not None:
            load.close()
        os.rmdir(spill)

    med = {m: statistics.median(v) for m, v in times.items()}
    first = tba_modes[0]
    st_all = stats[first]
    last = st_all[-1]
    later = st_all[1:] or st_all  # steps after the first (which has no prefetch plan yet)
    res = {
        "workload": f"W1 micro-batch {args.batch}"
        + (f", {args.seq} tokens" if args.seq != W1.seq else "")
        + (f", autocast {args.autocast}" if args.autocast else ""),
        "median_seconds": med,
        "tba_over_none": med[first] / med["none"],
        "checkpoint_over_none": med["checkpoint"] / med["none"] if "checkpoint" in med else None,
        "tba_over_checkpoint": med[first] / med["checkpoint"] if "checkpoint" in med else None,
        "saved_bytes": last["saved_bytes"],
        "peak_resident_bytes": max(s["peak_resident_bytes"] for s in later),
        "sync_loads_after_step_1": max(s["sync_loads"] for s in later),
        "stall_seconds_median": statistics.median(s["stall_seconds"] for s in later),
        "bytes_offloaded": last["bytes_offloaded"],
        "bytes_reloaded": last["bytes_reloaded"],
        "backend": {m: stats[m][-1]["backend"] for m in tba_modes},
        "backend_reason": {m: stats[m][-1]["backend_reason"] for m in tba_modes},
        "losses_identical": len(set().union(*(losses[m] for m in modes if m != "checkpoint"))) == 1,
        "machine": machine_line(args.spill_dir),
        "config": {
            k: v for k, v in offs[first].config.as_dict().items() if k not in ("spill_dir",)
        },
    }
    res["peak_over_saved"] = res["peak_resident_bytes"] / res["saved_bytes"]
    res["per_mode"] = {}
    for m in tba_modes:
        later_m = stats[m][1:] or stats[m]
        res["per_mode"][m] = {
            "over_none": med[m] / med["none"],
            "paired": statistics.median(t / n for t, n in zip(times[m], times["none"])),
            "keep_last": later_m[-1]["keep_last"],
            "peak_over_saved": max(x["peak_resident_bytes"] for x in later_m)
            / later_m[-1]["saved_bytes"],
            "stall_median": statistics.median(x["stall_seconds"] for x in later_m),
            "sync_loads_max": max(x["sync_loads"] for x in later_m),
            "bytes_offloaded": later_m[-1]["bytes_offloaded"],
            "recomputed_tensors": later_m[-1]["recomputed_tensors"],
            "recomputed_bytes": later_m[-1]["recomputed_bytes"],
        }
    paired = [t / n for t, n in zip(times[first], times["none"])]
    res["tba_over_none_paired"] = statistics.median(paired)
    res["tba_over_none_range"] = (min(paired), max(paired))
    if args.io_load:
        res["io_load"] = {
            "none_io_over_none": med["none+io"] / med["none"],
            "none_io_over_none_paired": statistics.median(
                x / y for x, y in zip(times["none+io"], times["none"])
            ),
            "tba_over_none_io": med[first] / med["none+io"],
            "tba_over_none_io_paired": statistics.median(
                x / y for x, y in zip(times[first], times["none+io"])
            ),
            "achieved_over_target": statistics.median(moved),
        }
    if len(tba_modes) == 2:
        a, b = tba_modes
        res["backend_ratio"] = {
            "modes": f"{a} / {b}",
            "median": med[a] / med[b],
            "paired": statistics.median(x / y for x, y in zip(times[a], times[b])),
        }

    print()
    print(res["machine"])
    print(f"{res['workload']}, {args.repeats} interleaved repeats")
    for m in tba_modes:
        print(f"  {m}: {res['backend_reason'][m]}")
    print(f"{'mode':<14}{'median step (s)':>16}{'vs none':>10}")
    for m in modes:
        print(f"{m:<14}{med[m]:>16.3f}{med[m] / med['none']:>10.3f}")
    lo, hi = res["tba_over_none_range"]
    print(
        f"{first} / none, per-round pairs: median {res['tba_over_none_paired']:.3f} "
        f"(range {lo:.3f} to {hi:.3f})"
    )
    if "backend_ratio" in res:
        r = res["backend_ratio"]
        print(f"{r['modes']} step time:  median {r['median']:.3f}, paired {r['paired']:.3f}")
    if "io_load" in res:
        io = res["io_load"]
        print(
            f"none+io / none (disk traffic alone): median {io['none_io_over_none']:.3f}, "
            f"paired {io['none_io_over_none_paired']:.3f}; load achieved "
            f"{io['achieved_over_target']:.2f} of tba's rate"
        )
        print(
            f"{first} / none+io (tba beyond its traffic): median {io['tba_over_none_io']:.3f}, "
            f"paired {io['tba_over_none_io_paired']:.3f}"
        )
    if res["tba_over_checkpoint"] is not None:
        print(f"{first} / checkpoint step time:   {res['tba_over_checkpoint']:.3f}")
    for m, pm in res["per_mode"].items():
        print(
            f"{m}: keep_last {pm['keep_last']}, peak/saved {pm['peak_over_saved']:.3f}, "
            f"stall median {pm['stall_median']:.3f} s, sync loads max {pm['sync_loads_max']}, "
            f"written {pm['bytes_offloaded'] / 2**20:.1f} MiB, recomputed "
            f"{pm['recomputed_tensors']} tensors ({pm['recomputed_bytes'] / 2**20:.1f} MiB)"
        )
    print(f"saved_bytes:                     {res['saved_bytes'] / 2**20:.1f} MiB")
    print(f"peak_resident_bytes (max):       {res['peak_resident_bytes'] / 2**20:.1f} MiB")
    print(f"peak_resident / saved:           {res['peak_over_saved']:.3f}")
    print(f"sync_loads after step 1 (max):   {res['sync_loads_after_step_1']}")
    print(f"stall_seconds (median):          {res['stall_seconds_median']:.4f}")
    print(f"losses identical (none vs tba):  {res['losses_identical']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
