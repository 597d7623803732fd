"""Run as a process: a small GPT trained with tba.Offloader, configured by TBA_* variables
(TBA_METRICS_DIR included), like one rank of a job.

    python _rank.py --out stats.json [--steps N] [--layers L --hidden H --seq S --batch B]
                    [--wait]

Writes the sums over all steps of ``stats()``'s counters (what the metrics' totals must equal)
to --out after the last step, then, with --wait, stays alive until stdin closes, so that its
live gauges are still there to be scraped.
"""

import argparse
import json
import os
import sys

import torch

import tba
from tba.testing import GPT, GPTConfig, random_batch

COUNTERS = (
    "bytes_offloaded",
    "bytes_reloaded",
    "tensors_offloaded",
    "dedup_hits",
    "forwarded",
    "sync_loads",
    "stall_seconds",
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--wait", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = GPTConfig(seq=args.seq, hidden=args.hidden, heads=args.heads, layers=args.layers)
    model = GPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = random_batch(cfg, args.batch)
    sums = dict.fromkeys(COUNTERS, 0)
    kept: dict[str, int] = {}
    with tba.Offloader(tba.Config()) as off:
        for _ in range(args.steps):
            with off.step(model):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            off.synchronize()  # a step's writes are counted once they land (NOTE [Counted once])
            s = off.stats()
            for k in COUNTERS:
                sums[k] += s[k]
            for reason, n in s["kept_reasons"].items():
                kept[reason] = kept.get(reason, 0) + n
        out = {
            "pid": os.getpid(),
            "rank": off.config.rank,
            "sums": sums,
            "kept_reasons": kept,
            "backend": s["backend"],
        }
        with open(args.out + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(args.out + ".tmp", args.out)
        print("trained", flush=True)
        if args.wait:
            sys.stdin.read()


if __name__ == "__main__":
    main()
