"""GPU benchmark: a ~1B-parameter Llama-shaped model in bf16 at sequence 4096, with and without
tba: step time, torch.cuda.max_memory_allocated, bytes moved, stall.

Built with plain torch only (RMSNorm, rotary embeddings, grouped-query attention through
``scaled_dot_product_attention``, SwiGLU MLP; no transformers, no network), so it runs on a
bare GPU machine. A step is forward + backward of one micro-batch (no optimizer: it moves no
activations); the modes run interleaved, one step of each in turn, after a warm-up step each,
and the figures are medians. The first timed step's losses and gradients of the two modes are
compared bit for bit (same weights, same batch).

    python benchmarks/gpu/bench_gpu.py --json out.json [--steps 3] [--spill-dir /nvme/tba]
    python benchmarks/gpu/bench_gpu.py --dry   # a tiny model on the CPU: checks the script

Model (--layers 16 --hidden 2048 --heads 16 --kv-heads 4 --ffn 5632 --vocab 32000): about
0.97 B parameters. ``--dry`` uses 2 layers of hidden 64 at sequence 128 on whatever device
is there and is what CI runs (benchmarks/gpu/check.sh --dry).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import tba


class RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rotary(seq: int, dim: int, device, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope(x, cos, sin):
    a, b = x[..., ::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, h: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, h // heads
        self.norm1, self.norm2 = RMSNorm(h), RMSNorm(h)
        self.q = nn.Linear(h, h, bias=False)
        self.kv = nn.Linear(h, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(y).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        g, u = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class Llama(nn.Module):
    def __init__(self, layers, hidden, heads, kv_heads, ffn, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.hd = hidden // heads

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        cos, sin = rotary(tokens.shape[1], self.hd, x.device, x.dtype)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def step(model, off, tokens, targets, dev):
    """One forward + backward; returns (seconds, peak bytes allocated, loss, stats or None)."""
    model.zero_grad(set_to_none=True)
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    if off is None:
        loss = model(tokens, targets)
    else:
        with off.step(model):
            loss = model(tokens, targets)
    loss.backward()
    sync(dev)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    stats = None
    if off is not None:
        off.synchronize()  # the step's last writes are counted once they land
        stats = off.stats()
    return dt, peak, loss.detach(), stats


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="a tiny model: checks the script")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--spill-dir", default=None, help="default: TBA_SPILL_DIR, else a temp dir")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.dry:
        a.layers, a.hidden, a.heads, a.kv_heads, a.ffn, a.vocab, a.seq = 2, 64, 4, 2, 128, 256, 128
        a.steps = 1
    dtype = torch.bfloat16 if dev.type == "cuda" or a.dry else torch.float32
    torch.manual_seed(0)
    model = Llama(a.layers, a.hidden, a.heads, a.kv_heads, a.ffn, a.vocab).to(dev, dtype)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).to(dev)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    spill = a.spill_dir or os.environ.get("TBA_SPILL_DIR") or tempfile.mkdtemp(prefix="tba-gpu-")
    cfg = tba.Config(spill_dir=spill, **({"min_offload_bytes": 1} if a.dry else {}))
    runs: dict[str, list] = {"none": [], "tba": []}
    grads: dict[str, list] = {}
    with tba.Offloader(cfg) as off:
        modes = {"none": None, "tba": off}
        for o in modes.values():  # warm-up: allocator, kernels, slabs, adaptive keep
            step(model, o, x, y, dev)
        for i in range(a.steps):
            for name, o in modes.items():
                runs[name].append(step(model, o, x, y, dev))
                if i == 0:
                    grads[name] = [p.grad.clone() for p in model.parameters()]
        backend = off.stats()["backend"]
    exact = torch.equal(runs["none"][0][2], runs["tba"][0][2]) and all(
        map(torch.equal, grads["none"], grads["tba"])
    )
    del grads
    out = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dry": a.dry,
        "model": {
            "params": params,
            "layers": a.layers,
            "hidden": a.hidden,
            "heads": a.heads,
            "kv_heads": a.kv_heads,
            "ffn": a.ffn,
            "vocab": a.vocab,
            "seq": a.seq,
            "batch": a.batch,
            "dtype": str(dtype).removeprefix("torch."),
        },
        "spill_dir": spill,
        "backend": backend,
        "steps": a.steps,
        "bit_exact": exact,
    }
    for name, rs in runs.items():
        m = {
            "step_seconds": statistics.median(r[0] for r in rs),
            "max_memory_allocated": max(r[1] for r in rs),
        }
        if name == "tba":
            sts = [r[3] for r in rs]
            for k in ("bytes_offloaded", "bytes_reloaded", "stall_seconds", "pack_stall_seconds"):
                m[k] = statistics.median(s[k] for s in sts)
            for k in ("sync_loads", "uploads_ahead", "uploads_at_unpack", "keep_last"):
                m[k] = sts[-1][k]
            m["kept_reasons"] = sts[-1]["kept_reasons"]
        out[name] = m
    base, t = out["none"], out["tba"]
    out["step_ratio"] = t["step_seconds"] / base["step_seconds"]
    out["memory_ratio"] = (
        t["max_memory_allocated"] / base["max_memory_allocated"]
        if base["max_memory_allocated"]
        else None
    )
    print(summary(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if not exact:
        print("bench_gpu: losses or gradients differ between the modes", file=sys.stderr)
        sys.exit(1)
    return out


def summary(out: dict) -> str:
    gib, mib = 1 << 30, 1 << 20
    m, base, t = out["model"], out["none"], out["tba"]
    lines = [
        f"{out['device']}, torch {out['torch']} (CUDA {out['cuda']}), backend {out['backend']}",
        f"model: {m['params'] / 1e9:.2f} B params, {m['layers']} layers, hidden {m['hidden']}, "
        f"seq {m['seq']} x batch {m['batch']}, {m['dtype']}"
        + (" (dry run: tiny model)" if out["dry"] else ""),
        f"{'mode':<6} {'step s':>8} {'max alloc GiB':>14}",
        f"{'none':<6} {base['step_seconds']:>8.3f} {base['max_memory_allocated'] / gib:>14.2f}",
        f"{'tba':<6} {t['step_seconds']:>8.3f} {t['max_memory_allocated'] / gib:>14.2f}",
        f"tba/none: step x{out['step_ratio']:.2f}"
        + (f", memory x{out['memory_ratio']:.2f}" if out["memory_ratio"] else ""),
        f"tba moved {t['bytes_offloaded'] / mib:.1f} MiB out, {t['bytes_reloaded'] / mib:.1f} MiB "
        f"back per step; stall {t['stall_seconds']:.3f} s (packs {t['pack_stall_seconds']:.3f} s)"
        f", sync loads {t['sync_loads']}, H2D ahead {t['uploads_ahead']} / at unpack "
        f"{t['uploads_at_unpack']}, keep_last {t['keep_last']}",
        f"bit-exact (loss and gradients, first timed step): {out['bit_exact']}",
    ]
    if not math.isfinite(out["step_ratio"]):  # pragma: no cover
        lines.append("step ratio is not finite")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
