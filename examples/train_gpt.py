"""Train a small GPT on this repository's own text, without and with tba, and compare.

Each mode runs in its own process so that peak RSS is measured separately. The table shows the
median step time, the bytes autograd saved, the most of them held in memory at once, peak RSS,
the bytes written to and read from disk, and whether the losses are bit-identical.

    python examples/train_gpt.py [--steps 8] [--spill-dir /var/tmp] [--batch 16]

tba settings come from the TBA_* environment (docs/configuration.md); --spill-dir sets it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

import tba
from tba.testing import GPT, GPTConfig, warm_cpu_math

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = GPTConfig(vocab=256, seq=256, hidden=256, heads=8, layers=4)


def corpus() -> torch.Tensor:
    """This repo's docs and sources as bytes: a corpus that is always there."""
    files = sorted(glob.glob(os.path.join(ROOT, "*.md"))) + sorted(
        glob.glob(os.path.join(ROOT, "tba", "**", "*.py"), recursive=True)
    )
    parts = []
    for name in files:
        with open(name, "rb") as f:
            parts.append(f.read())
    data = b"\n".join(parts)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(data: torch.Tensor, batch: int, steps: int):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(len(data) - CFG.seq - 1, (batch,), generator=g)
        window = torch.stack([data[s : s + CFG.seq + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def count_saved_bytes(model, x, y) -> int:
    """Unique bytes autograd saves in one forward, parameters excluded (no offload)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in params and not (t.requires_grad and t.is_leaf):
            seen[s._cdata] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    del loss
    return sum(seen.values())


def child(mode: str, steps: int, batch: int) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = corpus()
    off = tba.Offloader() if mode == "tba" else None
    losses, times, totals = [], [], {"written": 0, "read": 0, "peak": 0, "saved": 0}
    for i, (x, y) in enumerate(batches(data, batch, steps)):
        if off is None and i == 0:
            totals["saved"] = count_saved_bytes(model, x, y)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if off is not None:
            with off.step(model):
                loss = model(x, y)
        else:
            loss = model(x, y)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        times.append(dt)
        losses.append(loss.item())
        line = f"[{mode:>4}] step {i + 1}/{steps}  loss {loss.item():.4f}  {dt:6.2f} s"
        if off is not None:
            off.synchronize()  # the step's last writes are counted once they complete
            st = off.stats()
            totals["written"] += st["bytes_offloaded"]
            totals["read"] += st["bytes_reloaded"]
            totals["peak"] = max(totals["peak"], st["peak_resident_bytes"])
            totals["saved"] = st["saved_bytes"]
            line += (
                f"  offloaded {st['bytes_offloaded'] / 2**20:6.1f} MiB"
                f"  peak resident {st['peak_resident_bytes'] / 2**20:6.1f} MiB"
                f"  sync loads {st['sync_loads']}  stall {st['stall_seconds']:.3f} s"
            )
        print(line, flush=True)
    backend = off.stats()["backend"] if off is not None else "-"
    if off is not None:
        off.close()
    if mode == "none":
        totals["peak"] = totals["saved"]  # without offload every saved byte stays resident
    return {
        "mode": mode,
        "backend": backend,
        "losses": [float.hex(v) for v in losses],
        "median_step": statistics.median(times[1:] or times),
        "saved_bytes": totals["saved"],
        "peak_resident_bytes": totals["peak"],
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "bytes_written": totals["written"],
        "bytes_read": totals["read"],
    }


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--spill-dir", help="root directory for spill files (TBA_SPILL_DIR)")
    ap.add_argument("--child", choices=("none", "tba"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # each child computes; the parent compares their losses bit for bit
        warm_cpu_math()  # NOTE [First-call math]
        print("RESULT " + json.dumps(child(args.child, args.steps, args.batch)), flush=True)
        return 0

    env = dict(os.environ)
    if args.spill_dir:
        env["TBA_SPILL_DIR"] = args.spill_dir
    # This model is small: a 32 MiB read-ahead window is ample, and the 128 MiB default would
    # be half of everything it saves. Your TBA_PREFETCH_BYTES, if set, wins.
    env.setdefault("TBA_PREFETCH_BYTES", "32MiB")
    results = {}
    for mode in ("none", "tba"):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode]
        cmd += ["--steps", str(args.steps), "--batch", str(args.batch)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        for line in proc.stdout:
            if line.startswith("RESULT "):
                results[mode] = json.loads(line[7:])
            else:
                print(line, end="", flush=True)
        if proc.wait() != 0 or mode not in results:
            print(f"the {mode} run failed (exit code {proc.returncode})", file=sys.stderr)
            return 1

    same = results["none"]["losses"] == results["tba"]["losses"]
    print()
    print(
        f"GPT {CFG.layers}x{CFG.hidden}, seq {CFG.seq}, batch {args.batch}, {args.steps} steps, "
        f"torch {torch.__version__}, backend {results['tba']['backend']}, "
        f"TBA_PREFETCH_BYTES={env['TBA_PREFETCH_BYTES']}"
    )
    head = ("mode", "step (s)", "saved_bytes", "peak_resident", "peak RSS", "written", "read")
    print(
        f"{head[0]:<6}{head[1]:>10}{head[2]:>14}{head[3]:>15}{head[4]:>12}{head[5]:>13}{head[6]:>13}"
    )
    for mode in ("none", "tba"):
        r = results[mode]
        print(
            f"{mode:<6}{r['median_step']:>10.2f}{mib(r['saved_bytes']):>14}"
            f"{mib(r['peak_resident_bytes']):>15}{mib(r['peak_rss']):>12}"
            f"{mib(r['bytes_written']):>13}{mib(r['bytes_read']):>13}"
        )
    ratio = results["tba"]["median_step"] / results["none"]["median_step"]
    print(f"step time tba/none: {ratio:.3f}   losses identical: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
