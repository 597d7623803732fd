"""GPU relay benchmark: tba.relay computing on a CUDA device against plain gradient accumulation
on the same device: step time, torch.cuda.max_memory_allocated, waits.

W1's blocks (tba.testing.W1: 6 pre-LN blocks, H=512, 8 heads, MLP 4H, S=512, fp32; SDPA and
TF32 as torch defaults them), U=4 micro-batches of ``--micro-batch`` sequences, AdamW. Modes:
``plain``: the model on the device, ``(model(x_u, y_u) / U).backward()`` per micro-batch, then
one AdamW step on the device; relay modes (host EPS: weights and AdamW state in host memory, the
optimizer step on the host): ``recompute`` (L2L: layer inputs stashed on the device, each
layer's forward recomputed in the backward), ``recompute, no workers`` (copies and optimizer
steps on the calling thread), ``graph`` (no recompute: each layer's autograd graph kept, its
weights not). ``--warmup`` rounds, then ``--rounds`` rounds of one step of each mode in turn;
medians, per-round paired ratios to plain, and each mode's largest peak allocation of a timed
step. Then, unless ``--depths ''``, device memory by depth: peak allocation of a step of plain
and of the relay with the SSD stash (layer inputs leave the device), at each depth.

    python benchmarks/gpu/bench_relay_gpu.py --json out.json      # ~30-60 s on an H200
    python benchmarks/gpu/bench_relay_gpu.py --dry                 # tiny, on the CPU: CI

The relay's losses differ from plain's after the first step on a GPU: its AdamW runs on the
host, plain's on the device (tests/relay/test_gpu.py: bit-identical to an AdamW on the host).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from tba import Config
from tba.relay import Relay, RelayConfig, layers_of
from tba.testing import GPT, W1, random_batch

MODES = {  # RelayConfig overrides, device aside (None: plain accumulation)
    "plain": None,
    "recompute": {},
    "recompute, no workers": {"workers": False},
    "graph": {"recompute": False},
}
STALLS = ("fetch_wait_seconds", "update_wait_seconds", "stash_wait_seconds", "update_seconds")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measured(dev: torch.device, step) -> tuple[float, int, float]:
    """(seconds, peak bytes allocated above the start, loss) of ``step()``."""
    sync(dev)
    before = 0
    if dev.type == "cuda":
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    loss = step()
    sync(dev)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(dev) - before if dev.type == "cuda" else 0
    return dt, peak, loss


class Plain:
    def __init__(self, model, dev, U):
        self.model = copy.deepcopy(model).to(dev)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.U = U

    def step(self, x, y) -> float:
        total = None
        for xu, yu in zip(x.chunk(self.U), y.chunk(self.U)):
            loss = self.model(xu, yu) / self.U
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total.item()

    def close(self) -> None:
        self.model = self.opt = None


def relay(model, dev, U, storage, **cfg) -> Relay:
    return Relay(
        layers_of(copy.deepcopy(model)),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
        micro_batches=U,
        config=RelayConfig(device=str(dev), **cfg),
        storage=storage,
    )


def speed(a, dev, cfg, storage) -> dict:
    torch.manual_seed(0)
    base = GPT(cfg)
    x, y = random_batch(cfg, a.micro_batch * a.U)
    xd, yd = x.to(dev), y.to(dev)
    runners = {
        m: Plain(base, dev, a.U) if kw is None else relay(base, dev, a.U, storage, **kw)
        for m, kw in MODES.items()
    }
    del base
    times = {m: [] for m in runners}
    peaks = {m: [] for m in runners}
    losses = {m: [] for m in runners}
    stats = {m: [] for m in runners if m != "plain"}
    try:
        for r in range(a.warmup + a.rounds):
            for m, run in runners.items():
                if m == "plain":
                    dt, peak, loss = measured(dev, lambda run=run: run.step(xd, yd))
                else:
                    dt, peak, loss = measured(dev, lambda run=run: run.step(x, y).item())
                losses[m].append(loss)
                if r >= a.warmup:
                    times[m].append(dt)
                    peaks[m].append(peak)
                    if m in stats:
                        stats[m].append(run.stats())
    finally:
        for run in runners.values():
            run.close()
    med = {m: statistics.median(v) for m, v in times.items()}
    out = {}
    for m in runners:
        r = {
            "step_seconds": med[m],
            "step_ratio": med[m] / med["plain"],
            "step_ratio_paired": statistics.median(t / p for t, p in zip(times[m], times["plain"])),
            "max_memory_allocated": max(peaks[m]),
            "first_loss_equals_plain": losses[m][0] == losses["plain"][0],
            "rounds_seconds": times[m],
        }
        if m in stats:
            r.update({k: statistics.median(s[k] for s in stats[m]) for k in STALLS})
            last = stats[m][-1]
            r["workers"] = last["workers"]
            r["weight_bytes_moved"] = last["weight_bytes_moved"]
            r["peak_working_bytes"] = max(s["peak_working_bytes"] for s in stats[m])
        out[m] = r
    mem = out["plain"]["max_memory_allocated"]
    for r in out.values():
        r["memory_ratio"] = r["max_memory_allocated"] / mem if mem else None
    return out


def by_depth(a, dev, cfg, storage) -> dict:
    """Peak device allocation of one step (after one warm-up step) at each depth."""
    x, y = random_batch(cfg, a.micro_batch * a.U)
    out: dict = {"plain": {}, "relay, ssd stash": {}}
    for depth in a.depths:
        torch.manual_seed(0)
        base = GPT(dataclasses.replace(cfg, layers=depth))
        p = Plain(base, dev, a.U)
        xd, yd = x.to(dev), y.to(dev)
        p.step(xd, yd)
        out["plain"][depth] = measured(dev, lambda p=p, xd=xd, yd=yd: p.step(xd, yd))[1]
        p.close()
        r = relay(base, dev, a.U, storage, stash="ssd")
        try:
            r.step(x, y)
            out["relay, ssd stash"][depth] = measured(dev, lambda r=r: r.step(x, y).item())[1]
        finally:
            r.close(restore=False)
    for peaks in out.values():
        vals = list(peaks.values())
        peaks["spread"] = max(vals) / min(vals) - 1 if vals and min(vals) else None
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="a tiny model on the CPU: checks the script")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (one step per mode)")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--blocks", type=int, default=W1.layers)
    ap.add_argument("--depths", default="4,8,16", help="memory by depth ('' to skip)")
    ap.add_argument("--spill-dir", default=None, help="default: TBA_SPILL_DIR, else a temp dir")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    a.U = 4
    a.depths = [int(d) for d in a.depths.split(",") if d]
    cfg = dataclasses.replace(W1, layers=a.blocks)
    if a.dry:
        dev = torch.device("cpu")
        cfg = dataclasses.replace(cfg, vocab=64, seq=32, hidden=64, heads=4, layers=2)
        a.micro_batch, a.warmup, a.rounds = 2, 1, 2
        a.depths = [2, 4] if a.depths else []
    else:
        if not torch.cuda.is_available():
            ap.error("needs a CUDA device (or --dry)")
        dev = torch.device("cuda")
    spill = a.spill_dir or os.environ.get("TBA_SPILL_DIR") or tempfile.gettempdir()
    spill = tempfile.mkdtemp(prefix="tba-relay-gpu-", dir=spill)
    storage = Config(spill_dir=spill, min_free_bytes=0)
    t0 = time.perf_counter()
    try:
        out = run(a, dev, cfg, storage)
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    out["seconds"] = time.perf_counter() - t0
    print(summary(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    bad = [m for m, r in out["modes"].items() if not r["first_loss_equals_plain"]]
    if bad and a.dry:  # on the CPU the first step's loss is the same bits (tests/relay)
        print(f"bench_relay_gpu: first loss differs from plain: {bad}", file=sys.stderr)
        sys.exit(1)
    return out


def run(a, dev, cfg, storage) -> dict:
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dry": a.dry,
        "model": {**dataclasses.asdict(cfg), "dtype": "float32"},
        "micro_batches": a.U,
        "micro_batch": a.micro_batch,
        "warmup": a.warmup,
        "rounds": a.rounds,
        "cpu_threads": torch.get_num_threads(),
        "modes": speed(a, dev, cfg, storage),
        "depths": by_depth(a, dev, cfg, storage) if a.depths else None,  # all 0 on the CPU
    }


def summary(out: dict) -> str:
    mib = 1 << 20
    m = out["model"]
    lines = [
        f"{out['device']}, torch {out['torch']} (CUDA {out['cuda']}), {out['cpu_threads']} "
        "CPU threads",
        f"{m['layers']} blocks H={m['hidden']} S={m['seq']} fp32, U={out['micro_batches']} "
        f"micro-batches of {out['micro_batch']}"
        + (" (dry run: tiny model on the CPU)" if out["dry"] else "")
        + f"; {out['warmup']} warm-up rounds, medians of {out['rounds']}",
        f"{'mode':<22} {'step s':>7} {'x plain':>8} {'paired':>7} {'max alloc MiB':>14} "
        f"{'x plain':>8}  waits: fetch / update / optimizer s",
    ]
    for name, r in out["modes"].items():
        ratio = f"{r['memory_ratio']:>8.3f}" if r["memory_ratio"] else f"{'':>8}"
        row = (
            f"{name:<22} {r['step_seconds']:>7.4f} {r['step_ratio']:>8.2f} "
            f"{r['step_ratio_paired']:>7.2f} {r['max_memory_allocated'] / mib:>14.1f} {ratio}"
        )
        if "fetch_wait_seconds" in r:
            row += (
                f"  {r['fetch_wait_seconds']:.4f} / {r['update_wait_seconds']:.4f} / "
                f"{r['update_seconds']:.4f}"
            )
        lines.append(row)
    d = out.get("depths")
    if d:
        for name, peaks in d.items():
            vals = ", ".join(f"{k}: {v / mib:.1f}" for k, v in peaks.items() if k != "spread")
            spread = peaks.get("spread")
            lines.append(
                f"max alloc MiB by depth, {name}: {vals}"
                + (f" (max/min - 1 = {spread:.1%})" if spread is not None else "")
            )
    lines.append(f"benchmark ran {out.get('seconds', 0):.1f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
