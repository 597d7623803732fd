"""Defaults on a real model: a 6-layer HF Llama with ``tba.Offloader()`` and no settings.

The model a new user tries first (issue 16, "Defaults save memory on real models"):
``LlamaForCausalLM`` built from a config (6 layers, hidden 768, 12 heads, 4 KV heads, MLP
2048, vocab 32000), sequence 512, batch 4, fp32, on the CPU. Each step runs once without tba
and once under ``off.step(model)``, interleaved (which goes first alternates), on the same
weights and batch, so the losses must match bit for bit. Per step it prints both times and
tba's ``peak_resident_bytes / saved_bytes``, K and the read-ahead window; at the end the median
step-time ratio (steps from ``--skip`` on) and whether peak / saved stayed within ``--target``
from step 5 on. Targets (issue 16): peak / saved <= 0.35 by step 5 and after, step time <= 1.05x.

    python benchmarks/bench_defaults.py [--steps 30] [--skip 2] [--json out.json]

No ``TBA_*`` variable is set here: the environment the script runs in decides, as it would
for a user (unset them for the defaults). Needs ``transformers``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _machine import machine_line  # noqa: E402
from _stats import paired_ratio, ratio_interval  # noqa: E402

import tba  # noqa: E402
from tba.testing import warm_cpu_math  # noqa: E402

VOCAB, SEQ, BATCH = 32000, 512, 4


def build_llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def one_step(model, ids, off):
    """Forward and backward once; returns (seconds, loss)."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    if off is None:
        loss = model(input_ids=ids, labels=ids).loss
    else:
        with off.step(model):
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return time.perf_counter() - t0, loss.item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="steps of each mode (default 30)")
    ap.add_argument("--skip", type=int, default=2, help="steps left out of the time medians")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--target", type=float, default=0.35, help="peak / saved to stay within")
    ap.add_argument("--json", help="write every step's figures here")
    args = ap.parse_args(argv)
    warm_cpu_math()  # losses are compared bit for bit (NOTE [First-call math])
    model = build_llama(args.layers)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    rows = []
    with tba.Offloader() as off:
        machine = machine_line(off.config.spill_dir)
        print(machine)
        print(f"tba backend: {off.backend.name if off.backend else 'disabled'}")
        print("step   none s    tba s   ratio   peak/saved        saved   K   window")
        for step in range(1, args.steps + 1):
            order = ("none", "tba") if step % 2 else ("tba", "none")
            got = {}
            for mode in order:
                got[mode] = one_step(model, ids, off if mode == "tba" else None)
            if got["none"][1] != got["tba"][1]:
                print(f"step {step}: losses differ: {got['none'][1]!r} vs {got['tba'][1]!r}")
                return 1
            st = off.stats()
            share = st["peak_resident_bytes"] / max(1, st["saved_bytes"])
            row = {
                "step": step,
                "none_seconds": got["none"][0],
                "tba_seconds": got["tba"][0],
                "peak_resident_bytes": st["peak_resident_bytes"],
                "saved_bytes": st["saved_bytes"],
                "peak_share": share,
                "keep_last": st["keep_last"],
                "window_bytes": st["prefetch_decision"]["depth"],
                "stall_seconds": st["stall_seconds"],
            }
            rows.append(row)
            print(
                f"{step:4d} {row['none_seconds']:8.2f} {row['tba_seconds']:8.2f} "
                f"{row['tba_seconds'] / row['none_seconds']:7.3f} {share:12.3f} "
                f"{row['saved_bytes'] / 2**20:10.1f}Mi {row['keep_last']:3d} "
                f"{row['window_bytes'] / 2**20:6.1f}Mi",
                flush=True,
            )
    timed = rows[args.skip :] or rows
    none = statistics.median(r["none_seconds"] for r in timed)
    with_tba = statistics.median(r["tba_seconds"] for r in timed)
    late = [r["peak_share"] for r in rows if r["step"] >= 5]
    print(
        f"median step over steps {timed[0]['step']}-{timed[-1]['step']}: none {none:.2f} s, "
        f"tba {with_tba:.2f} s, ratio {with_tba / none:.3f} (target <= 1.05)"
    )
    pairs = [(r["none_seconds"], r["tba_seconds"]) for r in timed]
    lo, hi = ratio_interval(pairs)
    paired = statistics.median(t / n for n, t in pairs)
    gm, se = paired_ratio(pairs)
    print(
        f"spread: median of the per-step ratios {paired:.3f}; 90% bootstrap interval of the "
        f"ratio of medians [{lo:.3f}, {hi:.3f}] (steps resampled in pairs); geometric mean of "
        f"the per-step ratios {gm:.3f} ± {se:.3f}"
    )
    if late:
        ok = max(late) <= args.target
        print(
            f"peak / saved from step 5 on: max {max(late):.3f}, median "
            f"{statistics.median(late):.3f} ({'within' if ok else 'over'} {args.target})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "steps": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
