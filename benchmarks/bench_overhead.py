"""What tba's hooks cost a step when ops are small: tba's modes against no tba and checkpoint.

    python benchmarks/bench_overhead.py [--models launch,launch512,w1] [--rounds 30]
    python benchmarks/bench_overhead.py --device cuda --models w1   # the same table on a GPU

Models (``tba.testing.GPT``, pre-LN causal blocks, fp32):

- ``launch``: 16 blocks, hidden 128, 4 heads, sequence 64, batch 1, vocab 256: launch-bound,
  a step is a few hundred small ops, so what the hooks do per saved tensor shows in full;
- ``launch512``: the same at hidden 512;
- ``w1``: W1 (6 blocks, hidden 512, 8 heads, sequence 512, micro-batch 8).

Modes, one step of each in turn per round (interleaved: this machine's speed drifts over
minutes), medians of the rounds: ``none``; ``hooks`` (``saved_tensors_hooks`` whose pack and
unpack return their argument: what any Python hook pays per saved tensor, the floor under tba's
modes); ``checkpoint`` (``torch.utils.checkpoint``, non-reentrant, per block); ``save_on_cpu``
(``torch.autograd.graph.save_on_cpu``: every saved tensor copied to host memory, pinned on CUDA;
on the CPU a copy that frees nothing); tba with ``TBA_POLICY=keep`` (hooks on, nothing moved),
the default (offload, adaptive keep-last), ``recompute`` and ``auto``. The table gives each
mode's median step, its ratio to ``none``, the ratio of tba's recompute to ``checkpoint``, and
the saved bytes each tba mode wrote per step. CPU runs use one intra-op thread.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _machine import machine_line  # noqa: E402

import tba  # noqa: E402
from tba.testing import GPT, W1, W1_MICRO_BATCH, GPTConfig, random_batch  # noqa: E402

MODELS = {
    "launch": (GPTConfig(vocab=256, seq=64, hidden=128, heads=4, layers=16), 1),
    "launch512": (GPTConfig(vocab=256, seq=64, hidden=512, heads=4, layers=16), 1),
    "w1": (W1, W1_MICRO_BATCH),
}
MODES = ("none", "hooks", "checkpoint", "save_on_cpu", "keep", "default", "recompute", "auto")


def _same(t):
    return t


def step(model, batch, mode: str, off, sync) -> tuple[float, int]:
    """One forward and backward; (seconds, bytes tba wrote)."""
    model.zero_grad(set_to_none=True)
    model.checkpoint_blocks = mode == "checkpoint"
    sync()
    t0 = time.perf_counter()
    if mode == "hooks":
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):
            loss = model(*batch)
    elif mode == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu(pin_memory=batch[0].is_cuda):
            loss = model(*batch)
    elif off is None:
        loss = model(*batch)
    else:
        with off.step(model):
            loss = model(*batch)
    loss.backward()
    sync()
    dt = time.perf_counter() - t0
    if off is None:
        return dt, 0
    off.synchronize()  # outside the time: the last writes land before the next mode's step
    return dt, off.stats()["bytes_offloaded"]


def offloader(mode: str, spill: str) -> tba.Offloader | None:
    if mode in ("none", "hooks", "checkpoint", "save_on_cpu"):
        return None
    policy = {"default": "offload"}.get(mode, mode)
    return tba.Offloader(tba.Config(spill_dir=spill, policy=policy, environ={}))


def run_model(name: str, args, spill: str) -> None:
    cfg, batch_size = MODELS[name]
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    batch = tuple(t.to(device) for t in random_batch(cfg, batch_size))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    offs = {m: offloader(m, spill) for m in args.modes}
    try:
        for m in args.modes:  # warm-up: allocator, slabs, adaptive keep's first decisions
            for _ in range(args.warmup):
                step(model, batch, m, offs[m], sync)
        times: dict[str, list[float]] = {m: [] for m in args.modes}
        written: dict[str, list[int]] = {m: [] for m in args.modes}
        for r in range(args.rounds):
            order = args.modes if r % 2 == 0 else args.modes[::-1]
            for m in order:
                dt, nbytes = step(model, batch, m, offs[m], sync)
                times[m].append(dt)
                written[m].append(nbytes)
    finally:
        for off in offs.values():
            if off is not None:
                off.close()
    med = {m: statistics.median(times[m]) for m in args.modes}
    print(
        f"\n{name}: {cfg.layers} blocks, hidden {cfg.hidden}, {cfg.heads} heads, seq {cfg.seq}, "
        f"batch {batch_size}, fp32, {device.type}; {args.rounds} interleaved rounds, medians"
    )
    print(f"{'mode':<12}{'step ms':>10}{'vs none':>9}{'vs ckpt':>9}{'written MiB':>13}")
    base, ckpt = med.get("none"), med.get("checkpoint")
    for m in args.modes:
        vs_none = f"{med[m] / base:.3f}" if base else "-"
        vs_ckpt = f"{med[m] / ckpt:.3f}" if ckpt and m in ("checkpoint", "recompute") else ""
        wrote = f"{statistics.median(written[m]) / 2**20:.1f}" if offs[m] is not None else ""
        print(f"{m:<12}{med[m] * 1e3:>10.2f}{vs_none:>9}{vs_ckpt:>9}{wrote:>13}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="launch,launch512,w1")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads on the CPU")
    ap.add_argument("--spill-dir", default=os.environ.get("TBA_SPILL_DIR") or "/var/tmp")
    args = ap.parse_args(argv)
    args.modes = args.modes.split(",")
    unknown = [m for m in args.modes if m not in MODES] + [
        m for m in args.models.split(",") if m not in MODELS
    ]
    if unknown:
        ap.error(f"unknown mode or model {unknown}; modes: {MODES}, models: {tuple(MODELS)}")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    print(machine_line(args.spill_dir))
    spill = tempfile.mkdtemp(prefix="tba-overhead-", dir=args.spill_dir)
    try:
        for name in args.models.split(","):
            run_model(name, args, spill)
    finally:  # the node ledgers (.tba-node-quota, .tba-host-tier) stay by design: ours
        shutil.rmtree(spill)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
