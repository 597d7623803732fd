"""GPU benchmark: a ~1B-parameter Llama-shaped model in bf16 at sequence 4096, without tba and
under several tba policies: step time, torch.cuda.max_memory_allocated, bytes moved, stall,
what each policy decided, and bit-exactness against no tba.

Built with plain torch only (RMSNorm, rotary embeddings, grouped-query attention through
``scaled_dot_product_attention``, SwiGLU MLP; no transformers, no network), so it runs on a
bare GPU machine. A step is forward + backward of one micro-batch (no optimizer: it moves no
activations). Modes (``--modes``): ``none`` (no tba), ``tba`` (tba's defaults, ``TBA_*``
applied), ``auto`` and ``recompute`` (the defaults with ``policy`` set). Each tba mode has its
own Offloader. Order of work:

1. exactness, under ``torch.use_deterministic_algorithms(True)``: no tba twice (the control),
   then each tba mode after its warm-up steps, losses and gradients compared bit for bit.
   Without deterministic algorithms two runs of the same step differ on a GPU (seen on an
   H200: flash attention's and embedding's backward accumulate in a varying order), so a
   comparison there says nothing about tba; if even the control differs, exactness is
   reported as not checkable rather than as a failure.
2. timing, with the default (nondeterministic) kernels: ``--warmup`` steps per mode (adaptive
   keep and the chooser decide after step 1), then ``--steps`` rounds, one step of each mode in
   turn; the figures are medians, the peak the largest of the timed steps.

    python benchmarks/gpu/bench_gpu.py --json out.json [--steps 5] [--spill-dir /nvme/tba]
    python benchmarks/gpu/bench_gpu.py --dry   # a tiny model on the CPU: checks the script

Model (--layers 16 --hidden 2048 --heads 16 --kv-heads 4 --ffn 5632 --vocab 32000): about
0.85 B parameters. ``--dry`` uses 2 layers of hidden 64 at sequence 128 on whatever device
is there and is what CI runs (benchmarks/gpu/check.sh --dry).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

# cuBLAS is deterministic only with a fixed workspace, set before its first handle (the
# exactness check runs under torch.use_deterministic_algorithms)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tba  # noqa: E402


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


MODES = {  # name: Config overrides on top of tba's defaults (None: no tba)
    "none": None,
    "tba": {},
    "auto": {"policy": "auto"},
    "recompute": {"policy": "recompute"},
}
COUNTERS = ("bytes_offloaded", "bytes_reloaded", "stall_seconds", "pack_stall_seconds")
LAST = ("sync_loads", "uploads_ahead", "uploads_at_unpack", "keep_last", "kept_reasons")


def grads_of(model, off, x, y, dev):
    loss = step(model, off, x, y, dev)[2]
    return [loss.clone(), *(p.grad.clone() for p in model.parameters())]


def exactness(model, offs, x, y, dev) -> dict:
    """Per tba mode: True or False (bit-identical to no tba), or None when the control (no tba
    run twice) already differs; under deterministic algorithms (see the module docstring)."""
    torch.use_deterministic_algorithms(True)
    try:
        ref = grads_of(model, None, x, y, dev)
        control = all(map(torch.equal, ref, grads_of(model, None, x, y, dev)))
        out = {"deterministic_control": control}
        for name, off in offs.items():
            got = grads_of(model, off, x, y, dev)
            out[name] = all(map(torch.equal, ref, got)) if control else None
        return out
    except RuntimeError as e:  # an op without a deterministic implementation
        return {"deterministic_control": None, "error": str(e).splitlines()[0][:300]}
    finally:
        torch.use_deterministic_algorithms(False)


def decided(st: dict) -> str:
    """What the step's policy did to the blocks, in a few words; for ``auto`` also the step
    time its chooser predicted (blocks are timed with the host clock: on a GPU the prediction
    shows how far that is from the kernels' time) and how long it took to decide."""
    d = st.get("policy_decision", {})
    acts = d.get("actions")
    if acts:
        mix = ", ".join(f"{acts.count(a)} {a}" for a in ("keep", "offload", "recompute"))
        return (
            f"{mix} (predicted step {d['predicted_step_seconds']:.3f} s, "
            f"decided in {d.get('decision_seconds', 0.0):.2f} s)"
        )
    return f"{st['policy']}, keep_last {st['keep_last']}"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="a tiny model: checks the script")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per mode")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode")
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
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or "none" not in modes:
        ap.error(f"--modes takes 'none' and any of {', '.join(MODES)}; got {a.modes!r}")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.dry:
        a.layers, a.hidden, a.heads, a.kv_heads, a.ffn, a.vocab, a.seq = 2, 64, 4, 2, 128, 256, 128
        a.warmup, a.steps = 2, 1
    dtype = torch.bfloat16 if dev.type == "cuda" or a.dry else torch.float32
    torch.manual_seed(0)
    model = Llama(a.layers, a.hidden, a.heads, a.kv_heads, a.ffn, a.vocab).to(dev, dtype)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).to(dev)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    spill = a.spill_dir or os.environ.get("TBA_SPILL_DIR") or tempfile.mkdtemp(prefix="tba-gpu-")
    extra = {"min_offload_bytes": 1} if a.dry else {}
    offs = {
        m: tba.Offloader(tba.Config(spill_dir=spill, **extra, **MODES[m]))
        for m in modes
        if m != "none"
    }
    runs: dict[str, list] = {m: [] for m in modes}
    try:
        for m in modes:  # warm-up: allocator, kernels, slabs, adaptive keep, the chooser
            for _ in range(a.warmup):
                step(model, offs.get(m), x, y, dev)
        exact = exactness(model, offs, x, y, dev)
        for _ in range(a.steps):
            for m in modes:
                runs[m].append(step(model, offs.get(m), x, y, dev))
        backend = next(iter(offs.values())).stats()["backend"] if offs else None
    finally:
        for off in offs.values():
            off.close()
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
        "warmup": a.warmup,
        "steps": a.steps,
        "exactness": exact,
        "bit_exact": all(exact.get(m) is not False for m in offs) and "error" not in exact,
        "modes": {},
    }
    for m, rs in runs.items():
        r = {
            "step_seconds": statistics.median(r[0] for r in rs),
            "max_memory_allocated": max(r[1] for r in rs),
        }
        if m != "none":
            sts = [r[3] for r in rs]
            r.update({k: statistics.median(s[k] for s in sts) for k in COUNTERS})
            r.update({k: sts[-1][k] for k in LAST})
            r["decided"] = decided(sts[-1])
            r["bit_exact"] = exact.get(m)
        out["modes"][m] = r
    base = out["modes"]["none"]
    for r in out["modes"].values():
        r["step_ratio"] = r["step_seconds"] / base["step_seconds"]
        mem = base["max_memory_allocated"]
        r["memory_ratio"] = r["max_memory_allocated"] / mem if mem else None
    print(summary(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if not out["bit_exact"]:
        print("bench_gpu: losses or gradients differ from no tba", file=sys.stderr)
        sys.exit(1)
    return out


def summary(out: dict) -> str:
    gib, mib = 1 << 30, 1 << 20
    m = out["model"]
    lines = [
        f"{out['device']}, torch {out['torch']} (CUDA {out['cuda']}), backend {out['backend']}",
        f"model: {m['params'] / 1e9:.2f} B params, {m['layers']} layers, hidden {m['hidden']}, "
        f"seq {m['seq']} x batch {m['batch']}, {m['dtype']}"
        + (" (dry run: tiny model)" if out["dry"] else "")
        + f"; {out['warmup']} warm-up steps, median of {out['steps']}",
        f"{'mode':<10} {'step s':>7} {'x none':>7} {'max alloc GiB':>14} {'x none':>7} "
        f"{'out MiB':>8} {'back MiB':>8} {'stall s':>8}  exact  decided",
    ]
    for name, r in out["modes"].items():
        row = (
            f"{name:<10} {r['step_seconds']:>7.3f} {r['step_ratio']:>7.2f} "
            f"{r['max_memory_allocated'] / gib:>14.2f} "
            + (f"{r['memory_ratio']:>7.3f}" if r["memory_ratio"] else f"{'':>7}")
        )
        if name != "none":
            ex = {True: "yes", False: "NO", None: "n/a"}[r["bit_exact"]]
            row += (
                f" {r['bytes_offloaded'] / mib:>8.1f} {r['bytes_reloaded'] / mib:>8.1f} "
                f"{r['stall_seconds']:>8.3f}  {ex:<5}  {r['decided']}"
            )
        lines.append(row)
    ex = out["exactness"]
    if ex.get("deterministic_control") is None:
        lines.append(f"exactness not checkable: {ex.get('error', 'no result')}")
    elif not ex["deterministic_control"]:
        lines.append(
            "exactness not checkable: no tba differs from itself even with deterministic algorithms"
        )
    else:
        lines.append(
            "exact: losses and gradients bit-identical to no tba under "
            "deterministic algorithms (control: no tba twice, identical)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
